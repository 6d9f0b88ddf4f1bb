"""Array operations: layouts, attention kernels, the ring and the other context-parallel
strategies, blockwise FFN and loss."""

from lclm.ops.context_parallel import (
    context_parallel_attention,
    local_attention,
    ring_attention,
)
from lclm.ops.layout import from_layout, stripe, to_layout, unstripe

__all__ = [
    "stripe",
    "unstripe",
    "to_layout",
    "from_layout",
    "ring_attention",
    "local_attention",
    "context_parallel_attention",
]

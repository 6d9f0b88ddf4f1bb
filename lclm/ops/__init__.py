"""Array operations: layouts, attention kernels, the ring, blockwise FFN and loss."""

from lclm.ops.layout import stripe, unstripe, to_layout, from_layout
from lclm.ops.ring_attention import ring_attention, local_attention

__all__ = ["stripe", "unstripe", "to_layout", "from_layout", "ring_attention", "local_attention"]

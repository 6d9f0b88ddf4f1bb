"""Context-parallel attention over the `sp` axis, one module per strategy, and the registry
`attention.strategy` names them in.

The strategy (`contract.Strategy`) decides what crosses the devices; the layout
(`lclm.ops.layout`) decides which tokens each device holds, and masks come from original
positions. `rounds` holds what they share (settings, kernel call sites, the log-sum-exp
merge, `on_mesh`); `ring` (K/V blocks round the ring), `all_gather` (K/V gathered once) and
`ulysses` (all-to-alls trading the sequence split for a head split, and usp: Ulysses inside
a node x the ring across nodes) are the strategies. Every caller asks the registered
`Strategy` (`get_strategy`), never tests a strategy's name.
"""

from __future__ import annotations

from lclm.ops.context_parallel import all_gather, ring, ulysses
from lclm.ops.context_parallel.contract import Strategy
from lclm.ops.context_parallel.ring import local_attention, ring_attention

# name -> Strategy, in the order the planner and the docs list them
STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    ring.STRATEGY, all_gather.STRATEGY, ulysses.STRATEGY_ULYSSES, ulysses.STRATEGY_USP)}


def get_strategy(name: str) -> Strategy:
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown attention strategy {name!r}; use one of "
                         f"{tuple(STRATEGIES)}") from None


def layout_shards(attention, sp: int) -> int:
    """The shards the token layout splits a sequence into when `attention` (an
    `AttentionConfig` or `config.attention`) runs over `sp` devices: sp, or sp / ulysses
    under usp (each shard cut over its group)."""
    return get_strategy(attention.strategy).layout_shards(sp, attention.ulysses)


def kernel_block(attention, sp: int, seq_len: int) -> int:
    """The run of consecutive positions a kernel's tiles stay inside (`Kernel.limits`'
    `block`) when `attention` runs over `sp` devices: a ring shard's (half of it with zigzag)
    or the whole sequence's (ulysses: original order)."""
    return get_strategy(attention.strategy).kernel_block(attention.layout, sp, seq_len,
                                                         attention.ulysses)


def context_parallel_attention(q, k, v, *, mesh, strategy="ring", ulysses=1, **kwargs):
    """Attention of global arrays whose sequence axis is sharded over `sp`, by `strategy`
    (a name in `STRATEGIES`; `ulysses`: usp's Ulysses degree); `kwargs` and the result as
    `ring_attention`'s."""
    return get_strategy(strategy).attention(q, k, v, mesh=mesh, ulysses=ulysses, **kwargs)


__all__ = ["STRATEGIES", "Strategy", "context_parallel_attention", "get_strategy",
           "kernel_block", "local_attention", "ring_attention", "layout_shards"]

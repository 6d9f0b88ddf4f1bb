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
STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (ring.STRATEGY, all_gather.STRATEGY, ulysses.STRATEGY_ULYSSES, ulysses.STRATEGY_USP)
}


def get_strategy(name: str) -> Strategy:
    """The registered strategy `name`, its options at their defaults."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(
            f"unknown attention strategy {name!r}; use one of {tuple(STRATEGIES)}"
        ) from None


def strategy_of(attention) -> Strategy:
    """The strategy `attention` (an `AttentionConfig` or `config.attention`) names, holding
    its own options' values (usp: its Ulysses degree)."""
    return get_strategy(attention.strategy).configured(attention)


def option_problem(attention) -> str | None:
    """Why `attention` sets an option of a strategy it does not run (None: it sets none), one
    line naming the fix."""
    own = get_strategy(attention.strategy).options
    for other in STRATEGIES.values():
        for option in other.options:
            value, default = getattr(attention, option), getattr(other, option)
            if option not in own and value != default:
                what = other.option_words.get(option, f"an option of '{other.name}'")
                return (
                    f"attention.{option}={value!r} is {what}; set attention.strategy="
                    f"'{other.name}' or leave attention.{option}={default!r}"
                )
    return None


def layout_shards(attention, sp: int) -> int:
    """The shards the token layout splits a sequence into when `attention` (an
    `AttentionConfig` or `config.attention`) runs over `sp` devices: sp, or sp / ulysses
    under usp (each shard cut over its group)."""
    return strategy_of(attention).layout_shards(sp)


def kernel_block(attention, sp: int, seq_len: int) -> int:
    """The run of consecutive positions a kernel's tiles stay inside (`Kernel.limits`'
    `block`) when `attention` runs over `sp` devices: a ring shard's (half of it with zigzag)
    or the whole sequence's (ulysses: original order)."""
    return strategy_of(attention).kernel_block(attention.layout, sp, seq_len)


def context_parallel_attention(q, k, v, *, mesh, strategy: str | Strategy = "ring", **kwargs):
    """Attention of global arrays whose sequence axis is sharded over `sp`, by `strategy` (a
    `Strategy`, e.g. `strategy_of(attention)`, or a name in `STRATEGIES`: its options at
    their defaults); `kwargs` and the result as `ring_attention`'s."""
    chosen = get_strategy(strategy) if isinstance(strategy, str) else strategy
    return chosen.attention(q, k, v, mesh=mesh, **kwargs)


__all__ = [
    "STRATEGIES",
    "Strategy",
    "context_parallel_attention",
    "get_strategy",
    "kernel_block",
    "local_attention",
    "ring_attention",
    "layout_shards",
    "option_problem",
    "strategy_of",
]

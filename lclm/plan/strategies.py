"""Context-parallel strategies compared before a run: per device and training step, what each
strategy sends over each kind of link, whether that hides behind compute, and the memory it
adds (`python -m lclm.plan --strategies`).

Each strategy prices itself (`Strategy.cost`, in its module under lclm/ops/context_parallel/,
where its docstring gives the formula) from what `Step` holds, for a sequence split over n
devices (`mesh.sp`), per layer and micro-batch: one device's K and V block `kv` (batch x
seq/n x kv heads x head_dim x 2 x dtype bytes), its query block `q`, a block pair's FLOPs.

Times are at the device's peak FLOP/s and the link's one-way bandwidth: a real step computes
slower, so a transfer shown hidden stays hidden, and an exposed one costs at most this. Links:
`--device` names one (e.g. h100-nvlink); with `--devices-per-node` the devices of a node talk
over it and those of different nodes over the family's `-ib` link (400 Gb/s InfiniBand:
50 GB/s). TPU slices have one interconnect (ICI) throughout.
"""

from __future__ import annotations

from lclm.config.model import DTYPE_BYTES
from lclm.config.run_config import RunConfig
from lclm.ops.context_parallel import STRATEGIES
from lclm.ops.context_parallel.contract import Step, StrategyCost

__all__ = ["StrategyCost", "attention_step", "compare"]


def attention_step(
    sections: RunConfig,
    sizes: dict[str, int],
    *,
    flops: float,
    fast_gbs: float,
    slow_gbs: float,
    devices_per_node: int,
) -> Step:
    """What a strategy is priced from (`Step`) for `sections` (one stage) on a mesh of `sizes`,
    devices of `flops` peak FLOP/s, links of `fast_gbs` inside a node of `devices_per_node`
    devices and `slow_gbs` between nodes (GB/s, one way)."""
    m = sections.model.resolved()
    n, tp = sizes["sp"], sizes["tp"]
    micro = sections.train.grad_accum
    batch = sections.data.batch_size // micro // (sizes["dp"] * sizes["fsdp"])
    t, b = sections.data.seq_len // n, DTYPE_BYTES[m.dtype]
    heads, kv_heads = m.n_heads // tp, max(m.n_kv_heads // tp, 1)
    # QK^T and PV: 4 t^2 dh FLOPs per head forward, about 2.5 times that backward; causal
    # pairs are half masked on average (striped/zigzag balance them)
    pair = 4 * batch * t * t * m.head_dim * heads * 3.5 / 2
    return Step(
        n=n,
        q=batch * t * heads * m.head_dim * b,
        kv=batch * t * kv_heads * m.head_dim * 2 * b,
        kv_heads=kv_heads,
        heads=heads,
        pair_flops=pair,
        dtype_bytes=b,
        per_step=m.n_layers * micro,
        remat=m.remat,
        flops=flops,
        fast_gbs=fast_gbs,
        slow_gbs=slow_gbs,
        devices_per_node=devices_per_node,
    )


def compare(
    sections: RunConfig,
    sizes: dict[str, int],
    flops: float,
    fast_gbs: float,
    slow_gbs: float,
    devices_per_node: int,
) -> list[StrategyCost]:
    """The costs of every registered strategy for `sections` (one stage) on a mesh of `sizes`
    and links (`attention_step`'s arguments)."""
    step = attention_step(
        sections,
        sizes,
        flops=flops,
        fast_gbs=fast_gbs,
        slow_gbs=slow_gbs,
        devices_per_node=devices_per_node,
    )
    return [strategy.cost(step) for strategy in STRATEGIES.values()]

"""What a context-parallel strategy is in lclm: the questions the trainer, the data pipeline,
the evaluation CLIs and the planner ask of `attention.strategy`, answered by the strategy.

A *strategy* decides what crosses the `sp` devices when attention runs over a sequence split
over them (the layout, `lclm.ops.layout`, still decides which tokens each device holds). It
is a `Strategy` with

- `options`: the `attention` fields that are its own (usp: `ulysses`, its Ulysses degree),
  and `configured(attention)`: the strategy holding their values (the registry holds each
  strategy with its options' defaults); a run that sets another strategy's option is refused
  at start (`option_problem`);
- `attention(q, k, v, *, mesh, layout, causal, segment_ids, q_chunk, kv_chunk, impl)`: the
  attention of global arrays (shapes and result as
  `lclm.ops.context_parallel.ring.ring_attention`'s), differentiable, keeping the forward's
  output and log-sum-exp under `rounds.SAVED_NAMES` for remat='attention';
- `layout_shards(sp)`: the shards the token layout splits a sequence into;
- `kernel_block(layout, sp, seq_len)`: the run of consecutive positions a kernel's tiles stay
  inside (`Kernel.limits`' `block`);
- `limits(heads, tp, sp)`: why it cannot run these heads on this mesh (None: it can), one
  line naming the config keys to change (start-up validation);
- `label(sp)`: how the start-up log names it over `sp` devices;
- `buffers(step)`: the bytes a device holds for one layer's attention beyond q, k, v and o
  (the planner's memory model, `lclm.plan`, charges them);
- `cost(step)`: per device and training step, the bytes it sends over each kind of link,
  the seconds the attention waits for them and the memory it adds (`buffers`; `lclm.plan
  --strategies`).

A new strategy is a module with a `Strategy` subclass, a line in `lclm.ops.context_parallel`'s
registry and its tests (`tests/ops/test_strategies.py` runs every registered one).
"""

from __future__ import annotations

import dataclasses
import math
import typing

from lclm.config.model import REMAT
from lclm.ops.context_parallel.rounds import tile_run


@dataclasses.dataclass(frozen=True)
class Step:
    """What the planner knows of one training step when it prices a strategy: one device's
    attention blocks of one layer and micro-batch (bytes) and its FLOPs, and the links."""

    n: int  # mesh.sp
    q: float  # the device's query block
    kv: float  # its K and V blocks
    kv_heads: int  # KV heads on the device (after tp)
    heads: int  # query heads on the device (after tp)
    pair_flops: float  # one (seq/n x seq/n) block pair, forward and backward
    dtype_bytes: int  # of the compute dtype
    per_step: int  # layers x micro-batches: attentions per training step
    remat: str  # model.remat
    flops: float  # the device's peak FLOP/s
    fast_gbs: float  # one-way GB/s of a link inside a node
    slow_gbs: float  # and between nodes
    devices_per_node: int

    @property
    def recompute(self) -> bool:
        """Whether the backward re-runs the attention's forward (its output is not saved)."""
        return REMAT[self.remat].reruns_attention

    @property
    def crosses(self) -> bool:
        """Whether a ring over sp crosses nodes (sp is the mesh's innermost axis:
        consecutive devices, so a node holds whole rings of up to devices_per_node)."""
        return self.n > self.devices_per_node

    @property
    def ring_link(self) -> str:
        return "between nodes" if self.crosses else "in a node"

    @property
    def ring_gbs(self) -> float:
        return self.slow_gbs if self.crosses else self.fast_gbs


@dataclasses.dataclass
class StrategyCost:
    strategy: str
    split: str  # how the sequence is split, e.g. "ring 8" or "ulysses 8 x ring 4"
    sent: dict[str, float]  # link -> bytes each device sends per step over it
    exposed_s: float  # seconds per step the attention waits for transfers
    memory: float  # bytes per device the strategy holds beyond q, k, v, o
    note: str = ""


def ring_bytes(step: Step, hops: int) -> float:
    """Bytes one device sends per layer in a ring of `hops` + 1 devices: K/V forward and
    again backward (and where the backward re-runs the forward), the float32 dK/dV home."""
    b = step.dtype_bytes
    return (2 * hops + (hops + 1) * 4 / b + (hops if step.recompute else 0)) * step.kv


def ring_exposed_s(step: Step, hops: int, pair_flops: float) -> float:
    """Seconds per layer a ring of `hops` + 1 devices waits for its transfers: each hop's K/V
    block (forward, and again with the float32 dK/dV backward) beyond what the block pair's
    attention (`pair_flops`) it overlaps takes at peak."""
    hop_s = step.kv / (step.ring_gbs * 1e9)
    return max(0.0, hop_s * (2 + 4 / step.dtype_bytes) - pair_flops / step.flops) * hops


def ring_buffers(step: Step) -> float:
    """Bytes a ring member holds beyond q, k, v, o: the K/V block in flight and the float32
    dK/dV accumulators that travel with it."""
    return 2 * step.kv + step.kv * 4 / step.dtype_bytes


def all_to_all_bytes(step: Step, u: int) -> tuple[float, float, str]:
    """(bytes sent per layer, bytes of its buffers, note) of Ulysses' all-to-alls over `u`
    devices: q, k, v in and o out forward, do in and dq, dk, dv out backward, and q, k, v in
    again where the backward runs the layer's forward again (every remat policy but
    'none')."""
    repeat = u // math.gcd(step.kv_heads, u)  # as `kv_repeats`: KV head copies per device
    kv = step.kv * repeat
    note = f"KV heads replicated x{repeat}" if repeat > 1 else ""
    again = not REMAT[step.remat].everything
    moved = 2 * (2 * step.q + kv) + ((step.q + kv) if again else 0)
    return moved * (u - 1) / u, 2 * step.q + kv, note


@dataclasses.dataclass(frozen=True)
class Strategy:
    """A context-parallel strategy (see the module docstring for the contract). The defaults
    are those of a strategy that splits the sequence over all of sp in the layout's order and
    has no options of its own. A subclass with options declares them as dataclass fields
    named as their `attention` fields, with the same defaults, and lists them in `options`."""

    name: typing.ClassVar[str] = ""
    options: typing.ClassVar[tuple[str, ...]] = ()
    # what each option is, in the words of the message that refuses it under another strategy
    option_words: typing.ClassVar[dict[str, str]] = {}

    def configured(self, attention) -> Strategy:
        """This strategy with its options' values in `attention` (an `AttentionConfig` or
        `config.attention`)."""
        return dataclasses.replace(self, **{o: getattr(attention, o) for o in self.options})

    def attention(self, q, k, v, *, mesh, **kwargs):
        raise NotImplementedError

    def layout_shards(self, sp: int) -> int:
        return sp

    def kernel_block(self, layout: str, sp: int, seq_len: int) -> int:
        return tile_run(layout, self.layout_shards(sp), seq_len)

    def limits(self, *, heads: int, tp: int, sp: int) -> str | None:
        del heads, tp, sp
        return None

    def label(self, sp: int) -> str:
        del sp
        return self.name

    def buffers(self, step: Step) -> float:
        """Bytes a device holds for one layer's attention beyond q, k, v and o."""
        raise NotImplementedError

    def cost(self, step: Step) -> StrategyCost:
        raise NotImplementedError

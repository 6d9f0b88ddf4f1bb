"""Context-parallel strategies compared before a run: per device and training step, what each
strategy sends over each kind of link, whether that hides behind compute, and the memory it
adds (`python -m lclm.plan --strategies`).

Strategies (`attention.strategy`), for a sequence split over n devices (`mesh.sp`), `b` the
compute dtype's bytes, per layer and micro-batch, `kv` = one device's K and V block
(batch x seq/n x kv heads x head_dim x 2 x b) and `q` its query block:

- ring: K/V blocks travel n - 1 hops forward; in the backward K/V travel again and the float32
  dK/dV accumulators n hops home: sent = (2 (n - 1) + n 4/b) kv (+ (n - 1) kv where remat
  recomputes the forward). Each hop overlaps one block pair's attention: hidden while a block
  pair's FLOPs outlast one block's transfer.
- all_gather: K/V gathered once forward and once backward (again where remat re-runs the
  forward), the float32 dK/dV reduce-scattered: sent = (2 + 4/b (+ 1)) (n - 1) kv. The gather
  waits for the layer's K/V projection and the attention waits for the gather: exposed, but
  one collective instead of n - 1 small ones, and memory for the whole sequence's K/V (n kv)
  plus its float32 gradient.
- ulysses: all-to-alls move q, k, v in and o out (forward), do in and dq, dk, dv out
  (backward), and q, k, v in again under every remat policy but 'none' (the backward re-runs
  them), each sending (n - 1)/n of its tensor: sent = (2 (2 q + kv') (+ q + kv')) (n - 1)/n,
  where kv' counts KV heads repeated n / gcd(kv heads, n) times when a device's KV heads do
  not split over n. Per-device bytes do not grow with n; exposed (the attention waits for
  them). The query heads per device must divide by n.
- usp: ulysses over the u devices of a node (fast links) and the ring over the r = n / u
  nodes (slow links): the ring's hops carry the same kv bytes but only r - 1 of them cross
  nodes.

Times are at the device's peak FLOP/s and the link's one-way bandwidth: a real step computes
slower, so a transfer shown hidden stays hidden, and an exposed one costs at most this. Links:
`--device` names one (e.g. h100-nvlink); with `--devices-per-node` the devices of a node talk
over it and those of different nodes over the family's `-ib` link (400 Gb/s InfiniBand:
50 GB/s). TPU slices have one interconnect (ICI) throughout.
"""

from __future__ import annotations

import dataclasses
import math

from lclm.config import LlamaConfig

_BYTES = {"float32": 4, "bfloat16": 2}


@dataclasses.dataclass
class StrategyCost:
    strategy: str
    split: str                  # how the sequence is split, e.g. "ring 8" or "ulysses 8 x ring 4"
    sent: dict[str, float]      # link -> bytes each device sends per step over it
    exposed_s: float            # seconds per step the attention waits for transfers
    memory: float               # bytes per device the strategy holds beyond q, k, v, o
    note: str = ""


@dataclasses.dataclass
class _Shapes:
    """One device's attention blocks of one layer and micro-batch (bytes) and its FLOPs."""
    q: float
    kv: float
    kv_heads: int               # KV heads on the device (after tp)
    heads: int                  # query heads on the device (after tp)
    pair_flops: float           # one (seq/n x seq/n) block pair, forward and backward


def _shapes(m: LlamaConfig, batch: int, seq_len: int, n: int, tp: int) -> _Shapes:
    t, b = seq_len // n, _BYTES[m.dtype]
    heads, kv_heads = m.n_heads // tp, max(m.n_kv_heads // tp, 1)
    # QK^T and PV: 4 t^2 dh FLOPs per head forward, about 2.5 times that backward; causal
    # pairs are half masked on average (striped/zigzag balance them)
    pair = 4 * batch * t * t * m.head_dim * heads * 3.5 / 2
    return _Shapes(q=batch * t * heads * m.head_dim * b,
                   kv=batch * t * kv_heads * m.head_dim * 2 * b, kv_heads=kv_heads,
                   heads=heads, pair_flops=pair)


def _ring(s: _Shapes, hops: int, b: int, recompute: bool) -> float:
    """Bytes one device sends per layer in a ring of `hops` + 1 devices."""
    return (2 * hops + (hops + 1) * 4 / b + (hops if recompute else 0)) * s.kv


def _ulysses(s: _Shapes, u: int, recompute: bool) -> tuple[float, float, str]:
    """(bytes sent per layer, bytes of its buffers, note) of all-to-alls over `u` devices:
    q, k, v in and o out forward, do in and dq, dk, dv out backward, and q, k, v in again
    where the backward re-runs the forward (`lclm.ops.context_parallel`: every remat policy
    but 'none')."""
    repeat = u // math.gcd(s.kv_heads, u)   # as `kv_repeats`: KV head copies per device
    kv = s.kv * repeat
    note = f"KV heads replicated x{repeat}" if repeat > 1 else ""
    moved = 2 * (2 * s.q + kv) + ((s.q + kv) if recompute else 0)
    return moved * (u - 1) / u, 2 * s.q + kv, note


def _sum(*sent: dict[str, float]) -> dict[str, float]:
    """Bytes per link, added over several transfers."""
    total: dict[str, float] = {}
    for part in sent:
        for link, nbytes in part.items():
            total[link] = total.get(link, 0.0) + nbytes
    return total


def compare(config, sizes: dict[str, int], flops: float, fast_gbs: float,
            slow_gbs: float, devices_per_node: int) -> list[StrategyCost]:
    """The costs of every strategy for `config` (one stage) on a mesh of `sizes`, devices of
    `flops` peak FLOP/s, links of `fast_gbs` inside a node of `devices_per_node` devices and
    `slow_gbs` between nodes (GB/s, one way)."""
    m = LlamaConfig.from_config(config.model)
    n, tp = sizes["sp"], sizes["tp"]
    micro = config.train.grad_accum
    batch = config.data.batch_size // micro // (sizes["dp"] * sizes["fsdp"])
    s = _shapes(m, batch, config.data.seq_len, n, tp)
    b = _BYTES[m.dtype]
    per_step = m.n_layers * micro
    recompute = m.remat in ("full", "dots", "dots_no_batch")
    # ulysses' backward re-runs its forward all-to-alls under every policy but 'none'
    a2a_again = m.remat != "none"
    # sp is the mesh's innermost axis: consecutive devices, so a node holds whole rings
    # of up to devices_per_node devices
    crosses = n > devices_per_node
    ring_link = "between nodes" if crosses else "in a node"
    ring_gbs = slow_gbs if crosses else fast_gbs
    costs = []

    sent = _ring(s, n - 1, b, recompute)
    hop_s = s.kv / (ring_gbs * 1e9)   # one block's hop; the dK/dV return shares its rounds
    compute_s = s.pair_flops / flops
    exposed = max(0.0, hop_s * (2 + 4 / b) - compute_s) * (n - 1)
    costs.append(StrategyCost("ring", f"ring {n}", {ring_link: sent * per_step},
                              exposed * per_step, 2 * s.kv + s.kv * 4 / b))

    # gathered forward and again backward (and where remat re-runs the forward), float32
    # dK/dV reduce-scattered
    sent = (2 + 4 / b + (1 if recompute else 0)) * (n - 1) * s.kv
    costs.append(StrategyCost("all_gather", f"all-gather {n}", {ring_link: sent * per_step},
                              sent / (ring_gbs * 1e9) * per_step, n * s.kv * (1 + 4 / b)))

    sent, buffers, note = _ulysses(s, n, a2a_again)
    if crosses:   # of what each device sends, the part for other nodes crosses slow links
        inside = sent * (devices_per_node - 1) / (n - 1)
        split = {"in a node": inside * per_step, "between nodes": (sent - inside) * per_step}
        exposed = max(inside / (fast_gbs * 1e9), (sent - inside) / (slow_gbs * 1e9))
    else:
        split = {"in a node": sent * per_step}
        exposed = sent / (fast_gbs * 1e9)
    if s.heads % n:
        note = f"{s.heads} query heads per device do not split over sp={n}: cannot run"
    costs.append(StrategyCost("ulysses", f"ulysses {n}", split, exposed * per_step, buffers,
                              note))

    # ulysses over as many devices of a node as the heads allow, the ring over the rest;
    # on one interconnect (a TPU slice) the largest such split
    u = min(n, devices_per_node, s.heads)
    while n % u or s.heads % u:
        u -= 1
    r = n // u
    link = "between nodes" if n > devices_per_node else "in a node"
    if r > 1 and u > 1:   # both parts, else it is plain ring or plain ulysses
        s_r = _shapes(m, batch, config.data.seq_len, n, tp)   # same bytes per hop
        a2a, buffers, note = _ulysses(s, u, a2a_again)
        ring_sent = _ring(s_r, r - 1, b, recompute)
        ring_gbs = slow_gbs if link == "between nodes" else fast_gbs
        ring_exposed = max(0.0, s_r.kv / (ring_gbs * 1e9) * (2 + 4 / b)
                           - s_r.pair_flops * u / flops) * (r - 1)
        costs.append(StrategyCost(
            "usp", f"ulysses {u} x ring {r}",
            _sum({"in a node": a2a * per_step}, {link: ring_sent * per_step}),
            (a2a / (fast_gbs * 1e9) + ring_exposed) * per_step,
            buffers + 2 * s.kv + s.kv * 4 / b,
            ", ".join(filter(None, [f"attention.ulysses={u}", note]))))
    else:   # listed all the same, as the strategy it equals here (never dropped silently)
        same = {c.strategy: c for c in costs}["ulysses" if u > 1 else "ring"]
        costs.append(dataclasses.replace(
            same, strategy="usp", split=f"ulysses {u} x ring {r}",
            note=", ".join(filter(None, [f"= {same.strategy} here (attention.ulysses={u})",
                                         same.note]))))
    return costs

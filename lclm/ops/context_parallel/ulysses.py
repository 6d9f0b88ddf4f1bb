"""Ulysses (`attention.strategy='ulysses'`, DeepSpeed-Ulysses) and usp (Ulysses x ring).

- ulysses: an all-to-all trades the sequence split for a head split, q/k/v
  `[b, seq/n, heads, d] -> [b, seq, heads/n, d]`; the device puts the whole sequence into
  original order (`from_layout`: a local permutation), runs one-device attention on it (the
  ring with one member, its custom VJP: any kernel, one causal block pair), and the inverse
  all-to-all brings the output back. Segment ids are per token: all-gathered. The
  all-to-alls differentiate into all-to-alls (nothing is summed). Query heads per device
  (after tp) must divide by n; K/V heads that do not are repeated first (`kv_repeats`): head
  c becomes c*r ... c*r + r - 1 with r = n / gcd(kv_heads, n), so query head i still meets
  its K/V head i // (heads / kv_heads) (the dK/dV of the copies add up in autodiff).
- usp: `mesh.sp` = r ring members x u (`attention.ulysses`) consecutive devices. The
  attention's shard_map sees sp split into two named axes of the same devices ('sp': r,
  'ulysses': u inner, so a Ulysses group is a node's neighbours); the sequence is laid out
  for a ring of r (`layout_shards`) and each ring shard cut contiguously over its group, so the
  all-to-all over 'ulysses' rebuilds exactly one ring shard (layout order) with heads/u
  heads, and the ring's own shard_map body runs on it over 'sp' unchanged.

Remat: the backward of both re-runs their forward all-to-alls (the all-to-all'd q/k/v are
not saved) under every policy but 'none'; the ring inside keeps its named residuals.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh

from lclm.ops.context_parallel.contract import (
    Step,
    Strategy,
    StrategyCost,
    all_to_all_bytes,
    ring_buffers,
    ring_bytes,
    ring_exposed_s,
)
from lclm.ops.context_parallel.ring import STRATEGY as RING
from lclm.ops.context_parallel.ring import ring_or_whole
from lclm.ops.context_parallel.rounds import (
    HEAD_AXIS,
    SP,
    Settings,
    kv_repeats,
    make_settings,
    on_mesh,
)
from lclm.ops.layout import from_layout, to_layout

ULYSSES = "ulysses"  # usp's Ulysses axis: the inner factor of sp


def _ulysses(axis: str, n: int, inner, q, k, v, seg):
    """Inside shard_map: q `[b, t, h, d]`, k/v `[b, t, hkv, d]`, seg `[b, t]` or None, the
    sequence split over `axis` (n devices). `inner(q, k, v, seg)` runs on `[b, n t, h/n, d]`
    (K/V: `hkv r / n` heads, see `kv_repeats`), the shards concatenated in device order;
    returns its output back in this device's shard `[b, t, h, d]`."""
    if n == 1:
        return inner(q, k, v, seg)
    rep = kv_repeats(q.shape[2], k.shape[2], n, axis=axis)
    if rep > 1:
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    to_seq = lambda x: lax.all_to_all(x, axis, 2, 1, tiled=True)
    seg = None if seg is None else lax.all_gather(seg, axis, axis=1, tiled=True)
    o = inner(to_seq(q), to_seq(k), to_seq(v), seg)
    return lax.all_to_all(o, axis, 1, 2, tiled=True)


def _in_original_order(settings: Settings, layout: str, n: int, q, k, v, seg):
    """One-device attention (`settings`: a ring of one) of a whole sequence in `layout`'s
    order for `n` shards: permuted to original order, attended, permuted back."""
    orig = lambda x: None if x is None else from_layout(x, layout, n)
    o = ring_or_whole(settings, orig(q), orig(k), orig(v), orig(seg), orig(seg))
    return to_layout(o, layout, n)


def ulysses_attention(
    q,
    k,
    v,
    *,
    mesh,
    layout="striped",
    causal=True,
    segment_ids=None,
    q_chunk=512,
    kv_chunk=512,
    impl="auto",
    whole=True,
):
    """`ring_attention`'s arguments and result, by Ulysses all-to-alls over `sp`: needs the
    query heads per tp shard divisible by sp (K/V heads are repeated as needed)."""
    n, tp = mesh.shape[SP], mesh.shape[HEAD_AXIS]
    if q.shape[2] % (tp * n):
        raise ValueError(
            f"ulysses splits the {q.shape[2] // tp} query heads per tp shard "
            f"over sp={n}: they are not divisible"
        )
    settings = make_settings(
        1,
        "contiguous",
        causal,
        q_chunk,
        kv_chunk,
        impl,
        q,
        mesh.devices.flat[0],
        axis=None,
        whole=whole,
    )
    inner = functools.partial(_in_original_order, settings, layout, n)
    return on_mesh(functools.partial(_ulysses, SP, n, inner), mesh, q, k, v, segment_ids)


def usp_mesh(mesh: Mesh, ulysses: int) -> Mesh:
    """`mesh`'s devices with its last axis, `sp`, split into ('sp': sp / ulysses ring
    members, 'ulysses': that many consecutive devices): the same devices in the same order,
    so arrays sharded over the sequence on `mesh` need no transfer."""
    if mesh.axis_names[-1] != SP:
        raise ValueError(f"usp splits the mesh's last axis, which must be {SP!r}")
    shape = mesh.devices.shape
    return Mesh(
        mesh.devices.reshape(*shape[:-1], shape[-1] // ulysses, ulysses),
        (*mesh.axis_names, ULYSSES),
    )


def usp_attention(
    q,
    k,
    v,
    *,
    mesh,
    layout="striped",
    causal=True,
    segment_ids=None,
    q_chunk=512,
    kv_chunk=512,
    impl="auto",
    ulysses=1,
    whole=True,
):
    """`ring_attention`'s arguments and result (q, k, v and segment ids in `layout`'s order
    for a ring of sp / ulysses), by Ulysses all-to-alls over groups of `ulysses` consecutive
    sp devices and the ring across the groups: needs the query heads per tp shard divisible
    by `ulysses` (K/V heads are repeated as needed)."""
    n, tp = mesh.shape[SP], mesh.shape[HEAD_AXIS]
    if ulysses < 1 or n % ulysses:
        raise ValueError(f"usp's ulysses={ulysses} does not divide sp={n}")
    if q.shape[2] % (tp * ulysses):
        raise ValueError(
            f"usp splits the {q.shape[2] // tp} query heads per tp shard over "
            f"ulysses={ulysses}: they are not divisible"
        )
    settings = make_settings(
        n // ulysses, layout, causal, q_chunk, kv_chunk, impl, q, mesh.devices.flat[0], whole=whole
    )
    inner = lambda q, k, v, s: ring_or_whole(settings, q, k, v, s, s)
    return on_mesh(
        functools.partial(_ulysses, ULYSSES, ulysses, inner),
        usp_mesh(mesh, ulysses),
        q,
        k,
        v,
        segment_ids,
        seq_axes=(SP, ULYSSES),
    )


@dataclasses.dataclass(frozen=True)
class Ulysses(Strategy):
    """All-to-alls move q, k, v in and o out (forward), do in and dq, dk, dv out (backward),
    and q, k, v in again under every remat policy but 'none', each sending (n - 1)/n of its
    tensor; K/V heads count n / gcd(kv heads, n) times where a device's KV heads do not
    split over n. Per-device bytes do not grow with n; exposed (the attention waits for
    them). The query heads per device must divide by n."""

    name = "ulysses"

    def attention(self, q, k, v, *, mesh, **kwargs):
        return ulysses_attention(q, k, v, mesh=mesh, **kwargs)

    def kernel_block(self, layout: str, sp: int, seq_len: int) -> int:
        return seq_len  # the whole sequence, in original order

    def limits(self, *, heads: int, tp: int, sp: int) -> str | None:
        if heads % (tp * sp):
            return (
                f"attention.strategy='ulysses' splits the model.n_heads={heads} query "
                f"heads over mesh.tp x mesh.sp = {tp * sp}: not divisible; use 'usp' with "
                "attention.ulysses dividing them, 'ring' or 'all_gather'"
            )
        return None

    def buffers(self, step: Step) -> float:
        return all_to_all_bytes(step, step.n)[1]

    def cost(self, step: Step) -> StrategyCost:
        n, per_step = step.n, step.per_step
        sent, buffers, note = all_to_all_bytes(step, n)
        if step.crosses:  # of what each device sends, the part for other nodes crosses slow links
            inside = sent * (step.devices_per_node - 1) / (n - 1)
            split = {"in a node": inside * per_step, "between nodes": (sent - inside) * per_step}
            exposed = max(inside / (step.fast_gbs * 1e9), (sent - inside) / (step.slow_gbs * 1e9))
        else:
            split = {"in a node": sent * per_step}
            exposed = sent / (step.fast_gbs * 1e9)
        if step.heads % n:
            note = f"{step.heads} query heads per device do not split over sp={n}: cannot run"
        return StrategyCost(self.name, f"ulysses {n}", split, exposed * per_step, buffers, note)


@dataclasses.dataclass(frozen=True)
class USP(Strategy):
    """Ulysses over the u devices of a node (fast links) and the ring over the r = n / u
    nodes (slow links): the ring's hops carry the same kv bytes but only r - 1 of them cross
    nodes. `ulysses` is u (`attention.ulysses`); the planner prices the largest u the heads
    and a node allow."""

    name = "usp"
    options = ("ulysses",)
    option_words = {"ulysses": "usp's Ulysses degree"}
    ulysses: int = 1

    def attention(self, q, k, v, *, mesh, **kwargs):
        return usp_attention(q, k, v, mesh=mesh, ulysses=self.ulysses, **kwargs)

    def layout_shards(self, sp: int) -> int:
        return sp // self.ulysses

    def label(self, sp: int) -> str:
        return (
            f"{self.name} (ulysses {self.ulysses} x ring {self.layout_shards(sp)})"
            if self.ulysses > 1
            else self.name
        )

    def limits(self, *, heads: int, tp: int, sp: int) -> str | None:
        ulysses = self.ulysses
        if sp % ulysses:
            return (
                f"attention.ulysses={ulysses} does not divide mesh.sp={sp}; usp runs "
                "Ulysses over groups of that many sp devices and the ring across the groups"
            )
        if heads % (tp * ulysses):
            return (
                f"attention.strategy='usp' splits the model.n_heads={heads} query heads "
                f"over mesh.tp x attention.ulysses = {tp * ulysses}: not divisible; use a "
                "smaller attention.ulysses"
            )
        return None

    def buffers(self, step: Step) -> float:
        """The all-to-alls' over each group of `ulysses` devices and the ring's across the
        groups (either alone where the other has one member, as `cost` prices it)."""
        ulysses = self.ulysses
        groups = step.n // ulysses
        return (all_to_all_bytes(step, ulysses)[1] if ulysses > 1 else 0.0) + (
            ring_buffers(step) if groups > 1 else 0.0
        )

    def cost(self, step: Step) -> StrategyCost:
        n, per_step = step.n, step.per_step
        # on one interconnect (a TPU slice) the largest split the heads allow
        u = min(n, step.devices_per_node, step.heads)
        while n % u or step.heads % u:
            u -= 1
        r = n // u
        split = f"ulysses {u} x ring {r}"
        if r == 1 or u == 1:  # listed all the same, as the strategy it equals here
            same = (STRATEGY_ULYSSES if u > 1 else RING).cost(step)
            note = ", ".join(
                filter(None, [f"= {same.strategy} here (attention.ulysses={u})", same.note])
            )
            return dataclasses.replace(same, strategy=self.name, split=split, note=note)
        a2a, _, note = all_to_all_bytes(step, u)
        # the ring's block pairs carry u times the heads of a plain ring's
        ring_exposed = ring_exposed_s(step, r - 1, step.pair_flops * u)
        sent = {"in a node": a2a * per_step}
        link = step.ring_link
        sent[link] = sent.get(link, 0.0) + ring_bytes(step, r - 1) * per_step
        return StrategyCost(
            self.name,
            split,
            sent,
            (a2a / (step.fast_gbs * 1e9) + ring_exposed) * per_step,
            dataclasses.replace(self, ulysses=u).buffers(step),
            ", ".join(filter(None, [f"attention.ulysses={u}", note])),
        )


STRATEGY_ULYSSES = Ulysses()
STRATEGY_USP = USP()

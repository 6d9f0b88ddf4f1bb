"""The ring (`attention.strategy='ring'`): K/V blocks travel the `sp` ring, striped (default),
contiguous or zigzag layout.

Each `sp` device keeps its queries; K/V blocks (in the compute dtype, with their segment ids)
travel the ring with `lax.ppermute`. Every round runs the kernel on one block pair and merges
the result with log-sum-exp statistics. The whole ring is one custom VJP: the backward
recomputes every block pair from the *global* output and log-sum-exp, and dK/dV accumulators
(float32) travel with K/V, arriving home after N hops.

For striped, round blocks from devices k <= j are causal and k > j strictly causal; for
contiguous, blocks are full, causal or hidden; for zigzag, every round is half of the block
pair as full tiles (the diagonal round: causal). The scanned rounds and the last round are
two kernel call sites (`rounds.setup`), each compiled for the mask classes it meets; where
the diagonal round's class is met in no other scanned round (contiguous, zigzag) and the
kernel specializes on classes, the diagonal is a third site (`rounds.passing_sites`).

The ring with one member is also one-device attention (`local_attention`), which Ulysses
and usp run inside their all-to-alls.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lclm.ops.context_parallel.contract import (
    Step,
    Strategy,
    StrategyCost,
    ring_buffers,
    ring_bytes,
    ring_exposed_s,
)
from lclm.ops.context_parallel.rounds import (
    SP,
    Settings,
    make_settings,
    merge_partials,
    on_mesh,
    passing_sites,
    saved,
    send,
    setup,
)
from lclm.ops.kernels import get_kernel, target_device
from lclm.ops.kernels.contract import F32, visible_tiles
from lclm.ops.kernels.range_kernel import several_documents
from lclm.ops.layout import original_positions


def _passing_rounds(s: Settings, local: int, site, round_, carry):
    """`round_(kernel pass, carry, r) -> (carry, None)` over the rounds before the last, one
    kernel call site per `passing_sites` range (a scan where it holds several rounds)."""
    for rounds in passing_sites(s, local):
        step = functools.partial(round_, site(rounds))
        if len(rounds) == 1:
            carry, _ = step(carry, rounds.start)
        else:
            carry, _ = lax.scan(step, carry, jnp.arange(rounds.start, rounds.stop))
    return carry


def _ring_forward(s: Settings, q, k, v, q_seg, k_seg):
    with several_documents(s.several_documents):
        return _ring_forward_traced(s, q, k, v, q_seg, k_seg)


def _ring_forward_traced(s: Settings, q, k, v, q_seg, k_seg):
    site, q_pos, k_pos = setup(s, q, "forward")

    def round_(block, carry, r):
        o, lse, k, v, k_seg = carry
        # The next block is sent before this one is used, so the transfer can overlap compute.
        k_next, v_next, seg_next = send((k, v, k_seg), s.axis, s.n)
        o, lse = merge_partials(o, lse, *block(q, k, v, q_pos, k_pos(r), q_seg, k_seg))
        return (o, lse, k_next, v_next, seg_next), None

    b, t, h, d = q.shape
    carry = (jnp.zeros((b, t, h, d), F32), jnp.full((b, t, h), -jnp.inf, F32), k, v, k_seg)
    o, lse, k, v, k_seg = _passing_rounds(s, t, site, round_, carry)
    last = site(range(s.n - 1, s.n))
    o, lse = merge_partials(o, lse, *last(q, k, v, q_pos, k_pos(s.n - 1), q_seg, k_seg))
    return o, lse


def _ring_backward(s: Settings, residuals, do):
    with several_documents(s.several_documents):
        return _ring_backward_traced(s, residuals, do)


def _ring_backward_traced(s: Settings, residuals, do):
    q, k, v, q_seg, k_seg, o, lse = residuals
    site, q_pos, k_pos = setup(s, q, "backward")

    def round_(block, carry, r):
        dq, k, v, k_seg, dk, dv = carry
        k_next, v_next, seg_next = send((k, v, k_seg), s.axis, s.n)
        dq_r, dk_r, dv_r = block(q, k, v, o, lse, do, q_pos, k_pos(r), q_seg, k_seg)
        dk, dv = send((dk + dk_r, dv + dv_r), s.axis, s.n)
        return (dq + dq_r, k_next, v_next, seg_next, dk, dv), None

    carry = (jnp.zeros(q.shape, F32), k, v, k_seg, jnp.zeros(k.shape, F32), jnp.zeros(v.shape, F32))
    dq, k_last, v_last, seg_last, dk, dv = _passing_rounds(s, q.shape[1], site, round_, carry)
    last = site(range(s.n - 1, s.n))
    dq_r, dk_r, dv_r = last(q, k_last, v_last, o, lse, do, q_pos, k_pos(s.n - 1), q_seg, seg_last)
    dk, dv = dk + dk_r, dv + dv_r
    if s.n > 1:  # the accumulators of the block held last belong to the next device
        dk, dv = send((dk, dv), s.axis, s.n)
    return dq + dq_r, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def ring(settings: Settings, q, k, v, q_seg, k_seg):
    """Inside shard_map: this device's output `[b, t, h, d]` (q's dtype) of its queries
    against every device's keys, the K/V blocks passed round the `settings.axis` ring."""
    o, _ = _ring_forward(settings, q, k, v, q_seg, k_seg)
    return o.astype(q.dtype)


def _ring_fwd(settings, q, k, v, q_seg, k_seg):
    o, lse = saved(*_ring_forward(settings, q, k, v, q_seg, k_seg), q.dtype)
    return o, (q, k, v, q_seg, k_seg, o, lse)


def _ring_bwd(settings, residuals, do):
    q, k, v = residuals[:3]
    dq, dk, dv = _ring_backward(settings, residuals, do)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


ring.defvjp(_ring_fwd, _ring_bwd)


def ring_or_whole(settings: Settings, q, k, v, q_seg, k_seg):
    """`ring`, or where it has one member and the kernel attends to a whole sequence itself
    (`Kernel.whole`: cuDNN's fused attention with its own VJP), that, with the ring as its
    fallback. With one member the positions are the original order in every layout."""

    def the_ring(several_documents: bool = False):
        return ring(settings._replace(several_documents=several_documents), q, k, v, q_seg, k_seg)

    whole = get_kernel(settings.impl).whole if settings.n == 1 and settings.whole else None
    return (
        the_ring()
        if whole is None
        else whole(q, k, v, q_seg, causal=settings.causal, fallback=the_ring)
    )


def local_attention(
    q, k, v, *, causal=True, segment_ids=None, q_chunk=512, kv_chunk=512, impl="auto", whole=True
):
    """Blockwise attention on one device (no mesh): the ring with a single member.

    q `[batch, seq, heads, dim]`, k/v `[batch, seq, kv_heads, dim]` in original order,
    segment_ids `[batch, seq]` or None; `whole`: `rounds.Settings.whole`. Differentiable.
    """
    settings = make_settings(
        1, "contiguous", causal, q_chunk, kv_chunk, impl, q, target_device(), axis=None, whole=whole
    )
    return ring_or_whole(settings, q, k, v, segment_ids, segment_ids)


def ring_attention(
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
    """Ring attention of global arrays whose sequence axis is sharded over `sp`.

    q `[batch, seq, heads, dim]`, k/v `[batch, seq, kv_heads, dim]` (kv_heads divides heads),
    segment_ids `[batch, seq]` int or None (ids that never decrease along the original order,
    as packing gives them: range-based kernels rely on it); all already in `layout`'s token
    order (see `lclm.ops.stripe`). Batch is split over (`dp`, `fsdp`), heads over `tp`.
    Returns the output `[batch, seq, heads, dim]` in the same order and dtype as q; `whole`:
    `rounds.Settings.whole`. Differentiable.
    """
    settings = make_settings(
        mesh.shape[SP],
        layout,
        causal,
        q_chunk,
        kv_chunk,
        impl,
        q,
        mesh.devices.flat[0],
        whole=whole,
    )
    return on_mesh(
        lambda q, k, v, s: ring_or_whole(settings, q, k, v, s, s), mesh, q, k, v, segment_ids
    )


def tile_schedule(
    layout: str, n: int, seq_len: int, q_chunk: int, kv_chunk: int, causal: bool = True
) -> np.ndarray:
    """Tiles each device computes in each round: int array `[round, device]`.

    Uses the kernels' own skip predicate (`visible_tiles`) on the positions each device holds
    in each round (no segments), i.e. the paper's per-round workload at tile granularity.
    Out of `(seq_len/n/q_chunk) * (seq_len/n/kv_chunk)` tiles per block pair.
    """
    local = seq_len // n
    counts = np.zeros((n, n), np.int64)
    for r in range(n):
        for j in range(n):
            q_pos = original_positions(layout, n, j, local)
            k_pos = original_positions(layout, n, (j - r) % n, local)
            counts[r, j] = np.asarray(
                visible_tiles(q_pos, k_pos, None, None, causal, q_chunk, kv_chunk)
            ).sum()
    return counts


@dataclasses.dataclass(frozen=True)
class Ring(Strategy):
    """K/V blocks round the ring: n - 1 hops forward; in the backward K/V travel again and the
    float32 dK/dV accumulators n hops home (K/V once more where remat re-runs the forward).
    Each hop overlaps one block pair's attention: hidden while a block pair's FLOPs outlast
    one block's transfer."""

    name = "ring"

    def attention(self, q, k, v, *, mesh, **kwargs):
        return ring_attention(q, k, v, mesh=mesh, **kwargs)

    def buffers(self, step: Step) -> float:
        return ring_buffers(step)

    def cost(self, step: Step) -> StrategyCost:
        n = step.n
        return StrategyCost(
            self.name,
            f"ring {n}",
            {step.ring_link: ring_bytes(step, n - 1) * step.per_step},
            ring_exposed_s(step, n - 1, step.pair_flops) * step.per_step,
            self.buffers(step),
        )


STRATEGY = Ring()

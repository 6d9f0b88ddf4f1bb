"""Ring attention over the `sp` mesh axis: striped (default), contiguous or zigzag layout.

Each `sp` device keeps its queries; K/V blocks (in the compute dtype, with their segment ids)
travel the ring with `lax.ppermute`. Every round runs the kernel on one block pair and merges
the result with log-sum-exp statistics. The whole ring is one custom VJP: the backward
recomputes every block pair from the *global* output and log-sum-exp, and dK/dV accumulators
(float32) travel with K/V, arriving home after N hops.

Masks follow from original positions, which each device derives from its ring index and the
layout (`lclm.ops.layout.original_positions`): for striped, round blocks from devices k <= j
are causal and k > j strictly causal; for contiguous, blocks are full, causal or hidden; for
zigzag, every round is half of the block pair as full tiles (the diagonal round: causal).
A kernel that specializes on such a class (`classify`: `lclm.ops.kernels.range_kernel`) is
told at each call site (the scanned rounds, the last round) the classes it can meet there,
found on the host from the layout, so it compiles only those (one at sp=1: no conditional).

The other context-parallel strategies over `sp` (all-gather, Ulysses, USP) are in
`lclm.ops.context_parallel`; they share this module's rounds, kernels and `on_mesh`.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from lclm.ops.kernels import choose_kernel, get_kernel, target_device
from lclm.ops.kernels.contract import F32, visible_tiles
from lclm.ops.layout import LAYOUTS, original_positions

SP = "sp"
BATCH_AXES = ("dp", "fsdp")
HEAD_AXIS = "tp"


def merge_partials(o, lse, o_r, lse_r):
    """Combine two normalised partial attentions by their log-sum-exps (-inf = empty).
    o `[..., dim]` float32, lse `[...]` float32."""
    lse_new = jnp.logaddexp(lse, lse_r)
    safe = jnp.where(jnp.isfinite(lse_new), lse_new, 0.0)
    w, w_r = jnp.exp(lse - safe), jnp.exp(lse_r - safe)
    return o * w[..., None] + o_r * w_r[..., None], lse_new


def _send(xs, axis, n):
    """Pass every array in `xs` one step along the ring (device i -> i+1)."""
    perm = [(i, (i + 1) % n) for i in range(n)]
    return tuple(None if x is None else lax.ppermute(x, axis, perm) for x in xs)


class _Settings(NamedTuple):
    """Static (hashable) settings of one ring: the custom VJP's non-differentiable part."""
    axis: str | None
    n: int
    layout: str
    causal: bool
    q_chunk: int
    kv_chunk: int
    impl: str
    platform: str  # of the devices the program is for (the mesh's)
    device_kind: str  # theirs too, e.g. 'TPU v4' (a TPU kernel sizes its tiles by it)


def _setup(s: _Settings, q, which: str):
    """(`rounds -> kernel pass` for the call site that runs those rounds, this device's
    query positions, the key positions per round)."""
    kernel = get_kernel(s.impl)
    # a zigzag shard is two runs of consecutive positions: tiles stay inside one, so that
    # every tile is entirely visible or entirely hidden in all but the diagonal blocks
    run = tile_run(s.layout, s.n, q.shape[1] * s.n)
    block = functools.partial(getattr(kernel, which), causal=s.causal,
                              q_chunk=min(s.q_chunk, run), kv_chunk=min(s.kv_chunk, run),
                              **({"platform": s.platform, "device_kind": s.device_kind}
                                 if kernel.takes_platform else {}))
    me = lax.axis_index(s.axis) if s.n > 1 else 0
    q_pos = original_positions(s.layout, s.n, me, q.shape[1], xp=jnp)
    # in round r this device holds the K/V block that started on device me - r
    k_pos = lambda r: original_positions(s.layout, s.n, (me - r) % s.n, q.shape[1], xp=jnp)
    return functools.partial(_site, block, kernel, s, q.shape[1]), q_pos, k_pos


def _site(block, kernel, s: _Settings, local: int, rounds: range):
    """The kernel pass of the call site that runs `rounds`. A kernel that specializes on a
    static property of a block pair's positions (`classify`, as `range_kernel`'s round
    classes) gets the values it takes there (`classes=`): traced positions (they depend on
    `lax.axis_index` and the scanned round) would leave it a conditional over all of them."""
    classify = getattr(kernel, "classify", None)
    if classify is None:
        return block
    return functools.partial(block, classes=_site_classes(classify, s.layout, s.n, local,
                                                          s.causal, rounds))


@functools.cache
def _site_classes(classify, layout: str, n: int, local: int, causal: bool,
                  rounds: range) -> frozenset:
    """`classify` of every block pair some device meets in `rounds`, on the host (numpy)."""
    pos = lambda device: original_positions(layout, n, device, local)
    return frozenset(classify(pos(j), pos((j - r) % n), causal)
                     for r in rounds for j in range(n))


def _ring_forward(s: _Settings, q, k, v, q_seg, k_seg):
    site, q_pos, k_pos = _setup(s, q, "forward")
    block, last = site(range(s.n - 1)), site(range(s.n - 1, s.n))

    def round_(carry, r):
        o, lse, k, v, k_seg = carry
        # The next block is sent before this one is used, so the transfer can overlap compute.
        k_next, v_next, seg_next = _send((k, v, k_seg), s.axis, s.n)
        o, lse = merge_partials(o, lse, *block(q, k, v, q_pos, k_pos(r), q_seg, k_seg))
        return (o, lse, k_next, v_next, seg_next), None

    b, t, h, d = q.shape
    carry = (jnp.zeros((b, t, h, d), F32), jnp.full((b, t, h), -jnp.inf, F32), k, v, k_seg)
    if s.n > 1:
        carry, _ = lax.scan(round_, carry, jnp.arange(s.n - 1))
    o, lse, k, v, k_seg = carry
    o, lse = merge_partials(o, lse, *last(q, k, v, q_pos, k_pos(s.n - 1), q_seg, k_seg))
    return o, lse


def _ring_backward(s: _Settings, residuals, do):
    q, k, v, q_seg, k_seg, o, lse = residuals
    site, q_pos, k_pos = _setup(s, q, "backward")
    block, last = site(range(s.n - 1)), site(range(s.n - 1, s.n))

    def round_(carry, r):
        dq, k, v, k_seg, dk, dv = carry
        k_next, v_next, seg_next = _send((k, v, k_seg), s.axis, s.n)
        dq_r, dk_r, dv_r = block(q, k, v, o, lse, do, q_pos, k_pos(r), q_seg, k_seg)
        dk, dv = _send((dk + dk_r, dv + dv_r), s.axis, s.n)
        return (dq + dq_r, k_next, v_next, seg_next, dk, dv), None

    carry = (jnp.zeros(q.shape, F32), k, v, k_seg, jnp.zeros(k.shape, F32),
             jnp.zeros(v.shape, F32))
    if s.n > 1:
        carry, _ = lax.scan(round_, carry, jnp.arange(s.n - 1))
    dq, k_last, v_last, seg_last, dk, dv = carry
    dq_r, dk_r, dv_r = last(q, k_last, v_last, o, lse, do, q_pos, k_pos(s.n - 1), q_seg,
                            seg_last)
    dk, dv = dk + dk_r, dv + dv_r
    if s.n > 1:  # the accumulators of the block held last belong to the next device
        dk, dv = _send((dk, dv), s.axis, s.n)
    return dq + dq_r, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(settings, q, k, v, q_seg, k_seg):
    o, _ = _ring_forward(settings, q, k, v, q_seg, k_seg)
    return o.astype(q.dtype)


# Names of the ring's residuals for remat policies (`lclm.models.llama`'s 'attention'
# policy saves them, so the backward does not run the ring forward again).
SAVED_NAMES = ("attention_out", "attention_lse")


def _ring_fwd(settings, q, k, v, q_seg, k_seg):
    o, lse = _ring_forward(settings, q, k, v, q_seg, k_seg)
    o = checkpoint_name(o.astype(q.dtype), SAVED_NAMES[0])
    lse = checkpoint_name(lse, SAVED_NAMES[1])
    return o, (q, k, v, q_seg, k_seg, o, lse)


def _ring_bwd(settings, residuals, do):
    q, k, v = residuals[:3]
    dq, dk, dv = _ring_backward(settings, residuals, do)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


def tile_run(layout: str, n: int, seq_len: int) -> int:
    """Length of the runs of consecutive positions a shard holds, which tiles stay inside:
    the local length, or half of it with zigzag."""
    local = seq_len // n
    return local // 2 if layout == "zigzag" and n > 1 else local


def _settings(n, layout, causal, q_chunk, kv_chunk, impl, q, device, axis=SP):
    """Check the layout and resolve `impl` ('auto' included) for global queries `q` on
    devices like `device`."""
    platform = device.platform
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; use one of {LAYOUTS}")
    impl = choose_kernel(impl, head_dim=q.shape[-1], q_chunk=q_chunk, kv_chunk=kv_chunk,
                         block=tile_run(layout, n, q.shape[1]), platform=platform,
                         dtype=jnp.dtype(q.dtype).name)
    return _Settings(axis, n, layout, bool(causal), int(q_chunk), int(kv_chunk), impl,
                     platform, device.device_kind)


def local_attention(q, k, v, *, causal=True, segment_ids=None, q_chunk=512, kv_chunk=512,
                    impl="auto"):
    """Blockwise attention on one device (no mesh): the ring with a single member.

    q `[batch, seq, heads, dim]`, k/v `[batch, seq, kv_heads, dim]` in original order,
    segment_ids `[batch, seq]` or None. Differentiable.
    """
    settings = _settings(1, "contiguous", causal, q_chunk, kv_chunk, impl, q,
                         target_device(), axis=None)
    return _ring(settings, q, k, v, segment_ids, segment_ids)


def kv_repeats(q_heads: int, kv_heads: int, tp: int, axis: str = "tp") -> int:
    """How often to repeat K/V heads so that they split evenly over `tp` devices (MQA/GQA
    with tp; Ulysses splits heads over `sp` the same way: `axis` names it in the message)."""
    if q_heads % tp:
        raise ValueError(f"{q_heads} query heads are not divisible by {axis}={tp}")
    rep = tp // math.gcd(kv_heads, tp)
    if (q_heads // kv_heads) % rep:
        raise ValueError(f"{kv_heads} kv heads cannot be split over {axis}={tp} with {q_heads} "
                         "heads")
    return rep


def on_mesh(body, mesh, q, k, v, segment_ids, seq_axes=SP):
    """`body(q, k, v, seg)` on every device's shards of global arrays (shapes as
    `ring_attention`'s): batch over (`dp`, `fsdp`), sequence over `seq_axes` (`sp`), heads
    over `tp`, K/V heads repeated first where there are fewer than tp (each tp shard then
    holds its own copy); seg is None without segment ids. Returns the global
    `[batch, seq, heads, dim]`."""
    rep = kv_repeats(q.shape[2], k.shape[2], mesh.shape[HEAD_AXIS])
    if rep > 1:
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    x_spec = P(BATCH_AXES, seq_axes, HEAD_AXIS, None)
    if segment_ids is None:
        fn = lambda q, k, v: body(q, k, v, None)
        in_specs, args = (x_spec,) * 3, (q, k, v)
    else:
        fn = body
        in_specs = (x_spec,) * 3 + (P(BATCH_AXES, seq_axes),)
        args = (q, k, v, segment_ids.astype(jnp.int32))
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=x_spec,
                         check_vma=False)(*args)


def ring_attention(q, k, v, *, mesh, layout="striped", causal=True, segment_ids=None,
                   q_chunk=512, kv_chunk=512, impl="auto"):
    """Ring attention of global arrays whose sequence axis is sharded over `sp`.

    q `[batch, seq, heads, dim]`, k/v `[batch, seq, kv_heads, dim]` (kv_heads divides heads),
    segment_ids `[batch, seq]` int or None (ids that never decrease along the original order,
    as packing gives them: range-based kernels rely on it); all already in `layout`'s token
    order (see `lclm.ops.stripe`). Batch is split over (`dp`, `fsdp`), heads over `tp`.
    Returns the output `[batch, seq, heads, dim]` in the same order and dtype as q.
    Differentiable.
    """
    settings = _settings(mesh.shape[SP], layout, causal, q_chunk, kv_chunk, impl, q,
                         mesh.devices.flat[0])
    return on_mesh(lambda q, k, v, s: _ring(settings, q, k, v, s, s), mesh, q, k, v,
                   segment_ids)


def tile_schedule(layout: str, n: int, seq_len: int, q_chunk: int, kv_chunk: int,
                  causal: bool = True) -> np.ndarray:
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
                visible_tiles(q_pos, k_pos, None, None, causal, q_chunk, kv_chunk)).sum()
    return counts

"""Context-parallel attention over the `sp` axis: the strategy (`attention.strategy`) decides
what crosses the devices; the layout (`lclm.ops.layout`) still decides which tokens each
device holds, and masks still come from original positions.

- `ring` (`lclm.ops.ring_attention`): K/V blocks travel the ring, one hop per round.
- `all_gather` (Llama 3's context parallelism): each device gathers the whole sequence's K/V
  (and segment ids) once, then runs the ring's rounds on local slices of it: round r is the
  block that started on device me - r, with the ring's positions, kernel call sites and mask
  classes, merged by log-sum-exp in float32, only without the hops. Its own custom VJP
  gathers K/V again in the backward (nothing n times larger is kept), accumulates dK/dV of
  the whole sequence in float32 and reduce-scatters them (`psum_scatter`) in float32.
- `ulysses` (DeepSpeed-Ulysses): an all-to-all trades the sequence split for a head split,
  q/k/v `[b, seq/n, heads, d] -> [b, seq, heads/n, d]`; the device puts the whole sequence
  into original order (`from_layout`: a local permutation), runs one-device attention on it
  (the ring with one member, its custom VJP: any kernel, one causal block pair), and the
  inverse all-to-all brings the output back. Segment ids are per token: all-gathered. The
  all-to-alls differentiate into all-to-alls (nothing is summed). Query heads per device
  (after tp) must divide by n; K/V heads that do not are repeated first (`kv_repeats`):
  head c becomes c*r ... c*r + r - 1 with r = n / gcd(kv_heads, n), so query head i still
  meets its K/V head i // (heads / kv_heads) (the dK/dV of the copies add up in autodiff).

- `usp` (Ulysses x ring): `mesh.sp` = r ring members x u (`ulysses`) consecutive devices.
  The attention's shard_map sees sp split into two named axes of the same devices ('sp': r,
  'ulysses': u inner, so a Ulysses group is a node's neighbours); the sequence is laid out for
  a ring of r (`AttentionConfig.ring_size`) and each ring shard cut contiguously over its
  group, so the all-to-all over 'ulysses' rebuilds exactly one ring shard (layout order) with
  heads/u heads, and the ring's own shard_map body runs on it over 'sp' unchanged.

Remat: all keep the ring's named residuals (`SAVED_NAMES`), so remat='attention' never
re-runs all_gather's forward; the backward of ulysses and usp re-runs their forward
all-to-alls (the all-to-all'd q/k/v are not saved) under any policy but 'none'.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh

from lclm.config.model import AttentionConfig
from lclm.config.schema import STRATEGIES
from lclm.ops.kernels.contract import F32
from lclm.ops.layout import from_layout, to_layout
from lclm.ops.ring_attention import (
    HEAD_AXIS,
    SAVED_NAMES,
    SP,
    _ring,
    _Settings,
    _settings,
    _setup,
    kv_repeats,
    merge_partials,
    on_mesh,
    ring_attention,
    tile_run,
)

ULYSSES = "ulysses"   # usp's Ulysses axis: the inner factor of sp


def kernel_block(attention: AttentionConfig, sp: int, seq_len: int) -> int:
    """The run of consecutive positions a kernel's tiles stay inside (`Kernel.limits`'
    `block`) when `attention` runs over `sp` devices: a ring shard's (ring, all_gather, usp's
    ring of `ring_size`) or the whole sequence's (ulysses: original order)."""
    if attention.strategy == "ulysses":
        return seq_len
    return tile_run(attention.layout, attention.ring_size(sp), seq_len)


# ---------------------------------------------------------------------------- all_gather

def _gathered(s: _Settings, x):
    """`[b, t, ...] -> [b, n t, ...]`: the shards of every sp device, in device order."""
    return None if x is None else lax.all_gather(x, s.axis, axis=1, tiled=True)


def _source(x, src, t: int):
    """Block `[b, t, ...]` of the gathered `x` that started on device `src`."""
    return None if x is None else lax.dynamic_slice_in_dim(x, src * t, t, axis=1)


def _gather_forward(s: _Settings, q, k, v, seg):
    """(o `[b, t, h, d]`, lse `[b, t, h]`) float32 of this device's queries against every
    key. Round 0 (own block, no wait for the gather), then rounds 1 .. n-1 as the ring's."""
    site, q_pos, k_pos = _setup(s, q, "forward")
    o, lse = site(range(1))(q, k, v, q_pos, k_pos(0), seg, seg)
    if s.n == 1:
        return o, lse
    others, t, me = site(range(1, s.n)), q.shape[1], lax.axis_index(s.axis)
    k_all, v_all, seg_all = (_gathered(s, x) for x in (k, v, seg))

    def round_(carry, r):
        src = (me - r) % s.n
        part = others(q, _source(k_all, src, t), _source(v_all, src, t), q_pos, k_pos(r), seg,
                      _source(seg_all, src, t))
        return merge_partials(*carry, *part), None

    (o, lse), _ = lax.scan(round_, (o, lse), jnp.arange(1, s.n))
    return o, lse


def _gather_backward(s: _Settings, residuals, do):
    """float32 (dq, dk, dv) of this device's shards: every round's dK/dV lands in a float32
    buffer of the whole sequence, reduce-scattered back to the devices that own the keys."""
    q, k, v, seg, o, lse = residuals
    site, q_pos, k_pos = _setup(s, q, "backward")
    dq, dk, dv = site(range(1))(q, k, v, o, lse, do, q_pos, k_pos(0), seg, seg)
    if s.n == 1:
        return dq, dk, dv
    others, t, me = site(range(1, s.n)), q.shape[1], lax.axis_index(s.axis)
    k_all, v_all, seg_all = (_gathered(s, x) for x in (k, v, seg))

    def add(acc, d, src):
        return lax.dynamic_update_slice_in_dim(acc, _source(acc, src, t) + d, src * t, axis=1)

    def round_(carry, r):
        dq, dk_all, dv_all = carry
        src = (me - r) % s.n
        dq_r, dk_r, dv_r = others(q, _source(k_all, src, t), _source(v_all, src, t), o, lse,
                                  do, q_pos, k_pos(r), seg, _source(seg_all, src, t))
        return (dq + dq_r, add(dk_all, dk_r, src), add(dv_all, dv_r, src)), None

    zeros = jnp.zeros(k_all.shape, F32)
    (dq, dk_all, dv_all), _ = lax.scan(round_, (dq, zeros, zeros), jnp.arange(1, s.n))
    scatter = lambda x: lax.psum_scatter(x, s.axis, scatter_dimension=1, tiled=True)
    return dq, dk + scatter(dk_all), dv + scatter(dv_all)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _all_gather(settings, q, k, v, seg):
    o, _ = _gather_forward(settings, q, k, v, seg)
    return o.astype(q.dtype)


def _all_gather_fwd(settings, q, k, v, seg):
    o, lse = _gather_forward(settings, q, k, v, seg)
    # named as the ring's: remat='attention' keeps them, the backward never gathers twice
    o = checkpoint_name(o.astype(q.dtype), SAVED_NAMES[0])
    lse = checkpoint_name(lse, SAVED_NAMES[1])
    return o, (q, k, v, seg, o, lse)


def _all_gather_bwd(settings, residuals, do):
    q, k, v = residuals[:3]
    dq, dk, dv = _gather_backward(settings, residuals, do)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_all_gather.defvjp(_all_gather_fwd, _all_gather_bwd)


def all_gather_attention(q, k, v, *, mesh, layout="striped", causal=True, segment_ids=None,
                         q_chunk=512, kv_chunk=512, impl="auto"):
    """`ring_attention`'s arguments and result, K/V all-gathered over `sp` instead of passed
    round the ring."""
    settings = _settings(mesh.shape[SP], layout, causal, q_chunk, kv_chunk, impl, q,
                         mesh.devices.flat[0])
    return on_mesh(lambda q, k, v, s: _all_gather(settings, q, k, v, s), mesh, q, k, v,
                   segment_ids)


# ------------------------------------------------------------------------------- ulysses

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


def _in_original_order(settings: _Settings, layout: str, n: int, q, k, v, seg):
    """One-device attention (`settings`: a ring of one) of a whole sequence in `layout`'s
    order for `n` shards: permuted to original order, attended, permuted back."""
    orig = lambda x: None if x is None else from_layout(x, layout, n)
    o = _ring(settings, orig(q), orig(k), orig(v), orig(seg), orig(seg))
    return to_layout(o, layout, n)


def ulysses_attention(q, k, v, *, mesh, layout="striped", causal=True, segment_ids=None,
                      q_chunk=512, kv_chunk=512, impl="auto"):
    """`ring_attention`'s arguments and result, by Ulysses all-to-alls over `sp`: needs the
    query heads per tp shard divisible by sp (K/V heads are repeated as needed)."""
    n, tp = mesh.shape[SP], mesh.shape[HEAD_AXIS]
    if q.shape[2] % (tp * n):
        raise ValueError(f"ulysses splits the {q.shape[2] // tp} query heads per tp shard "
                         f"over sp={n}: they are not divisible")
    settings = _settings(1, "contiguous", causal, q_chunk, kv_chunk, impl, q,
                         mesh.devices.flat[0], axis=None)
    inner = functools.partial(_in_original_order, settings, layout, n)
    return on_mesh(functools.partial(_ulysses, SP, n, inner), mesh, q, k, v, segment_ids)


# ----------------------------------------------------------------------------------- usp

def usp_mesh(mesh: Mesh, ulysses: int) -> Mesh:
    """`mesh`'s devices with its last axis, `sp`, split into ('sp': sp / ulysses ring
    members, 'ulysses': that many consecutive devices): the same devices in the same order,
    so arrays sharded over the sequence on `mesh` need no transfer."""
    if mesh.axis_names[-1] != SP:
        raise ValueError(f"usp splits the mesh's last axis, which must be {SP!r}")
    shape = mesh.devices.shape
    return Mesh(mesh.devices.reshape(*shape[:-1], shape[-1] // ulysses, ulysses),
                (*mesh.axis_names, ULYSSES))


def usp_attention(q, k, v, *, mesh, layout="striped", causal=True, segment_ids=None,
                  q_chunk=512, kv_chunk=512, impl="auto", ulysses=1):
    """`ring_attention`'s arguments and result (q, k, v and segment ids in `layout`'s order
    for a ring of sp / ulysses), by Ulysses all-to-alls over groups of `ulysses` consecutive
    sp devices and the ring across the groups: needs the query heads per tp shard divisible
    by `ulysses` (K/V heads are repeated as needed)."""
    n, tp = mesh.shape[SP], mesh.shape[HEAD_AXIS]
    if ulysses < 1 or n % ulysses:
        raise ValueError(f"usp's ulysses={ulysses} does not divide sp={n}")
    if q.shape[2] % (tp * ulysses):
        raise ValueError(f"usp splits the {q.shape[2] // tp} query heads per tp shard over "
                         f"ulysses={ulysses}: they are not divisible")
    settings = _settings(n // ulysses, layout, causal, q_chunk, kv_chunk, impl, q,
                         mesh.devices.flat[0])
    inner = lambda q, k, v, s: _ring(settings, q, k, v, s, s)
    return on_mesh(functools.partial(_ulysses, ULYSSES, ulysses, inner),
                   usp_mesh(mesh, ulysses), q, k, v, segment_ids, seq_axes=(SP, ULYSSES))


_STRATEGY_FNS = {"ring": ring_attention, "all_gather": all_gather_attention,
                 "ulysses": ulysses_attention, "usp": usp_attention}


def context_parallel_attention(q, k, v, *, mesh, strategy="ring", ulysses=1, **kwargs):
    """Attention of global arrays whose sequence axis is sharded over `sp`, by `strategy`
    (one of `STRATEGIES`; `ulysses`: usp's Ulysses degree); `kwargs` and the result as
    `ring_attention`'s."""
    if strategy not in _STRATEGY_FNS:
        raise ValueError(f"unknown attention strategy {strategy!r}; use one of {STRATEGIES}")
    if strategy == "usp":
        kwargs["ulysses"] = ulysses
    return _STRATEGY_FNS[strategy](q, k, v, mesh=mesh, **kwargs)

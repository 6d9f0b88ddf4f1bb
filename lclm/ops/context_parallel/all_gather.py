"""All-gather (`attention.strategy='all_gather'`, Llama 3's context parallelism): each device
gathers the whole sequence's K/V (and segment ids) once, then runs the ring's rounds on
local slices of it: round r is the block that started on device me - r, with the ring's
positions, kernel call sites and mask classes, merged by log-sum-exp in float32, only without
the hops. Its own custom VJP gathers K/V again in the backward (nothing n times larger is
kept), accumulates dK/dV of the whole sequence in float32 and reduce-scatters them
(`psum_scatter`) in float32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from lclm.ops.context_parallel.contract import Step, Strategy, StrategyCost
from lclm.ops.context_parallel.rounds import (
    SP,
    Settings,
    make_settings,
    merge_partials,
    on_mesh,
    saved,
    setup,
)
from lclm.ops.kernels.contract import F32


def _gathered(s: Settings, x):
    """`[b, t, ...] -> [b, n t, ...]`: the shards of every sp device, in device order."""
    return None if x is None else lax.all_gather(x, s.axis, axis=1, tiled=True)


def _source(x, src, t: int):
    """Block `[b, t, ...]` of the gathered `x` that started on device `src`."""
    return None if x is None else lax.dynamic_slice_in_dim(x, src * t, t, axis=1)


def _gather_forward(s: Settings, q, k, v, seg):
    """(o `[b, t, h, d]`, lse `[b, t, h]`) float32 of this device's queries against every
    key. Round 0 (own block, no wait for the gather), then rounds 1 .. n-1 as the ring's."""
    site, q_pos, k_pos = setup(s, q, "forward")
    o, lse = site(range(1))(q, k, v, q_pos, k_pos(0), seg, seg)
    if s.n == 1:
        return o, lse
    others, t, me = site(range(1, s.n)), q.shape[1], lax.axis_index(s.axis)
    k_all, v_all, seg_all = (_gathered(s, x) for x in (k, v, seg))

    def round_(carry, r):
        src = (me - r) % s.n
        part = others(
            q,
            _source(k_all, src, t),
            _source(v_all, src, t),
            q_pos,
            k_pos(r),
            seg,
            _source(seg_all, src, t),
        )
        return merge_partials(*carry, *part), None

    (o, lse), _ = lax.scan(round_, (o, lse), jnp.arange(1, s.n))
    return o, lse


def _gather_backward(s: Settings, residuals, do):
    """float32 (dq, dk, dv) of this device's shards: every round's dK/dV lands in a float32
    buffer of the whole sequence, reduce-scattered back to the devices that own the keys."""
    q, k, v, seg, o, lse = residuals
    site, q_pos, k_pos = setup(s, q, "backward")
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
        dq_r, dk_r, dv_r = others(
            q,
            _source(k_all, src, t),
            _source(v_all, src, t),
            o,
            lse,
            do,
            q_pos,
            k_pos(r),
            seg,
            _source(seg_all, src, t),
        )
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
    # named as the ring's: remat='attention' keeps them, the backward never gathers twice
    o, lse = saved(*_gather_forward(settings, q, k, v, seg), q.dtype)
    return o, (q, k, v, seg, o, lse)


def _all_gather_bwd(settings, residuals, do):
    q, k, v = residuals[:3]
    dq, dk, dv = _gather_backward(settings, residuals, do)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_all_gather.defvjp(_all_gather_fwd, _all_gather_bwd)


def all_gather_attention(
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
    """`ring_attention`'s arguments and result, K/V all-gathered over `sp` instead of passed
    round the ring."""
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
    return on_mesh(lambda q, k, v, s: _all_gather(settings, q, k, v, s), mesh, q, k, v, segment_ids)


@dataclasses.dataclass(frozen=True)
class AllGather(Strategy):
    """K/V gathered once forward and once backward (again where remat re-runs the forward),
    the float32 dK/dV reduce-scattered. The gather waits for the layer's K/V projection and
    the attention waits for the gather: exposed, but one collective instead of n - 1 small
    ones, and memory for the whole sequence's K/V (n kv) plus its float32 gradient."""

    name = "all_gather"

    def attention(self, q, k, v, *, mesh, **kwargs):
        return all_gather_attention(q, k, v, mesh=mesh, **kwargs)

    def buffers(self, step: Step) -> float:
        """The whole sequence's K/V and their float32 gradient."""
        return step.n * step.kv * (1 + 4 / step.dtype_bytes)

    def cost(self, step: Step) -> StrategyCost:
        n, b = step.n, step.dtype_bytes
        sent = (2 + 4 / b + (1 if step.recompute else 0)) * (n - 1) * step.kv
        return StrategyCost(
            self.name,
            f"all-gather {n}",
            {step.ring_link: sent * step.per_step},
            sent / (step.ring_gbs * 1e9) * step.per_step,
            self.buffers(step),
        )


STRATEGY = AllGather()

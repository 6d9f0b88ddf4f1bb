"""The blockwise kernel: pure-JAX attention of one block pair, `impl='blockwise'`.

Runs on every platform and serves every shape, which makes it `attention.impl='auto'`'s last
resort and the kernel the fused ones are checked against (with `reference.dense_attention`).
Queries and keys are cut into `q_chunk x kv_chunk` tiles with an online softmax over key
tiles (FlashAttention-2 style), all statistics in float32.

Tiles that the mask hides entirely are skipped, not computed and masked: each query chunk
loops over the span of key chunks that `visible_tiles` marks (and each key chunk, in the
backward, over its span of query chunks). The spans are loop bounds, not a `lax.cond` per
tile. (On XLA:GPU a while loop still reads its predicate on the host once per iteration;
only the fused kernels, whose loops run inside the kernel, avoid both.)
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from lclm.ops.kernels.contract import F32, Kernel, visible_tiles


def _span(visible):
    """First and one-past-last True of a bool vector (0, 0 when none): the loop bounds."""
    n = visible.shape[0]
    any_ = visible.any()
    first = jnp.argmax(visible)
    last = n - jnp.argmax(visible[::-1])
    return jnp.where(any_, first, 0).astype(jnp.int32), jnp.where(any_, last, 0).astype(jnp.int32)


def _mask_bias(q_pos, k_pos, q_seg, k_seg, causal: bool):
    """Additive mask `[batch or 1, qc, 1, 1, kc]`: 0 where visible, -inf where hidden."""
    visible = jnp.ones((1, q_pos.shape[0], k_pos.shape[0]), bool)
    if causal:
        visible = visible & (q_pos[:, None] >= k_pos[None, :])[None]
    if q_seg is not None:
        visible = visible & (q_seg[:, :, None] == k_seg[:, None, :])
    return jnp.where(visible, 0.0, -jnp.inf).astype(F32)[:, :, None, None, :]


def _chunks(x, size: int, axis: int = 1):
    """Split `axis` into chunks and move the chunk index to the front."""
    if x is None:
        return None
    shape = x.shape[:axis] + (x.shape[axis] // size, size) + x.shape[axis + 1 :]
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def _unchunk(x, axis: int = 1):
    """Inverse of `_chunks`."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2 :])


def _check_chunks(tq: int, tk: int, q_chunk: int, kv_chunk: int) -> tuple[int, int]:
    qc, kc = min(q_chunk, tq), min(kv_chunk, tk)
    if tq % qc or tk % kc:
        raise ValueError(
            f"local query/key lengths {tq}/{tk} are not divisible by q_chunk={qc}/kv_chunk={kc}"
        )
    return qc, kc


def _grouped(x, kv_heads: int):
    """[b, t, h, d] -> [b, t, kv_heads, h // kv_heads, d]."""
    b, t, h, d = x.shape
    return x.reshape(b, t, kv_heads, h // kv_heads, d)


def _span_loop(span, body, init):
    """`for i in range(*span): carry = body(i, carry)` with traced bounds, as a `while_loop`.

    Deliberately not a scan: kernels run only inside the ring's custom VJP and are never
    differentiated, and a scan inside the layer scan would let JAX's partial evaluation hoist
    the loop-invariant per-tile masks out of the layer loop, stacked over all tiles
    (materialising [seq, seq] arrays). A while loop is opaque to that.
    """
    lo, hi = span
    return lax.while_loop(lambda c: c[0] < hi, lambda c: (c[0] + 1, body(c[0], c[1])), (lo, init))[
        1
    ]


def _loop(n: int, body, init):
    """`for i in range(n): carry = body(i, carry)` (`_span_loop` over 0..n; inline for 1)."""
    if n == 1:
        return body(jnp.int32(0), init)
    return _span_loop((jnp.int32(0), n), body, init)


def _at(x, i):
    return None if x is None else x[i]


def forward(q, k, v, q_pos, k_pos, q_seg, k_seg, *, causal: bool, q_chunk: int, kv_chunk: int):
    """Attention of one query block over one key/value block. Returns (o f32, lse f32).

    q `[b, tq, h, d]`, k/v `[b, tk, kv_heads, d]`, q_pos `[tq]`, k_pos `[tk]`, q_seg `[b, tq]` /
    k_seg `[b, tk]` or None; o `[b, tq, h, d]`, lse `[b, tq, h]`.
    """
    b, tq, h, d = q.shape
    hkv = k.shape[2]
    qc, kc = _check_chunks(tq, k.shape[1], q_chunk, kv_chunk)
    scale = d**-0.5
    qs = _chunks(_grouped(q, hkv), qc)  # [nq, b, qc, hkv, g, d]
    ks, vs = _chunks(k, kc), _chunks(v, kc)  # [nk, b, kc, hkv, d]
    qps, kps = q_pos.reshape(-1, qc), k_pos.reshape(-1, kc)
    qss, kss = _chunks(q_seg, qc), _chunks(k_seg, kc)
    visible = visible_tiles(q_pos, k_pos, q_seg, k_seg, causal, qc, kc)
    stat_shape = (b, qc, hkv, h // hkv)

    def per_q_chunk(i, out):
        qb, qpb, qsb = qs[i], qps[i], _at(qss, i)

        def per_kv_chunk(j, carry):
            kb, vb, kpb, ksb = ks[j], vs[j], kps[j], _at(kss, j)
            o, m, l = carry
            s = jnp.einsum("bqhgd,bkhd->bqhgk", qb, kb, preferred_element_type=F32) * scale
            s = s + _mask_bias(qpb, kpb, qsb, ksb, causal)
            m_new = jnp.maximum(m, s.max(-1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.exp(s - m_safe[..., None])
            corr = jnp.exp(m - m_safe)
            l = l * corr + p.sum(-1)
            pv = jnp.einsum("bqhgk,bkhd->bqhgd", p.astype(vb.dtype), vb, preferred_element_type=F32)
            return o * corr[..., None] + pv, m_new, l

        init = (
            jnp.zeros(stat_shape + (d,), F32),
            jnp.full(stat_shape, -jnp.inf, F32),
            jnp.zeros(stat_shape, F32),
        )
        o, m, l = _span_loop(_span(visible[i]), per_kv_chunk, init)
        lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
        o = o / jnp.where(l > 0, l, 1.0)[..., None]
        o_all, lse_all = out
        return o_all.at[i].set(o), lse_all.at[i].set(lse)

    nq = qs.shape[0]
    out = (jnp.zeros((nq,) + stat_shape + (d,), F32), jnp.zeros((nq,) + stat_shape, F32))
    o, lse = _loop(nq, per_q_chunk, out)
    o = _unchunk(o).reshape(b, tq, h, d)
    lse = _unchunk(lse).reshape(b, tq, h)
    return o, lse


def backward(
    q, k, v, o, lse, do, q_pos, k_pos, q_seg, k_seg, *, causal: bool, q_chunk: int, kv_chunk: int
):
    """Gradients of one block pair given the global output and log-sum-exp. All float32.

    Shapes as in `forward`; o/do `[b, tq, h, d]`, lse `[b, tq, h]` (global over ring rounds).
    Returns dq `[b, tq, h, d]`, dk/dv `[b, tk, kv_heads, d]`.
    """
    b, tq, h, d = q.shape
    hkv = k.shape[2]
    qc, kc = _check_chunks(tq, k.shape[1], q_chunk, kv_chunk)
    scale = d**-0.5
    delta = jnp.sum(do.astype(F32) * o.astype(F32), axis=-1)  # [b, tq, h]
    lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    grouped = lambda x: _grouped(x, hkv)
    qs, dos = _chunks(grouped(q), qc), _chunks(grouped(do), qc)
    lses = _chunks(lse_safe.reshape(b, tq, hkv, h // hkv), qc)
    deltas = _chunks(delta.reshape(b, tq, hkv, h // hkv), qc)
    ks, vs = _chunks(k, kc), _chunks(v, kc)
    qps, kps = q_pos.reshape(-1, qc), k_pos.reshape(-1, kc)
    qss, kss = _chunks(q_seg, qc), _chunks(k_seg, kc)
    visible = visible_tiles(q_pos, k_pos, q_seg, k_seg, causal, qc, kc)

    def per_kv_chunk(j, acc):
        kb, vb, kpb, ksb = ks[j], vs[j], kps[j], _at(kss, j)

        def per_q_chunk(i, carry):
            qb, dob, lseb, deltab = qs[i], dos[i], lses[i], deltas[i]
            qpb, qsb = qps[i], _at(qss, i)
            dq_all, dk, dv = carry
            s = jnp.einsum("bqhgd,bkhd->bqhgk", qb, kb, preferred_element_type=F32) * scale
            s = s + _mask_bias(qpb, kpb, qsb, ksb, causal)
            p = jnp.exp(s - lseb[..., None])  # exactly 0 where masked
            dv = dv + jnp.einsum(
                "bqhgk,bqhgd->bkhd", p.astype(dob.dtype), dob, preferred_element_type=F32
            )
            dp = jnp.einsum("bqhgd,bkhd->bqhgk", dob, vb, preferred_element_type=F32)
            ds = (p * (dp - deltab[..., None])).astype(qb.dtype)
            dq = jnp.einsum("bqhgk,bkhd->bqhgd", ds, kb, preferred_element_type=F32) * scale
            dk = dk + jnp.einsum("bqhgk,bqhgd->bkhd", ds, qb, preferred_element_type=F32) * scale
            return dq_all.at[i].add(dq), dk, dv

        dq_all, dk_all, dv_all = acc
        init = (dq_all, jnp.zeros(kb.shape, F32), jnp.zeros(vb.shape, F32))
        dq_all, dk, dv = _span_loop(_span(visible[:, j]), per_q_chunk, init)
        return dq_all, dk_all.at[j].set(dk), dv_all.at[j].set(dv)

    acc = (jnp.zeros(qs.shape, F32), jnp.zeros(ks.shape, F32), jnp.zeros(vs.shape, F32))
    dq, dk, dv = _loop(ks.shape[0], per_kv_chunk, acc)
    dq = _unchunk(dq).reshape(b, tq, h, d)
    return dq, _unchunk(dk), _unchunk(dv)


KERNEL = Kernel(forward, backward)

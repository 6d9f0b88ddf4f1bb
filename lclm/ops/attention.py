"""Blockwise attention on one device: the reference kernel behind lclm's kernel interface.

A *kernel* computes attention between one block of queries and one block of keys/values
(one ring round) and is defined by two functions:

- `forward(q, k, v, q_pos, k_pos, q_seg, k_seg, *, causal, q_chunk, kv_chunk) -> (o, lse)`
- `backward(q, k, v, o, lse, do, q_pos, k_pos, q_seg, k_seg, *, causal, q_chunk, kv_chunk)
   -> (dq, dk, dv)`, where `o` and `lse` are the *global* output and log-sum-exp (over all
   rounds), so per-block gradients add up exactly (FlashAttention-2 style recomputation).

Shapes: q, o, do `[batch, tq, heads, dim]`; k, v `[batch, tk, kv_heads, dim]` with
`heads % kv_heads == 0` (GQA: K/V are never repeated in memory); lse `[batch, tq, heads]`
float32; q_pos `[tq]`, k_pos `[tk]` int32 original token positions (masking follows from
them, so any layout works); q_seg `[batch, tq]`, k_seg `[batch, tk]` int32 segment ids or
None (ids never decrease along the original order, as packing gives them: the blockwise and
Pallas kernels would serve any ids, the range-based ones of `lclm.ops.range_kernel` need
this). Returned `o`, `dq`, `dk`, `dv` are float32; statistics are always float32.

Tiles of `q_chunk x kv_chunk` that the mask hides entirely are skipped, not computed and
masked: each query chunk loops over the span of key chunks that `visible_tiles` marks (and
each key chunk, in the backward, over its span of query chunks). The spans are loop bounds,
not a `lax.cond` per tile. (On XLA:GPU a while loop still reads its predicate on the host
once per iteration; only the fused kernels, whose loops run inside the kernel, avoid both.)
"""

from __future__ import annotations

import importlib
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32


def tile_visible(q_pos, k_pos, q_seg, k_seg, causal: bool):
    """Whether any (query, key) pair of a tile may be visible. Scalar bool.

    A necessary condition only (a True tile can still be partly masked): used to skip work.
    q_pos `[qc]`, k_pos `[kc]`, q_seg `[batch, qc]` / k_seg `[batch, kc]` or None.
    """
    visible = jnp.bool_(True)
    if causal:
        visible = jnp.max(q_pos) >= jnp.min(k_pos)
    if q_seg is not None:
        overlap = (jnp.min(q_seg) <= jnp.max(k_seg)) & (jnp.min(k_seg) <= jnp.max(q_seg))
        visible = visible & overlap
    return visible


def visible_tiles(q_pos, k_pos, q_seg, k_seg, causal: bool, q_chunk: int, kv_chunk: int):
    """`tile_visible` of every (query chunk, key chunk) pair at once: bool `[nq, nk]`.

    q_pos `[tq]`, k_pos `[tk]`; q_seg `[batch, tq]` / k_seg `[batch, tk]` or None.
    """
    pair = lambda qp, kp, qs, ks: tile_visible(qp, kp, qs, ks, causal)
    per_query_chunk = jax.vmap(jax.vmap(pair, (None, 0, None, 0)), (0, None, 0, None))
    return per_query_chunk(q_pos.reshape(-1, q_chunk), k_pos.reshape(-1, kv_chunk),
                           _chunks(q_seg, q_chunk), _chunks(k_seg, kv_chunk))


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
    shape = x.shape[:axis] + (x.shape[axis] // size, size) + x.shape[axis + 1:]
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def _unchunk(x, axis: int = 1):
    """Inverse of `_chunks`."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2:])


def _check_chunks(tq: int, tk: int, q_chunk: int, kv_chunk: int) -> tuple[int, int]:
    qc, kc = min(q_chunk, tq), min(kv_chunk, tk)
    if tq % qc or tk % kc:
        raise ValueError(
            f"local query/key lengths {tq}/{tk} are not divisible by q_chunk={qc}/kv_chunk={kc}")
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
    return lax.while_loop(lambda c: c[0] < hi, lambda c: (c[0] + 1, body(c[0], c[1])),
                          (lo, init))[1]


def _loop(n: int, body, init):
    """`for i in range(n): carry = body(i, carry)` (`_span_loop` over 0..n; inline for 1)."""
    if n == 1:
        return body(jnp.int32(0), init)
    return _span_loop((jnp.int32(0), n), body, init)


def _at(x, i):
    return None if x is None else x[i]


def blockwise_forward(q, k, v, q_pos, k_pos, q_seg, k_seg, *, causal: bool,
                      q_chunk: int, kv_chunk: int):
    """Attention of one query block over one key/value block. Returns (o f32, lse f32)."""
    b, tq, h, d = q.shape
    hkv = k.shape[2]
    qc, kc = _check_chunks(tq, k.shape[1], q_chunk, kv_chunk)
    scale = d ** -0.5
    qs = _chunks(_grouped(q, hkv), qc)                      # [nq, b, qc, hkv, g, d]
    ks, vs = _chunks(k, kc), _chunks(v, kc)                 # [nk, b, kc, hkv, d]
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
            pv = jnp.einsum("bqhgk,bkhd->bqhgd", p.astype(vb.dtype), vb,
                            preferred_element_type=F32)
            return o * corr[..., None] + pv, m_new, l

        init = (jnp.zeros(stat_shape + (d,), F32), jnp.full(stat_shape, -jnp.inf, F32),
                jnp.zeros(stat_shape, F32))
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


def blockwise_backward(q, k, v, o, lse, do, q_pos, k_pos, q_seg, k_seg, *, causal: bool,
                       q_chunk: int, kv_chunk: int):
    """Gradients of one block pair given the global output and log-sum-exp. All float32."""
    b, tq, h, d = q.shape
    hkv = k.shape[2]
    qc, kc = _check_chunks(tq, k.shape[1], q_chunk, kv_chunk)
    scale = d ** -0.5
    delta = jnp.sum(do.astype(F32) * o.astype(F32), axis=-1)          # [b, tq, h]
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
            dv = dv + jnp.einsum("bqhgk,bqhgd->bkhd", p.astype(dob.dtype), dob,
                                 preferred_element_type=F32)
            dp = jnp.einsum("bqhgd,bkhd->bqhgk", dob, vb, preferred_element_type=F32)
            ds = (p * (dp - deltab[..., None])).astype(qb.dtype)
            dq = jnp.einsum("bqhgk,bkhd->bqhgd", ds, kb, preferred_element_type=F32) * scale
            dk = dk + jnp.einsum("bqhgk,bqhgd->bkhd", ds, qb,
                                 preferred_element_type=F32) * scale
            return dq_all.at[i].add(dq), dk, dv

        dq_all, dk_all, dv_all = acc
        init = (dq_all, jnp.zeros(kb.shape, F32), jnp.zeros(vb.shape, F32))
        dq_all, dk, dv = _span_loop(_span(visible[:, j]), per_q_chunk, init)
        return dq_all, dk_all.at[j].set(dk), dv_all.at[j].set(dv)

    acc = (jnp.zeros(qs.shape, F32), jnp.zeros(ks.shape, F32), jnp.zeros(vs.shape, F32))
    dq, dk, dv = _loop(ks.shape[0], per_kv_chunk, acc)
    dq = _unchunk(dq).reshape(b, tq, h, d)
    return dq, _unchunk(dk), _unchunk(dv)


class Kernel(NamedTuple):
    """A block-pair attention kernel (see the module docstring for the contract).

    `takes_platform`: its passes take `platform=`, the platform of the devices the program
    is compiled for (a mesh's, which need not be JAX's default backend: ahead-of-time
    compilation for a TPU on a CPU machine); they compile for their own platform and run
    interpreted on others."""
    forward: Callable
    backward: Callable
    takes_platform: bool = False


# name -> Kernel, or "module:attribute" of one, imported on first use so that a backend's
# Pallas code is only loaded where it is asked for.
KERNELS: dict[str, Kernel | str] = {
    "blockwise": Kernel(blockwise_forward, blockwise_backward),
    "pallas_gpu": "lclm.ops.pallas_gpu:KERNEL",
    "pallas_tpu": "lclm.ops.pallas_tpu:KERNEL",
    "tokamax_gpu": "lclm.ops.tokamax_gpu:KERNEL",
}
# what `attention.impl='auto'` tries on each platform, fastest first: the first kernel whose
# limits (`kernel_limits`) allow the shapes is used. A kernel runs compiled only on its own
# platform; elsewhere (pallas_* on CPU) it is interpreted, which is for tests, never picked.
AUTO = {"gpu": ("tokamax_gpu", "pallas_gpu", "blockwise"), "tpu": ("pallas_tpu", "blockwise"),
        "cpu": ("blockwise",)}
IMPLS = ("auto", *KERNELS)


def _power_of_two(n: int) -> bool:
    return n > 0 and not n & (n - 1)


def kernel_limits(impl: str, *, head_dim: int, q_chunk: int, kv_chunk: int, block: int,
                  platform: str | None = None, dtype: str | None = None) -> str | None:
    """Why `impl` cannot serve these shapes (None: it can). `block` is the run of consecutive
    local positions tiles stay inside (the local length; half of it with zigzag). `platform`
    None checks only the rules that hold everywhere; `dtype` is the compute dtype's name (None:
    not checked). Segment ids, GQA, causal and strictly causal rounds are served by every
    kernel (range-based ones need segment ids that never decrease along a row)."""
    if impl == "auto":  # resolved per platform by `choose_kernel`, always to a kernel that can
        return None
    q_tile, kv_tile = min(q_chunk, block), min(kv_chunk, block)
    if impl == "pallas_gpu":
        if platform == "tpu":
            return "it runs on GPUs (interpreted on CPU); use 'pallas_tpu' on TPU"
        from_gpu = {"head dim": head_dim, "query tile": min(q_tile, 128),
                    "key tile": min(kv_tile, 64)}
        for name, n in from_gpu.items():
            if not _power_of_two(n):
                return f"its {name} {n} must be a power of two"
            if name != "head dim" and n < 16 and platform == "gpu":  # Triton's smallest dot
                return f"its {name} {n} must be >= 16 on a GPU"
    elif impl == "pallas_tpu":
        if platform == "gpu":
            return "it runs on TPUs (interpreted on CPU); use 'pallas_gpu' on GPU"
        if not _power_of_two(head_dim):
            return f"its head dim {head_dim} must be a power of two"
        if platform == "tpu":
            for name, tile in (("q_chunk", q_tile), ("kv_chunk", kv_tile)):
                if tile != block and tile % 128:
                    return f"attention.{name}={tile} must be a multiple of 128 or {block}"
    elif impl == "tokamax_gpu":
        from lclm.ops.tokamax_gpu import INSTALL, available
        if platform not in ("gpu", None):
            return "it runs on NVIDIA Hopper/Blackwell GPUs only (tokamax's Mosaic GPU kernel)"
        if head_dim not in (64, 128):  # bench.correctness's; others are unmeasured (tokamax pads)
            return f"its head dim {head_dim} must be 64 or 128 (the ones checked on a GPU yet)"
        if not available():
            return f"tokamax is not installed: {INSTALL}"
        if dtype not in (None, "bfloat16", "float16"):
            return f"it computes in bfloat16/float16, not {dtype}"
        if platform == "gpu" and not hopper_or_newer():
            return "its kernels need a Hopper (sm90) or newer GPU"
    elif impl not in KERNELS:
        return f"it is not a kernel; use one of {IMPLS}"
    return None


def hopper_or_newer() -> bool:
    """Whether the first local device is an NVIDIA GPU of compute capability >= 9.0."""
    capability = getattr(jax.devices()[0], "compute_capability", "0")
    try:
        return float(capability) >= 9.0
    except ValueError:  # a ROCm 'gfx...' name
        return False


def platform_family(platform: str) -> str:
    """jax's platform name -> the key of `AUTO` ('cuda'/'rocm' are GPUs)."""
    return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


def choose_kernel(impl: str, *, head_dim: int, q_chunk: int, kv_chunk: int, block: int,
                  platform: str, dtype: str | None = None) -> str:
    """The kernel name `attention.impl` means here: 'auto' -> the first of `AUTO[platform]`
    that can serve the shapes; an explicit name that cannot -> ValueError (one line)."""
    platform = platform_family(platform)
    shapes = dict(head_dim=head_dim, q_chunk=q_chunk, kv_chunk=kv_chunk, block=block,
                  platform=platform, dtype=dtype)
    if impl == "auto":
        for name in AUTO.get(platform, ("blockwise",)):
            if kernel_limits(name, **shapes) is None:
                return name
        return "blockwise"
    why = kernel_limits(impl, **shapes)
    if why is not None:
        raise ValueError(f"attention.impl={impl!r} cannot run here: {why} "
                         "(attention.impl='auto' picks a kernel that can)")
    return impl


def get_kernel(impl: str) -> Kernel:
    """The kernel registered under a kernel name (see `choose_kernel` for 'auto')."""
    try:
        entry = KERNELS[impl]
    except KeyError:
        raise ValueError(
            f"attention impl {impl!r} is not available; use one of {sorted(KERNELS)}") from None
    if isinstance(entry, str):
        module, attribute = entry.split(":")
        entry = getattr(importlib.import_module(module), attribute)
    return entry


def dense_attention(q, k, v, *, causal: bool = True, segment_ids=None, positions=None,
                    k_positions=None, k_segment_ids=None):
    """Plain float32 softmax attention: the reference every blockwise path is tested against.

    q `[b, tq, h, d]`, k/v `[b, tk, kv_heads, d]`, segment_ids `[b, tq]`, positions `[tq]`
    (original positions of the given order; default arange). The keys' own positions and
    segment ids (`[tk]`, `[b, tk]`) default to the queries' (self-attention). Rows with
    nothing visible give 0. Materialises `[tq, tk]` scores.
    """
    q, k, v = (x.astype(F32) for x in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    pos = jnp.arange(q.shape[1]) if positions is None else positions
    k_pos = pos if k_positions is None else k_positions
    k_seg = segment_ids if k_segment_ids is None else k_segment_ids
    mask = jnp.ones((1, 1, q.shape[1], k.shape[1]), bool)
    if causal:
        mask = mask & (pos[:, None] >= k_pos[None, :])[None, None]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, None, :, None] == k_seg[:, None, None, :])
    s = jnp.where(mask, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(mask, p, 0.0)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)

"""Fused flash-attention block kernel for GPUs, in Pallas (Triton lowering): `impl='pallas_gpu'`.

Implements lclm's kernel contract (`contract`): `forward` returns the block's output
and float32 natural-log log-sum-exp; `backward` takes the *global* output and log-sum-exp of
all ring rounds and returns float32 dq, dk, dv for this block pair. Masks come from original
token positions (`q_pos >= k_pos` when causal, which also expresses the striped rounds'
strictly causal blocks) and segment ids, so every ring layout is served by one kernel.

Structure (FlashAttention-2):
- forward: grid (batch, heads, query tiles); a loop over key tiles keeps running max/sum in
  registers. K/V of query head h are read from kv head h // group (GQA without repeats).
- backward: one kernel over (batch, kv heads, key tiles) accumulates dk, dv over the group's
  query heads and all query tiles; one over (batch, heads, query tiles) accumulates dq.
  delta = rowsum(do * o) is computed outside in plain JAX.
- A tile pair is skipped (`lax.cond`, lowered to `scf.if`) unless its positions/segment-id
  ranges allow a visible pair: the same predicate as the blockwise kernel
  (`contract.tile_visible`), at this kernel's own tile size, in both passes.
  Rows with nothing visible give o = 0, lse = -inf, zero gradients and no NaN.

Tile sizes are `min(q_chunk, 128) x min(kv_chunk, 64)` (clipped to the block); Triton needs
powers of two >= 16 and a head dim that is a power of two (64 and 128 are the LLaMA ones).
On a CPU backend the same kernels run in Pallas interpret mode: that is how CI checks them
against the dense reference; speed is only meaningful on a GPU (see `bench/`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from lclm.ops.kernels import platform_family, target_device
from lclm.ops.kernels.contract import F32, Kernel, tile_visible

MAX_BLOCK_Q = 128
MAX_BLOCK_K = 64
# Finite stand-in for -inf inside the kernel: keeps the running max finite (no inf - inf);
# probabilities of masked pairs are zeroed explicitly, so its value never leaks into results.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _interpret(platform: str | None) -> bool:
    """Interpret mode on CPU, Triton on GPU; `platform`: that of the devices the program is
    for (default: the device kernels are built for, `target_device`: a described GPU in an
    ahead-of-time compile, not this host's CPU)."""
    backend = platform or platform_family(target_device().platform)
    if backend == "tpu":
        raise ValueError("attention.impl='pallas_gpu' runs on GPUs; use 'pallas_tpu' on TPU")
    return backend == "cpu"


def _power_of_two(n: int) -> bool:
    return n > 0 and not n & (n - 1)


def limits(
    *,
    head_dim: int,
    q_chunk: int,
    kv_chunk: int,
    block: int,
    platform: str | None = None,
    dtype: str | None = None,
) -> str | None:
    """Why this kernel cannot serve the shapes (`contract.Kernel.limits`): Triton's rules on
    tiles and head dim, GPUs only (interpreted on CPU). Every float dtype is served."""
    del dtype
    if platform == "tpu":
        return "it runs on GPUs (interpreted on CPU); use 'pallas_tpu' on TPU"
    sizes = {
        "head dim": head_dim,
        "query tile": min(q_chunk, block, MAX_BLOCK_Q),
        "key tile": min(kv_chunk, block, MAX_BLOCK_K),
    }
    for name, n in sizes.items():
        if not _power_of_two(n):
            return f"its {name} {n} must be a power of two"
        if name != "head dim" and n < 16 and platform == "gpu":  # Triton's smallest dot
            return f"its {name} {n} must be >= 16 on a GPU"
    return None


def _tiles(tq: int, tk: int, d: int, q_chunk: int, kv_chunk: int) -> tuple[int, int]:
    bq, bk = min(q_chunk, MAX_BLOCK_Q, tq), min(kv_chunk, MAX_BLOCK_K, tk)
    if tq % bq or tk % bk:
        raise ValueError(
            f"pallas_gpu: block lengths {tq}/{tk} are not divisible by tiles {bq}/{bk}"
        )
    for name, n in (("query tile", bq), ("key tile", bk), ("head dim", d)):
        if not _power_of_two(n):
            raise ValueError(f"pallas_gpu: {name} {n} must be a power of two")
    return bq, bk


def _mask(qp, kp, qs, ks, causal: bool):
    """Visible pairs `[tq_tile, tk_tile]` bool, or None when everything is visible."""
    mask = None
    if causal:
        mask = qp[:, None] >= kp[None, :]
    if qs is not None:
        same = qs[:, None] == ks[None, :]
        mask = same if mask is None else mask & same
    return mask


def _compiler_params(bq: int, bk: int):
    return plgpu.CompilerParams(num_warps=4 if bq * bk < 128 * 128 else 8, num_stages=2)


def _skip_hidden(visible, compute, carry, masked: bool):
    """`compute(carry)` if the tile may hold a visible pair, else `carry` unchanged."""
    return lax.cond(visible, compute, lambda c: c, carry) if masked else compute(carry)


def _over_key_tiles(k_ref, v_ref, kp_ref, ks_ref, qp, qs, *, bk, causal, step, init):
    """Fold `step(k, v, kp, ks, carry)` over the key tiles that may be visible to this query
    tile (`[bk, d]` K/V tiles, `[bk]` positions / segment ids); hidden tiles are skipped."""
    seg = ks_ref is not None

    def body(j, carry):
        span = pl.ds(pl.multiple_of(j * bk, bk), bk)
        kp = kp_ref[span]
        ks = ks_ref[span] if seg else None
        compute = lambda c: step(k_ref[span, :], v_ref[span, :], kp, ks, c)
        return _skip_hidden(tile_visible(qp, kp, qs, ks, causal), compute, carry, causal or seg)

    return lax.fori_loop(0, k_ref.shape[0] // bk, body, init)


def _split_refs(rest, seg):
    """(query segment ref, key segment ref, output refs) of a kernel's trailing refs: the
    segment refs come first, and exist only where `seg`."""
    return (rest[0], rest[1], rest[2:]) if seg else (None, None, rest)


def _forward_kernel(q_ref, k_ref, v_ref, qp_ref, kp_ref, *rest, causal, scale, bk, seg):
    qs_ref, ks_ref, (o_ref, lse_ref) = _split_refs(rest, seg)
    bq, d = q_ref.shape
    q, qp = q_ref[...], qp_ref[...]
    qs = qs_ref[...] if seg else None

    def step(k, v, kp, ks, carry):
        acc, m, l = carry
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=F32) * scale
        mask = _mask(qp, kp, qs, ks, causal)
        if mask is not None:
            s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp(s - m_new[:, None])
        if mask is not None:
            p = jnp.where(mask, p, 0.0)
        corr = jnp.exp(m - m_new)
        pv = lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=F32
        )
        return acc * corr[:, None] + pv, m_new, l * corr + jnp.sum(p, axis=1)

    init = (jnp.zeros((bq, d), F32), jnp.full((bq,), MASK_VALUE, F32), jnp.zeros((bq,), F32))
    acc, m, l = _over_key_tiles(
        k_ref, v_ref, kp_ref, ks_ref, qp, qs, bk=bk, causal=causal, step=step, init=init
    )
    seen = l > 0
    o_ref[...] = acc / jnp.where(seen, l, 1.0)[:, None]
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)


def _block_shapes(q, k, q_chunk: int, kv_chunk: int):
    """(batch, tq, heads, dim, tk, query heads per kv head, query tile, key tile) of a call."""
    b, tq, h, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    return (b, tq, h, d, tk, h // hkv, *_tiles(tq, tk, d, q_chunk, kv_chunk))


def forward(
    q,
    k,
    v,
    q_pos,
    k_pos,
    q_seg,
    k_seg,
    *,
    causal: bool,
    q_chunk: int,
    kv_chunk: int,
    platform: str | None = None,
    device_kind: str | None = None,
):
    """Attention of one query block over one K/V block. Returns (o f32, lse f32).

    q `[b, tq, h, d]`, k/v `[b, tk, hkv, d]`, q_pos `[tq]`, k_pos `[tk]`, q_seg `[b, tq]` /
    k_seg `[b, tk]` or None. o `[b, tq, h, d]`, lse `[b, tq, h]`.
    """
    del device_kind  # the tiles follow the chunks on every GPU
    b, tq, h, d, tk, group, bq, bk = _block_shapes(q, k, q_chunk, kv_chunk)
    seg = q_seg is not None
    q_tile = pl.BlockSpec((None, bq, None, d), lambda b_, h_, i: (b_, i, h_, 0))
    kv_all = pl.BlockSpec((None, tk, None, d), lambda b_, h_, i: (b_, 0, h_ // group, 0))
    in_specs = [
        q_tile,
        kv_all,
        kv_all,
        pl.BlockSpec((bq,), lambda b_, h_, i: (i,)),
        pl.BlockSpec((tk,), lambda b_, h_, i: (0,)),
    ]
    args = [q, k, v, q_pos.astype(jnp.int32), k_pos.astype(jnp.int32)]
    if seg:
        in_specs += [
            pl.BlockSpec((None, bq), lambda b_, h_, i: (b_, i)),
            pl.BlockSpec((None, tk), lambda b_, h_, i: (b_, 0)),
        ]
        args += [q_seg.astype(jnp.int32), k_seg.astype(jnp.int32)]
    kernel = functools.partial(_forward_kernel, causal=causal, scale=d**-0.5, bk=bk, seg=seg)
    o, lse = pl.pallas_call(
        kernel,
        grid=(b, h, tq // bq),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, bq, None, d), lambda b_, h_, i: (b_, i, h_, 0)),
            pl.BlockSpec((None, None, bq), lambda b_, h_, i: (b_, h_, i)),
        ],
        out_shape=[jax.ShapeDtypeStruct((b, tq, h, d), F32), jax.ShapeDtypeStruct((b, h, tq), F32)],
        compiler_params=_compiler_params(bq, bk),
        interpret=_interpret(platform),
        name="lclm_flash_forward",
    )(*args)
    return o, jnp.swapaxes(lse, 1, 2)


def _probabilities(q, k, qp, kp, qs, ks, lse, scale, causal):
    """Softmax probabilities of a tile from the global lse, exactly 0 where masked. f32."""
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=F32) * scale
    p = jnp.exp(s - lse[:, None])
    mask = _mask(qp, kp, qs, ks, causal)
    return p if mask is None else jnp.where(mask, p, 0.0)


def _dkdv_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    qp_ref,
    kp_ref,
    *rest,
    causal,
    scale,
    bq,
    group,
    seg,
):
    qs_ref, ks_ref, (dk_ref, dv_ref) = _split_refs(rest, seg)
    bk, d = k_ref.shape
    k, v = k_ref[...], v_ref[...]
    kp = kp_ref[...]
    ks = ks_ref[...] if seg else None
    nq = q_ref.shape[0] // bq

    def per_q_tile(head, i, carry):
        span = pl.ds(pl.multiple_of(i * bq, bq), bq)
        qp = qp_ref[span]
        qs = qs_ref[span] if seg else None

        def compute(carry):
            dk, dv = carry
            q, do = q_ref[span, head, :], do_ref[span, head, :]
            p = _probabilities(q, k, qp, kp, qs, ks, lse_ref[head, span], scale, causal)
            dv = dv + lax.dot_general(
                p.astype(do.dtype), do, (((0,), (0,)), ((), ())), preferred_element_type=F32
            )
            dp = lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=F32)
            ds = p * (dp - delta_ref[head, span][:, None]) * scale
            dk = dk + lax.dot_general(
                ds.astype(q.dtype), q, (((0,), (0,)), ((), ())), preferred_element_type=F32
            )
            return dk, dv

        return _skip_hidden(tile_visible(qp, kp, qs, ks, causal), compute, carry, causal or seg)

    carry = (jnp.zeros((bk, d), F32), jnp.zeros((bk, d), F32))
    for head in range(group):  # the query heads that share this kv head
        carry = lax.fori_loop(0, nq, functools.partial(per_q_tile, head), carry)
    dk_ref[...], dv_ref[...] = carry


def _dq_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qp_ref, kp_ref, *rest, causal, scale, bk, seg
):
    qs_ref, ks_ref, (dq_ref,) = _split_refs(rest, seg)
    bq, d = q_ref.shape
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    qp = qp_ref[...]
    qs = qs_ref[...] if seg else None

    def step(k, v, kp, ks, dq):
        p = _probabilities(q, k, qp, kp, qs, ks, lse, scale, causal)
        dp = lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=F32)
        ds = p * (dp - delta[:, None]) * scale
        return dq + lax.dot_general(
            ds.astype(k.dtype), k, (((1,), (0,)), ((), ())), preferred_element_type=F32
        )

    dq_ref[...] = _over_key_tiles(
        k_ref,
        v_ref,
        kp_ref,
        ks_ref,
        qp,
        qs,
        bk=bk,
        causal=causal,
        step=step,
        init=jnp.zeros((bq, d), F32),
    )


def backward(
    q,
    k,
    v,
    o,
    lse,
    do,
    q_pos,
    k_pos,
    q_seg,
    k_seg,
    *,
    causal: bool,
    q_chunk: int,
    kv_chunk: int,
    platform: str | None = None,
    device_kind: str | None = None,
):
    """Gradients of one block pair from the global output and lse. Returns f32 (dq, dk, dv)."""
    del device_kind  # the tiles follow the chunks on every GPU
    b, tq, h, d, tk, group, bq, bk = _block_shapes(q, k, q_chunk, kv_chunk)
    seg = q_seg is not None
    scale = d**-0.5
    do = do.astype(q.dtype)
    # rows that see nothing anywhere have lse = -inf; any finite value gives p = 0 there
    lse = jnp.swapaxes(jnp.where(jnp.isfinite(lse), lse, 0.0), 1, 2)  # [b, h, tq]
    delta = jnp.swapaxes(jnp.sum(do.astype(F32) * o.astype(F32), axis=-1), 1, 2)  # [b, h, tq]
    pos = [q_pos.astype(jnp.int32), k_pos.astype(jnp.int32)]
    segs = [q_seg.astype(jnp.int32), k_seg.astype(jnp.int32)] if seg else []
    interpret, params = _interpret(platform), _compiler_params(bq, bk)

    # dk, dv: grid over (batch, kv head, key tile); the group's query heads are read in place
    q_all = pl.BlockSpec((None, tq, group, d), lambda b_, g_, j: (b_, 0, g_, 0))
    stat_all = pl.BlockSpec((None, group, tq), lambda b_, g_, j: (b_, g_, 0))
    k_tile = pl.BlockSpec((None, bk, None, d), lambda b_, g_, j: (b_, j, g_, 0))
    in_specs = [
        q_all,
        k_tile,
        k_tile,
        q_all,
        stat_all,
        stat_all,
        pl.BlockSpec((tq,), lambda b_, g_, j: (0,)),
        pl.BlockSpec((bk,), lambda b_, g_, j: (j,)),
    ]
    if seg:
        in_specs += [
            pl.BlockSpec((None, tq), lambda b_, g_, j: (b_, 0)),
            pl.BlockSpec((None, bk), lambda b_, g_, j: (b_, j)),
        ]
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, causal=causal, scale=scale, bq=bq, group=group, seg=seg),
        grid=(b, h // group, tk // bk),
        in_specs=in_specs,
        out_specs=[k_tile, k_tile],
        out_shape=[jax.ShapeDtypeStruct(k.shape, F32), jax.ShapeDtypeStruct(v.shape, F32)],
        compiler_params=params,
        interpret=interpret,
        name="lclm_flash_backward_dkdv",
    )(q, k, v, do, lse, delta, *pos, *segs)

    # dq: grid over (batch, head, query tile), looping over key tiles
    q_tile = pl.BlockSpec((None, bq, None, d), lambda b_, h_, i: (b_, i, h_, 0))
    kv_all = pl.BlockSpec((None, tk, None, d), lambda b_, h_, i: (b_, 0, h_ // group, 0))
    stat_tile = pl.BlockSpec((None, None, bq), lambda b_, h_, i: (b_, h_, i))
    in_specs = [
        q_tile,
        kv_all,
        kv_all,
        q_tile,
        stat_tile,
        stat_tile,
        pl.BlockSpec((bq,), lambda b_, h_, i: (i,)),
        pl.BlockSpec((tk,), lambda b_, h_, i: (0,)),
    ]
    if seg:
        in_specs += [
            pl.BlockSpec((None, bq), lambda b_, h_, i: (b_, i)),
            pl.BlockSpec((None, tk), lambda b_, h_, i: (b_, 0)),
        ]
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, causal=causal, scale=scale, bk=bk, seg=seg),
        grid=(b, h, tq // bq),
        in_specs=in_specs,
        out_specs=q_tile,
        out_shape=jax.ShapeDtypeStruct(q.shape, F32),
        compiler_params=params,
        interpret=interpret,
        name="lclm_flash_backward_dq",
    )(q, k, v, do, lse, delta, *pos, *segs)
    return dq, dk, dv


KERNEL = Kernel(forward, backward, limits, takes_platform=True)

"""Flash-attention block kernel for TPUs, in Pallas (Mosaic lowering): `impl='pallas_tpu'`.

Implements lclm's kernel contract (`contract`): `forward` returns the block's float32
output and natural-log log-sum-exp; `backward` takes the *global* output and log-sum-exp of all
ring rounds and returns float32 dq, dk, dv of this block pair. Masks come from original token
positions (`q_pos >= k_pos` when causal, which also covers the striped rounds' strictly causal
blocks) and segment ids (visible where equal), so one kernel serves every ring layout.

Structure (FlashAttention-2, three `pallas_call`s, grids iterate tiles of qc x kc):
- forward, grid (batch, heads, q tiles, kv tiles): running max / sum / output in VMEM
  scratch across the kv-tile axis; o and lse are written at the last kv tile.
- dK/dV, grid (batch, kv heads, kv tiles, group, q tiles): accumulates over the query heads
  of the kv head's group and over all q tiles, so K/V are never repeated (GQA/MQA: query head
  h reads kv head h // group in the index maps). It works on transposed scores
  `[kv tile, q tile]`, so every matmul is `a @ b` or `a @ b.T` (no transposed lhs).
- dQ, grid (batch, heads, q tiles, kv tiles): accumulates over kv tiles.
  delta = rowsum(do * o) is computed outside, in plain JAX.

Layouts: the wrapper transposes q/k/v/do to `[batch, heads, seq, dim]` so that the last two
block dims are `(tile, dim)`. Small per-token data is packed in pairs with the pair axis
last or second-to-last, so every block of it is `(tile, 2)` or `(2, tile)` (a block dim equal
to the array dim is always legal) and each pass streams one such array per side: token ids
(position, segment id) `[b, t, 2]` and, for the backward, row statistics (lse, delta)
`[b, h, tq, 2]`. The forward and dQ kernels see query data as columns (`[qc, 2]`) and key
data as rows (`[2, kc]`); the dK/dV kernel sees the transpose, and the forward's lse comes out
as `[b, h, tq, 1]`. On a real TPU both tiles must therefore be multiples of 128 or the whole
block length (`_tile`), and they are sized to the generation's VMEM (`TPU_TILES`).

Tile skipping: per-tile ranges (min/max position, min/max segment id) and, for each row of
tiles, the first and last tile that may be visible ("hull") go to SMEM by scalar prefetch
(`pltpu.PrefetchScalarGridSpec`). Inside the kernels `pl.when(visible)` skips the compute of
tiles the mask hides entirely (same predicate as `contract.tile_visible`); the index
maps clamp the streamed tile index into the hull, so tiles before it are not fetched early and
tiles after it repeat the last block index, which the Pallas pipeline does not fetch again.
The tables hold O(batch * (tiles_q + tiles_k)) scalars, so SMEM use stays small at any length.
Rows with nothing visible give o = 0, lse = -inf, zero gradients and no NaN (NaN inputs,
though, still give NaN: emptiness is tested as `l == 0`, not `l > 0`).

Interpret mode: for devices other than TPUs (`platform`, the mesh's) the same kernels run in
Pallas's TPU interpret mode, `pallas_call(..., interpret=pltpu.InterpretParams())`, which
exists in jax 0.10 and 0.12 alike, simulates TPU memory spaces, scalar prefetch and the grid,
and is scoped to these calls (unlike the global `pltpu.force_tpu_interpret_mode()` context). Its
default fills uninitialised memory with NaN, so a missing scratch initialisation shows up in
tests. This is how CI checks the kernels on CPU (slowly). CI also exports them for the TPU
platform (`jax.export`), which runs the Pallas -> Mosaic lowering with its block-shape checks;
the Mosaic compiler proper (libtpu) and real TPU speed are not exercised without a TPU.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from lclm.ops.kernels import target_device
from lclm.ops.kernels.contract import F32, Kernel

I32 = jnp.int32
_SQ = pl.squeezed  # a block dim of size 1 that the kernel does not see
# Per-tile record in the SMEM tables: (min position, max position, min segment, max segment).
_FIELDS = 4


class _Cfg(NamedTuple):
    """Static shapes and options of one call."""

    batch: int
    heads: int
    kv_heads: int
    tq: int
    tk: int
    dim: int
    qc: int
    kc: int
    causal: bool
    segments: bool
    compiled: bool  # Mosaic for a TPU; Pallas's TPU interpreter for any other platform

    @property
    def nq(self) -> int:
        return self.tq // self.qc

    @property
    def nk(self) -> int:
        return self.tk // self.kc

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def scale(self) -> float:
        return self.dim**-0.5


# Largest (query, key) tiles per TPU generation (jax's device_kind): the biggest that the
# XLA:TPU/Mosaic compiler of libtpu 0.0.42 fits in the default scoped VMEM for both passes at
# head dims 64 and 128, GQA and segments, blocks of 8K-64K tokens (ahead-of-time compiles,
# 2026-11-24). v4 overflows at 2048 x 512 (16.6M of 16M), v5p at 2048 x 1024; v5e fits
# 2048 x 1024 at 8K blocks but not at 32K or in a LLaMA-1B step at 4K; v6e fits it at all.
# VMEM use grows with the tile area, not the head dim, so tiles are set apart from
# attention.q_chunk/kv_chunk (the blockwise and ring chunking, often 2048 and larger).
TPU_TILES = {
    "TPU v4": (1024, 1024),
    "TPU v5": (1024, 1024),  # v5p
    "TPU v5 lite": (1024, 1024),  # v5e
    "TPU v6 lite": (2048, 1024),  # v6e
}
# a generation not in the table (a new one, or an unnamed device kind) gets the smallest
_TPU_TILES_DEFAULT = min(TPU_TILES.values())
_MAX_HEAD_DIM = 128  # the head dims the tiles were compiled at


def tpu_tiles(device_kind: str | None) -> tuple[int, int]:
    """The largest (query, key) tiles `pallas_tpu` uses on a TPU of `device_kind`."""
    return TPU_TILES.get(device_kind or "", _TPU_TILES_DEFAULT)


def _tile(length: int, largest: int) -> int | None:
    """The tile of a block of `length`: the whole block when it is at most `largest`, else
    the largest power of two up to `largest` that divides it and keeps Mosaic's rule (the
    tile is the lane dim of the `(2, tile)` id / stat blocks: a multiple of 128 or the
    whole block). None when there is none."""
    if length <= largest:
        return length
    tile = 1 << (largest.bit_length() - 1)
    while tile >= 128 and length % tile:
        tile //= 2
    return tile if tile >= 128 else None


def _config(q, k, q_seg, causal, q_chunk, kv_chunk, platform, device_kind=None) -> _Cfg:
    """Validated static settings; q `[b, tq, h, d]`, k `[b, tk, kv_heads, d]`.

    Compiled for a TPU the tiles come from `tpu_tiles(device_kind)`; interpreted (tests, CPU
    meshes) they are `q_chunk`/`kv_chunk` clipped to the block, so that small blocks still
    exercise several tiles."""
    b, tq, h, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    if h % hkv:
        raise ValueError(f"pallas_tpu: {h} query heads are not a multiple of {hkv} kv heads")
    compiled = (platform or target_device().platform) == "tpu"
    if compiled:
        largest_q, largest_k = tpu_tiles(device_kind)
        qc, kc = _tile(tq, largest_q), _tile(tk, largest_k)
        if qc is None or kc is None:
            raise ValueError(
                f"pallas_tpu: block lengths {tq}/{tk} must be multiples of 128 "
                f"(or at most {largest_q}/{largest_k}) on a TPU"
            )
    else:
        qc, kc = min(q_chunk, tq), min(kv_chunk, tk)
        if tq % qc or tk % kc:
            raise ValueError(
                f"pallas_tpu: block lengths {tq}/{tk} are not divisible by "
                f"q_chunk={qc}/kv_chunk={kc}"
            )
    return _Cfg(b, h, hkv, tq, tk, d, qc, kc, bool(causal), q_seg is not None, compiled)


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
    """Why this kernel cannot serve the shapes (`contract.Kernel.limits`): TPUs only
    (interpreted on CPU), a power-of-two head dim of at most 128, and on a TPU a block
    that its own tiles divide (`q_chunk`/`kv_chunk` do not set its tiles there). Every
    float dtype is served."""
    del dtype, q_chunk, kv_chunk
    if platform == "gpu":
        return "it runs on TPUs (interpreted on CPU); use 'pallas_gpu' on GPU"
    if not _power_of_two(head_dim) or head_dim > _MAX_HEAD_DIM:
        return f"its head dim {head_dim} must be a power of two up to {_MAX_HEAD_DIM}"
    if platform == "tpu" and _tile(block, min(_TPU_TILES_DEFAULT)) is None:
        return (
            f"the local block of {block} tokens must be a multiple of 128 (or at most "
            f"{min(_TPU_TILES_DEFAULT)}) on a TPU"
        )
    return None


def _interpret(cfg: _Cfg):
    """TPU interpret mode off TPU (see the module docstring), compiled Mosaic on TPU."""
    return False if cfg.compiled else pltpu.InterpretParams()


# ----------------------------------------------------------------------------- tile tables


def _tile_table(pos, seg, chunk: int, batch: int):
    """Per-tile ranges `[batch, n_tiles, 4]` int32: (pos min, pos max, seg min, seg max).

    pos `[t]`, seg `[batch, t]` or None (then every tile has segment range (0, 0)).
    """
    n = pos.shape[0] // chunk
    p = pos.astype(I32).reshape(n, chunk)
    p_lo = jnp.broadcast_to(p.min(1), (batch, n))
    p_hi = jnp.broadcast_to(p.max(1), (batch, n))
    if seg is None:
        s_lo = s_hi = jnp.zeros((batch, n), I32)
    else:
        s = seg.astype(I32).reshape(batch, n, chunk)
        s_lo, s_hi = s.min(-1), s.max(-1)
    return jnp.stack([p_lo, p_hi, s_lo, s_hi], axis=-1)


def _visible(qi, ki, causal: bool):
    """Whether a (query tile, key tile) pair may hold a visible pair.

    qi, ki: the 4 fields of `_tile_table` as scalars (in kernels) or broadcastable arrays.
    Same predicate as `contract.tile_visible`.
    """
    vis = (qi[2] <= ki[3]) & (ki[2] <= qi[3])
    if causal:
        vis = vis & (qi[1] >= ki[0])
    return vis


def _hull(vis):
    """First and last visible inner tile per (batch, outer tile), flat `[batch * n_outer * 2]`.

    vis `[batch, n_outer, n_inner]` bool. Rows with nothing visible get (0, 0).
    """
    idx = jnp.arange(vis.shape[-1], dtype=I32)
    first = jnp.where(vis, idx, vis.shape[-1]).min(-1)
    last = jnp.where(vis, idx, -1).max(-1)
    empty = last < 0
    first, last = jnp.where(empty, 0, first), jnp.where(empty, 0, last)
    return jnp.stack([first, last], axis=-1).reshape(-1).astype(I32)


def _tables(cfg: _Cfg, q_pos, k_pos, q_seg, k_seg):
    """Scalar-prefetch tables: flat q/k tile ranges, hulls over kv tiles and over q tiles."""
    qt = _tile_table(q_pos, q_seg, cfg.qc, cfg.batch)  # [b, nq, 4]
    kt = _tile_table(k_pos, k_seg, cfg.kc, cfg.batch)  # [b, nk, 4]
    qi = tuple(qt[:, :, None, f] for f in range(_FIELDS))
    ki = tuple(kt[:, None, :, f] for f in range(_FIELDS))
    vis = _visible(qi, ki, cfg.causal)  # [b, nq, nk]
    flat = lambda t: t.reshape(-1)
    return flat(qt), flat(kt), _hull(vis), _hull(vis.transpose(0, 2, 1))


def _read_tile(table_ref, b, i, n):
    """The 4 fields of tile i of batch row b from a flat SMEM table."""
    base = (b * n + i) * _FIELDS
    return tuple(table_ref[base + f] for f in range(_FIELDS))


def _tile_visible(cfg: _Cfg, qt_ref, kt_ref, b, i, j):
    """In-kernel skip predicate of query tile i and key tile j."""
    return _visible(_read_tile(qt_ref, b, i, cfg.nq), _read_tile(kt_ref, b, j, cfg.nk), cfg.causal)


def _clamp(hull_ref, row, idx):
    """Streamed tile index clamped into the visible hull of `row` (see module docstring)."""
    return jnp.minimum(jnp.maximum(idx, hull_ref[2 * row]), hull_ref[2 * row + 1])


# ----------------------------------------------------------------------------- layouts


def _heads_first(x):
    """[b, t, h, d] <-> [b, h, t, d]."""
    return x.transpose(0, 2, 1, 3)


def _token_ids(cfg: _Cfg, pos, seg):
    """(position, segment id) per token `[b, t, 2]` int32; segment 0 everywhere when absent.

    One small array per side instead of two: each input of a pallas_call costs a DMA per
    step (and, in interpret mode, compile time).
    """
    pos = jnp.broadcast_to(pos.astype(I32), (cfg.batch, pos.shape[0]))
    seg = jnp.zeros_like(pos) if seg is None else seg.astype(I32)
    return jnp.stack([pos, seg], axis=-1)


def _rows(x):
    """`[..., t, 2]` -> `[..., 2, t]`: per-token pairs laid out along lanes."""
    return jnp.swapaxes(x, -1, -2)


# ----------------------------------------------------------------------------- kernel math


def _precision(a, b):
    """Full float32 matmuls for float32 operands, the native pass for narrower ones: set here,
    not inherited from `jax_default_matmul_precision`, because Mosaic refuses HIGHEST on
    bfloat16 operands ("Bad lhs type")."""
    wide = a.dtype == F32 and b.dtype == F32
    return lax.Precision.HIGHEST if wide else lax.Precision.DEFAULT


def _dot_nt(a, b):
    """a @ b.T with float32 accumulation: a `[m, d]`, b `[n, d]` -> `[m, n]`."""
    return lax.dot_general(
        a, b, (((1,), (1,)), ((), ())), precision=_precision(a, b), preferred_element_type=F32
    )


def _dot_nn(a, b):
    """a @ b with float32 accumulation: a `[m, n]`, b `[n, d]` -> `[m, d]`."""
    return lax.dot_general(
        a, b, (((1,), (0,)), ((), ())), precision=_precision(a, b), preferred_element_type=F32
    )


def _masked_scores(cfg: _Cfg, rows, cols, row_ids, col_ids, q_is_row: bool):
    """Scaled scores `rows @ cols.T` `[m, n]` float32 with hidden pairs set to -inf.

    rows `[m, d]`, cols `[n, d]`; row_ids `[m, 2]` and col_ids `[2, n]` hold (position,
    segment id) of each row / column. The query side is `rows` (forward, dQ) or `cols` (dK/dV,
    which works on transposed scores).
    """
    s = _dot_nt(rows, cols) * cfg.scale
    row_pos, row_seg = row_ids[:, 0:1], row_ids[:, 1:2]  # [m, 1]
    col_pos, col_seg = col_ids[0:1, :], col_ids[1:2, :]  # [1, n]
    mask = None
    if cfg.causal:
        mask = row_pos >= col_pos if q_is_row else col_pos >= row_pos
    if cfg.segments:
        same = row_seg == col_seg
        mask = same if mask is None else mask & same
    return s if mask is None else jnp.where(mask, s, -jnp.inf)


# ----------------------------------------------------------------------------- kernels


def _forward_kernel(
    cfg: _Cfg,
    qt_ref,
    kt_ref,
    hull_ref,
    q_ref,
    k_ref,
    v_ref,
    qid_ref,
    kid_ref,
    o_ref,
    lse_ref,
    m_ref,
    l_ref,
    acc_ref,
):
    """Forward step of (query tile i, key tile j): q `[qc, d]`, k/v `[kc, d]`, qid `[qc, 2]`,
    kid `[2, kc]`; scratch m/l `[qc, 1]`, acc `[qc, d]`; outputs o `[qc, d]`, lse `[qc, 1]`."""
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, F32)
        l_ref[...] = jnp.zeros(l_ref.shape, F32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, F32)

    @pl.when(_tile_visible(cfg, qt_ref, kt_ref, b, i, j))
    def _compute():
        v = v_ref[...]
        s = _masked_scores(cfg, q_ref[...], k_ref[...], qid_ref[...], kid_ref[...], q_is_row=True)
        m_prev = m_ref[...]
        m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
        # a row with nothing visible so far keeps m = -inf: shift by 0 instead (no inf - inf)
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_safe)
        corr = jnp.exp(m_prev - m_safe)
        l_ref[...] = corr * l_ref[...] + p.sum(axis=1, keepdims=True)
        acc_ref[...] = corr * acc_ref[...] + _dot_nn(p.astype(v.dtype), v)
        m_ref[...] = m_new

    @pl.when(j == cfg.nk - 1)
    def _finish():
        l = l_ref[...]
        # `l == 0` rather than `l > 0`: NaN inputs stay NaN instead of passing as empty rows
        empty = l == 0.0
        l_safe = jnp.where(empty, 1.0, l)
        o_ref[...] = jnp.where(empty, 0.0, acc_ref[...] / l_safe)
        lse_ref[...] = jnp.where(empty, -jnp.inf, m_ref[...] + jnp.log(l_safe))


def _dq_kernel(
    cfg: _Cfg,
    qt_ref,
    kt_ref,
    hull_ref,
    q_ref,
    do_ref,
    stat_ref,
    k_ref,
    v_ref,
    qid_ref,
    kid_ref,
    dq_ref,
    acc_ref,
):
    """dQ step of (query tile i, key tile j): q/do `[qc, d]`, stat `[qc, 2]` (lse, delta),
    k/v `[kc, d]`, qid `[qc, 2]`, kid `[2, kc]`; scratch acc and output dq `[qc, d]`."""
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, F32)

    @pl.when(_tile_visible(cfg, qt_ref, kt_ref, b, i, j))
    def _compute():
        k, stat = k_ref[...], stat_ref[...]
        s = _masked_scores(cfg, q_ref[...], k, qid_ref[...], kid_ref[...], q_is_row=True)
        p = jnp.exp(s - stat[:, 0:1])  # exactly 0 where hidden
        dp = _dot_nt(do_ref[...], v_ref[...])
        ds = p * (dp - stat[:, 1:2])
        acc_ref[...] += _dot_nn(ds.astype(k.dtype), k) * cfg.scale

    @pl.when(j == cfg.nk - 1)
    def _finish():
        dq_ref[...] = acc_ref[...]


def _dkv_kernel(
    cfg: _Cfg,
    qt_ref,
    kt_ref,
    hull_ref,
    q_ref,
    do_ref,
    stat_ref,
    k_ref,
    v_ref,
    qid_ref,
    kid_ref,
    dk_ref,
    dv_ref,
    dk_acc,
    dv_acc,
):
    """dK/dV step of (key tile j, group member g, query tile i) on transposed scores
    `[kc, qc]`: q/do `[qc, d]`, stat `[2, qc]` (lse, delta), k/v `[kc, d]`, qid `[2, qc]`,
    kid `[kc, 2]`; scratch and outputs dk/dv `[kc, d]`."""
    b, j, g, i = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)

    @pl.when((g == 0) & (i == 0))
    def _init():
        dk_acc[...] = jnp.zeros(dk_acc.shape, F32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, F32)

    @pl.when(_tile_visible(cfg, qt_ref, kt_ref, b, i, j))
    def _compute():
        q, do, stat = q_ref[...], do_ref[...], stat_ref[...]
        st = _masked_scores(cfg, k_ref[...], q, kid_ref[...], qid_ref[...], q_is_row=False)
        pt = jnp.exp(st - stat[0:1, :])  # exactly 0 where hidden
        dv_acc[...] += _dot_nn(pt.astype(do.dtype), do)
        dpt = _dot_nt(v_ref[...], do)
        dst = pt * (dpt - stat[1:2, :])
        dk_acc[...] += _dot_nn(dst.astype(q.dtype), q) * cfg.scale

    @pl.when((g == cfg.group - 1) & (i == cfg.nq - 1))
    def _finish():
        dk_ref[...] = dk_acc[...]
        dv_ref[...] = dv_acc[...]


# ----------------------------------------------------------------------------- pallas calls


def _query_major_specs(cfg: _Cfg, stat_width: int):
    """BlockSpecs on the forward / dQ grid (b, h, i, j): (q-like, stat `[qc, stat_width]`,
    k-like, query ids, key ids). K/V come from kv head h // group, their tile index clamped
    into query tile i's hull."""
    g, nq = cfg.group, cfg.nq
    kv_tile = lambda b, i, j, hull: _clamp(hull, b * nq + i, j)
    q_like = pl.BlockSpec((_SQ, _SQ, cfg.qc, cfg.dim), lambda b, h, i, j, *_: (b, h, i, 0))
    stat = pl.BlockSpec((_SQ, _SQ, cfg.qc, stat_width), lambda b, h, i, j, *_: (b, h, i, 0))
    # lax.div, not `//`: indices are non-negative, and jnp's floor division lowers through
    # `sign`, whose Mosaic rule needs to know the TPU generation
    k_like = pl.BlockSpec(
        (_SQ, _SQ, cfg.kc, cfg.dim),
        lambda b, h, i, j, qt, kt, hull: (b, lax.div(h, g), kv_tile(b, i, j, hull), 0),
    )
    q_ids = pl.BlockSpec((_SQ, cfg.qc, 2), lambda b, h, i, j, *_: (b, i, 0))
    k_ids = pl.BlockSpec(
        (_SQ, 2, cfg.kc), lambda b, h, i, j, qt, kt, hull: (b, 0, kv_tile(b, i, j, hull))
    )
    return q_like, stat, k_like, q_ids, k_ids


def _key_major_specs(cfg: _Cfg):
    """BlockSpecs on the dK/dV grid (b, kv head, j, g, i): (q-like, stat `[2, qc]`, k-like,
    query ids, key ids). Query head = kv head * group + g; its tile index is clamped into
    key tile j's hull."""
    group, nk = cfg.group, cfg.nk
    q_tile = lambda b, j, i, hull: _clamp(hull, b * nk + j, i)
    q_like = pl.BlockSpec(
        (_SQ, _SQ, cfg.qc, cfg.dim),
        lambda b, hk, j, g, i, qt, kt, hull: (b, hk * group + g, q_tile(b, j, i, hull), 0),
    )
    stat = pl.BlockSpec(
        (_SQ, _SQ, 2, cfg.qc),
        lambda b, hk, j, g, i, qt, kt, hull: (b, hk * group + g, 0, q_tile(b, j, i, hull)),
    )
    k_like = pl.BlockSpec((_SQ, _SQ, cfg.kc, cfg.dim), lambda b, hk, j, g, i, *_: (b, hk, j, 0))
    q_ids = pl.BlockSpec(
        (_SQ, 2, cfg.qc), lambda b, hk, j, g, i, qt, kt, hull: (b, 0, q_tile(b, j, i, hull))
    )
    k_ids = pl.BlockSpec((_SQ, cfg.kc, 2), lambda b, hk, j, g, i, *_: (b, j, 0))
    return q_like, stat, k_like, q_ids, k_ids


def _call(kernel, cfg: _Cfg, grid, sequential: int, in_specs, out_specs, out_shape, scratch, name):
    """A pallas_call with three scalar-prefetch tables (q tiles, k tiles, hull) and float32
    VMEM scratch. The last `sequential` grid axes carry the accumulators (they run in order);
    the others are independent (a megacore TPU may split them)."""
    semantics = (pltpu.PARALLEL,) * (len(grid) - sequential) + (pltpu.ARBITRARY,) * sequential
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM(shape, F32) for shape in scratch],
    )
    return pl.pallas_call(
        lambda *refs: kernel(cfg, *refs),
        out_shape=out_shape,
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
        interpret=_interpret(cfg),
        name=name,
    )


# ----------------------------------------------------------------------------- interface


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
    """Attention of one query block over one key/value block. Returns (o f32, lse f32).

    q `[b, tq, h, d]`, k/v `[b, tk, kv_heads, d]`, q_pos `[tq]`, k_pos `[tk]`,
    q_seg `[b, tq]` / k_seg `[b, tk]` or None; o `[b, tq, h, d]`, lse `[b, tq, h]`.
    `platform`, `device_kind`: those of the devices the program is for (default: JAX's
    default backend); on a TPU the tiles follow the generation (`tpu_tiles`).
    """
    cfg = _config(q, k, q_seg, causal, q_chunk, kv_chunk, platform, device_kind)
    qt, kt, hull_kv, _ = _tables(cfg, q_pos, k_pos, q_seg, k_seg)
    q_like, stat, k_like, q_ids, k_ids = _query_major_specs(cfg, stat_width=1)
    b, h = cfg.batch, cfg.heads
    o, lse = _call(
        _forward_kernel,
        cfg,
        grid=(b, h, cfg.nq, cfg.nk),
        sequential=1,
        in_specs=[q_like, k_like, k_like, q_ids, k_ids],
        out_specs=[q_like, stat],
        out_shape=[
            jax.ShapeDtypeStruct((b, h, cfg.tq, cfg.dim), F32),
            jax.ShapeDtypeStruct((b, h, cfg.tq, 1), F32),
        ],
        scratch=[(cfg.qc, 1), (cfg.qc, 1), (cfg.qc, cfg.dim)],
        name="lclm_flash_forward",
    )(
        qt,
        kt,
        hull_kv,
        _heads_first(q),
        _heads_first(k),
        _heads_first(v),
        _token_ids(cfg, q_pos, q_seg),
        _rows(_token_ids(cfg, k_pos, k_seg)),
    )
    return _heads_first(o), lse[..., 0].transpose(0, 2, 1)


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
    """Gradients of one block pair given the global output and log-sum-exp. All float32.

    Shapes as in `forward`; o/do `[b, tq, h, d]`, lse `[b, tq, h]` (global over ring rounds).
    Returns dq `[b, tq, h, d]`, dk/dv `[b, tk, kv_heads, d]`.
    """
    cfg = _config(q, k, q_seg, causal, q_chunk, kv_chunk, platform, device_kind)
    qt, kt, hull_kv, hull_q = _tables(cfg, q_pos, k_pos, q_seg, k_seg)
    delta = jnp.sum(do.astype(F32) * o.astype(F32), axis=-1)
    # rows with nothing visible (lse = -inf) have every score at -inf: any finite shift
    # keeps their probabilities at exactly 0
    lse = jnp.where(lse == -jnp.inf, 0.0, lse).astype(F32)
    stats = jnp.stack([lse, delta], axis=-1).transpose(0, 2, 1, 3)  # [b, h, tq, 2]
    q_ids, k_ids = _token_ids(cfg, q_pos, q_seg), _token_ids(cfg, k_pos, k_seg)
    qh, doh, kh, vh = (_heads_first(x) for x in (q, do, k, v))
    b, h, hkv = cfg.batch, cfg.heads, cfg.kv_heads

    q_like, stat, k_like, q_id_spec, k_id_spec = _query_major_specs(cfg, stat_width=2)
    dq = _call(
        _dq_kernel,
        cfg,
        grid=(b, h, cfg.nq, cfg.nk),
        sequential=1,
        in_specs=[q_like, q_like, stat, k_like, k_like, q_id_spec, k_id_spec],
        out_specs=q_like,
        out_shape=jax.ShapeDtypeStruct((b, h, cfg.tq, cfg.dim), F32),
        scratch=[(cfg.qc, cfg.dim)],
        name="lclm_flash_dq",
    )(qt, kt, hull_kv, qh, doh, stats, kh, vh, q_ids, _rows(k_ids))

    q_like, stat, k_like, q_id_spec, k_id_spec = _key_major_specs(cfg)
    dkv_shape = jax.ShapeDtypeStruct((b, hkv, cfg.tk, cfg.dim), F32)
    dk, dv = _call(
        _dkv_kernel,
        cfg,
        grid=(b, hkv, cfg.nk, cfg.group, cfg.nq),
        sequential=2,
        in_specs=[q_like, q_like, stat, k_like, k_like, q_id_spec, k_id_spec],
        out_specs=[k_like, k_like],
        out_shape=[dkv_shape, dkv_shape],
        scratch=[(cfg.kc, cfg.dim), (cfg.kc, cfg.dim)],
        name="lclm_flash_dkv",
    )(qt, kt, hull_q, qh, doh, _rows(stats), kh, vh, _rows(q_ids), k_ids)
    return _heads_first(dq), _heads_first(dk), _heads_first(dv)


KERNEL = Kernel(forward, backward, limits, takes_platform=True)

"""The Pallas TPU kernel (`impl='pallas_tpu'`, run here in TPU interpret mode) against the
blockwise reference kernel and dense attention: values, log-sum-exp and gradients.

Interpret mode is slow (each pallas_call compiles for about a second), so the cases are few
and each covers several features; tiles are 128 (the TPU block rule's minimum lane width).
Under every strategy (the ring included) it runs in tests/ops/test_strategies.py.
"""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lclm.ops.kernels import get_kernel
from lclm.ops.kernels.blockwise import backward as blockwise_backward
from lclm.ops.kernels.blockwise import forward as blockwise_forward
from lclm.ops.kernels.pallas_tpu import KERNEL, _Cfg, _config, _tables, _tile, limits, tpu_tiles
from lclm.ops.kernels.reference import dense_attention

TILE = 128


def _close(got, want, tol=1e-4, what=""):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all(), f"{what}: non-finite values"
    err = np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-12)
    assert err < tol, f"{what}: relative error {err:.2e}"


def _lse_close(got, want, tol=1e-4):
    """Log-sum-exps agree, with -inf (nothing visible) in exactly the same rows."""
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=tol, atol=tol)


def _pair_attention(q, k, v, q_pos, k_pos, q_seg, k_seg, causal):
    """Dense float32 attention of a query block over a key block: (o, lse `[b, tq, h]`).

    Unlike `dense_attention` the two blocks may differ (a striped ring round); rows with
    nothing visible give o = 0 and lse = -inf, with finite gradients.
    """
    q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    mask = jnp.ones((1, 1, q.shape[1], k.shape[1]), bool)
    if causal:
        mask = mask & (q_pos[:, None] >= k_pos[None, :])
    if q_seg is not None:
        mask = mask & (q_seg[:, None, :, None] == k_seg[:, None, None, :])
    # a large finite fill keeps empty rows' softmax finite; the mask then zeroes them
    p = jax.nn.softmax(jnp.where(mask, s, -1e30), axis=-1) * mask
    lse = jnp.where(mask.any(-1), jax.nn.logsumexp(jnp.where(mask, s, -1e30), axis=-1), -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v), lse.transpose(0, 2, 1)


def _random_case(
    seed, *, b=1, tq=256, tk=256, h=4, hkv=2, d=64, segments=False, striped=None, dtype=jnp.float32
):
    """Random block pair. striped=(n, j, k): q/k hold the tokens of devices j/k of an n-way
    striped ring (positions x*n + j and y*n + k); otherwise both are positions 0..t-1."""
    rng = np.random.default_rng(seed)
    normal = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32), dtype)
    q, do = normal(b, tq, h, d), normal(b, tq, h, d)
    k, v = normal(b, tk, hkv, d), normal(b, tk, hkv, d)
    n, j, kk = striped or (1, 0, 0)
    q_pos = jnp.arange(tq, dtype=jnp.int32) * n + j
    k_pos = jnp.arange(tk, dtype=jnp.int32) * n + kk
    q_seg = k_seg = None
    if segments:  # packed documents in original order, ids read at each block's positions
        doc = np.cumsum(rng.random((b, n * max(tq, tk))) < 0.02, axis=1).astype(np.int32)
        q_seg, k_seg = jnp.asarray(doc[:, q_pos]), jnp.asarray(doc[:, k_pos])
    return dict(q=q, k=k, v=v, do=do, q_pos=q_pos, k_pos=k_pos, q_seg=q_seg, k_seg=k_seg)


def _blocks(x):
    return x["q_pos"], x["k_pos"], x["q_seg"], x["k_seg"]


@functools.partial(jax.jit, static_argnames=("causal",))
def _kernel_pass(x, o, lse, causal):
    """The kernel's forward, and its backward given the global (o, lse). Jitted once per
    shape so that tests sharing shapes share the (slow) interpret-mode compilation."""
    kw = dict(causal=causal, q_chunk=TILE, kv_chunk=TILE)
    o_k, lse_k = KERNEL.forward(x["q"], x["k"], x["v"], *_blocks(x), **kw)
    grads = KERNEL.backward(x["q"], x["k"], x["v"], o, lse, x["do"], *_blocks(x), **kw)
    return o_k, lse_k, grads


@functools.partial(jax.jit, static_argnames=("causal",))
def _blockwise_pass(x, causal):
    """The blockwise reference kernel: (o in the compute dtype, lse, grads)."""
    kw = dict(causal=causal, q_chunk=TILE, kv_chunk=TILE)
    o, lse = blockwise_forward(x["q"], x["k"], x["v"], *_blocks(x), **kw)
    o = o.astype(x["q"].dtype)  # the ring hands the backward o in the compute dtype
    return o, lse, blockwise_backward(x["q"], x["k"], x["v"], o, lse, x["do"], *_blocks(x), **kw)


@functools.partial(jax.jit, static_argnames=("causal", "self_attention"))
def _dense_pass(x, causal, self_attention):
    """Dense float32 attention with its VJP: (o, lse, grads). Uses lclm's `dense_attention`
    where the pair is one block attending to itself."""
    if self_attention:
        dense = lambda q, k, v: dense_attention(
            q, k, v, causal=causal, segment_ids=x["q_seg"], positions=x["q_pos"]
        )
    else:
        dense = lambda q, k, v: _pair_attention(q, k, v, *_blocks(x), causal)[0]
    f32 = lambda a: a.astype(jnp.float32)
    o, vjp = jax.vjp(dense, f32(x["q"]), f32(x["k"]), f32(x["v"]))
    lse = _pair_attention(x["q"], x["k"], x["v"], *_blocks(x), causal)[1]
    return o, lse, vjp(f32(x["do"]))


# Shapes of the striped case and the skipping test agree, so they share one compilation.
SHARED = dict(b=2, tq=3 * TILE, tk=3 * TILE, h=2, hkv=1, d=64, segments=True)
CASES = {
    # a striped round from a later device (k > j): strictly causal, query 0 sees nothing;
    # MQA (2 query heads), packed documents, two batch rows with different documents
    "striped_strict_mqa_segments_d64": dict(causal=True, striped=(4, 1, 3), **SHARED),
    # full attention, GQA (4 query heads on 2 kv heads), head dim 128, more keys than queries
    "full_gqa_d128_tk384": dict(causal=False, h=4, hkv=2, d=128, tk=384),
    # causal self-attention in bfloat16 (multi-head: one query head per kv head)
    "bf16_causal_mha_d128": dict(causal=True, h=2, hkv=2, d=128, dtype=jnp.bfloat16),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_blockwise_and_dense(name):
    opts = dict(CASES[name])
    causal = opts.pop("causal")
    x = _random_case(zlib.crc32(name.encode()), **opts)
    tol = 2e-2 if x["q"].dtype == jnp.bfloat16 else 1e-4
    self_attention = "striped" not in opts and "tk" not in opts
    o_bw, lse_bw, grads_bw = _blockwise_pass(x, causal)
    o, lse, grads = _kernel_pass(x, o_bw, lse_bw, causal)
    assert o.dtype == lse.dtype == jnp.float32
    assert all(g.dtype == jnp.float32 for g in grads)
    refs = {"blockwise": (o_bw, lse_bw, grads_bw), "dense": _dense_pass(x, causal, self_attention)}
    for ref, (o_ref, lse_ref, grads_ref) in refs.items():
        _close(o, o_ref, tol, f"o vs {ref}")
        _lse_close(lse, lse_ref, tol)
        for g, w, what in zip(grads, grads_ref, ("dq", "dk", "dv")):
            _close(g, w, tol, f"{what} vs {ref}")
    if "striped" in opts:  # query 0 sees nothing: zeros and -inf, no NaN
        assert np.all(np.asarray(o[:, 0]) == 0)
        assert np.all(np.isneginf(np.asarray(lse[:, 0])))
        assert np.all(np.asarray(grads[0][:, 0]) == 0)


def test_hidden_tiles_are_skipped_not_masked():
    """Tile 1 of Q, K and V is NaN and belongs to document 1; tiles 0 and 2 to document 0.

    A hidden tile that was computed and then masked would spread NaN (0 * NaN = NaN). Query
    tile 2 sees key tiles 0 and 2 only, with the poisoned tile 1 *between* them (it is
    fetched, so only the in-kernel `pl.when` can skip it); query tile 0 sees key tile 0 only
    (tiles 1-2 lie past its hull). Likewise for key tiles and poisoned query tile 1 in dK/dV.
    The backward gets the clean global o/lse, as the ring would.
    """
    x = _random_case(7, **SHARED)
    x["q_seg"] = x["k_seg"] = jnp.repeat(jnp.asarray([[0, 1, 0]] * 2, jnp.int32), TILE, axis=1)
    o_ref, lse_ref, grads_ref = _blockwise_pass(x, True)
    hidden = slice(TILE, 2 * TILE)
    poisoned = dict(x, **{n: x[n].at[:, hidden].set(jnp.nan) for n in ("q", "k", "v")})
    o, lse, grads = _kernel_pass(poisoned, o_ref, lse_ref, True)

    clean = np.r_[0:TILE, 2 * TILE : 3 * TILE]
    for g, w, what in zip(
        (o, lse, *grads), (o_ref, lse_ref, *grads_ref), ("o", "lse", "dq", "dk", "dv")
    ):
        _close(g[:, clean], w[:, clean], what=what)
        # the poison really reaches the rows / keys that see it
        assert np.isnan(np.asarray(g[:, hidden])).all(), what


def test_tile_tables_and_hulls():
    """Per-tile ranges and the visible hulls that the index maps clamp into."""
    t = 3 * TILE
    pos = jnp.arange(t, dtype=jnp.int32)
    seg = jnp.repeat(jnp.asarray([[0, 1, 0]], jnp.int32), TILE, axis=1)
    cfg = lambda causal, segments: _Cfg(
        1, 1, 1, t, t, 64, TILE, TILE, causal, segments, compiled=False
    )
    qt, kt, hull_kv, hull_q = _tables(cfg(True, False), pos, pos, None, None)
    np.testing.assert_array_equal(
        np.asarray(qt).reshape(3, 4)[:, :2], [[0, 127], [128, 255], [256, 383]]
    )
    np.testing.assert_array_equal(np.asarray(hull_kv).reshape(3, 2), [[0, 0], [0, 1], [0, 2]])
    np.testing.assert_array_equal(np.asarray(hull_q).reshape(3, 2), [[0, 2], [1, 2], [2, 2]])
    _, _, hull_kv, hull_q = _tables(cfg(False, True), pos, pos, seg, seg)
    np.testing.assert_array_equal(np.asarray(hull_kv).reshape(3, 2), [[0, 2], [1, 1], [0, 2]])
    # strictly causal striped round: query tile 0 still sees key tile 0 (x > y holds inside)
    _, _, hull_kv, _ = _tables(cfg(True, False), pos * 4 + 1, pos * 4 + 3, None, None)
    np.testing.assert_array_equal(np.asarray(hull_kv).reshape(3, 2), [[0, 0], [0, 1], [0, 2]])


def test_registered_under_pallas_tpu():
    assert get_kernel("pallas_tpu") is KERNEL


def test_interpreted_tiles_are_the_chunks_clipped_to_the_block():
    q, k = jnp.zeros((1, 256, 4, 64)), jnp.zeros((1, 384, 2, 64))
    cfg = _config(q, k, None, True, q_chunk=1024, kv_chunk=128, platform="cpu")
    assert (cfg.qc, cfg.kc, cfg.nq, cfg.nk, cfg.group) == (256, 128, 1, 3, 2)
    assert not cfg.compiled
    with pytest.raises(ValueError, match="not divisible"):
        _config(q, k, None, True, q_chunk=96, kv_chunk=128, platform="cpu")


def test_compiled_tiles_follow_the_tpu_generation_not_the_chunks():
    q, k = jnp.zeros((1, 8192, 1, 64)), jnp.zeros((1, 1536, 1, 64))
    for kind, (qc, kc) in [
        ("TPU v4", (1024, 512)),
        ("TPU v6 lite", (2048, 512)),
        ("TPU v7 unknown", (1024, 512)),
        (None, (1024, 512)),
    ]:
        cfg = _config(q, k, None, True, q_chunk=64, kv_chunk=8192, platform="tpu", device_kind=kind)
        assert cfg.compiled and (cfg.qc, cfg.kc) == (qc, kc), kind
    assert tpu_tiles("TPU v6 lite") == (2048, 1024) and tpu_tiles("TPU v4") == (1024, 1024)
    # the whole block when it fits, else a power-of-two divisor that is a multiple of 128
    assert [_tile(n, 1024) for n in (96, 1000, 8192, 1536, 1152, 1088)] == [
        96,
        1000,
        1024,
        512,
        128,
        None,
    ]
    with pytest.raises(ValueError, match="multiples of 128"):
        _config(jnp.zeros((1, 1088, 1, 64)), k, None, True, 64, 64, platform="tpu")


@pytest.mark.parametrize(
    "shape,why",
    [
        (dict(head_dim=64, block=65536), None),
        (dict(head_dim=128, block=640), None),
        (dict(head_dim=96, block=4096), "power of two"),
        (dict(head_dim=256, block=4096), "up to 128"),
        (dict(head_dim=64, block=1088), "multiple of 128"),
    ],
)
def test_limits_on_a_tpu(shape, why):
    got = limits(q_chunk=2048, kv_chunk=2048, platform="tpu", **shape)
    assert got is None if why is None else why in got


@pytest.mark.parametrize(
    "dtype,causal,segments,hkv,d",
    [(jnp.bfloat16, True, True, 2, 128), (jnp.float32, False, False, 1, 64)],
)
def test_lowers_to_mosaic_for_tpu(dtype, causal, segments, hkv, d):
    """Without a TPU, export for the TPU platform: the Pallas -> Mosaic lowering (block shape
    rules, scalar prefetch, every op in the kernels) must accept all three kernels. The
    Mosaic compiler itself (in libtpu) is not run here. `platform='tpu'` (what the ring passes
    for a mesh of TPU devices) compiles them although JAX's default backend is the CPU."""
    b, t, h = 2, 512, 4
    x = jax.ShapeDtypeStruct((b, t, h, d), dtype)
    kv = jax.ShapeDtypeStruct((b, t, hkv, d), dtype)
    pos = jax.ShapeDtypeStruct((t,), jnp.int32)
    seg = jax.ShapeDtypeStruct((b, t), jnp.int32) if segments else None
    kw = dict(causal=causal, q_chunk=TILE, kv_chunk=2 * TILE, platform="tpu")

    def both_passes(q, k, v, do, pos, seg):
        o, lse = KERNEL.forward(q, k, v, pos, pos, seg, seg, **kw)
        return KERNEL.backward(q, k, v, o.astype(q.dtype), lse, do, pos, pos, seg, seg, **kw)

    exported = jax.export.export(jax.jit(both_passes), platforms=["tpu"])(x, kv, kv, x, pos, seg)
    assert exported.mlir_module().count("tpu_custom_call") == 3

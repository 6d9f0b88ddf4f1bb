"""Ring attention (all three layouts, sp 1-8, GQA, segments) against a dense float32 reference."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lclm.ops import from_layout, local_attention, ring_attention, stripe, to_layout, unstripe
from lclm.ops.context_parallel.ring import tile_schedule
from lclm.ops.kernels.reference import dense_attention
from lclm.ops.layout import LAYOUTS, original_positions
from lclm.parallel import make_mesh


def _inputs(seed, b=2, t=64, h=4, hkv=2, d=16, segments=False):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, t, h, d), np.float32)
    k = rng.standard_normal((b, t, hkv, d), np.float32)
    v = rng.standard_normal((b, t, hkv, d), np.float32)
    do = rng.standard_normal((b, t, h, d), np.float32)
    seg = None
    if segments:  # packed documents of random lengths: ids non-decreasing along each row
        seg = np.cumsum(rng.random((b, t)) < 0.08, axis=1).astype(np.int32)
    return q, k, v, do, seg


def _reference(q, k, v, do, seg):
    def f(q, k, v):
        return dense_attention(q, k, v, causal=True, segment_ids=seg)

    out, vjp = jax.vjp(f, q, k, v)
    return (out, *vjp(do))


def _close(got, want, tol=1e-4):
    got, want = np.asarray(got), np.asarray(want)
    err = np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-12)
    assert err < tol, f"relative error {err:.2e}"


# the fused GPU kernel runs here in Pallas interpret mode: same kernel code, CPU semantics
IMPLS = ["blockwise", "pallas_gpu"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "sp,chunk,hkv,segments",
    [
        (1, 16, 2, False),
        (2, 8, 4, True),
        (4, 4, 1, False),
        (4, 16, 2, True),
        (8, 8, 2, True),
    ],
)
def test_ring_matches_dense(impl, layout, sp, chunk, hkv, segments):
    seed = zlib.crc32(repr((impl, layout, sp, chunk, hkv, segments)).encode())
    q, k, v, do, seg = _inputs(seed, hkv=hkv, segments=segments)
    want = _reference(q, k, v, do, seg)
    mesh = make_mesh(sp=sp, fsdp=2 if sp <= 4 else 1)
    lay = lambda x: None if x is None else to_layout(jnp.asarray(x), layout, sp)
    unlay = lambda x: from_layout(x, layout, sp)

    def f(q, k, v):
        return ring_attention(
            q,
            k,
            v,
            mesh=mesh,
            layout=layout,
            segment_ids=lay(seg),
            q_chunk=chunk,
            kv_chunk=chunk,
            impl=impl,
        )

    out, vjp = jax.vjp(jax.jit(f), lay(q), lay(k), lay(v))
    grads = vjp(lay(do))
    for g, w in zip((out, *grads), want):
        _close(unlay(g), w)


@pytest.mark.parametrize("impl", IMPLS)
def test_ring_with_tensor_parallel_heads_and_mqa(impl):
    q, k, v, do, seg = _inputs(3, h=4, hkv=1, segments=True)
    want = _reference(q, k, v, do, seg)
    mesh = make_mesh(tp=2, sp=4)

    def f(q, k, v):
        return ring_attention(
            q,
            k,
            v,
            mesh=mesh,
            segment_ids=stripe(jnp.asarray(seg), 4),
            q_chunk=8,
            kv_chunk=4,
            impl=impl,
        )

    out, vjp = jax.vjp(jax.jit(f), *(stripe(jnp.asarray(x), 4) for x in (q, k, v)))
    for g, w in zip((out, *vjp(stripe(jnp.asarray(do), 4))), want):
        _close(unstripe(g, 4), w)


def test_local_attention_bf16_inputs_keep_float32_statistics():
    q, k, v, do, _ = _inputs(5, t=128)
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)
    out = local_attention(bf(q), bf(k), bf(v), q_chunk=32, kv_chunk=32)
    assert out.dtype == jnp.bfloat16
    _close(out.astype(jnp.float32), dense_attention(q, k, v), tol=2e-2)


def test_stripe_roundtrip_and_device_assignment():
    x = np.arange(2 * 24).reshape(2, 24)
    s = stripe(x, 4)
    # device j holds positions j, j+4, j+8, ... as its contiguous shard
    np.testing.assert_array_equal(s[0, :6], [0, 4, 8, 12, 16, 20])
    np.testing.assert_array_equal(s[0, 6:12], [1, 5, 9, 13, 17, 21])
    np.testing.assert_array_equal(unstripe(s, 4), x)
    np.testing.assert_array_equal(unstripe(stripe(jnp.asarray(x), 4), 4), x)


def test_zigzag_roundtrip_and_device_assignment():
    n, t = 4, 32
    x = np.arange(2 * t).reshape(2, t)
    z = to_layout(x, "zigzag", n)
    # device j holds chunks j and 2n-1-j of 2n chunks (of 4 positions each), in that order
    np.testing.assert_array_equal(z[0, :8], [0, 1, 2, 3, 28, 29, 30, 31])
    np.testing.assert_array_equal(z[0, 24:], [12, 13, 14, 15, 16, 17, 18, 19])
    np.testing.assert_array_equal(from_layout(z, "zigzag", n), x)
    back = from_layout(to_layout(jnp.asarray(x), "zigzag", n), "zigzag", n)
    np.testing.assert_array_equal(back, x)
    for j in range(n):  # the positions the ring derives are the ones the layout put there
        np.testing.assert_array_equal(
            original_positions("zigzag", n, j, t // n), z[0, j * 8 : (j + 1) * 8]
        )
    with pytest.raises(ValueError, match="2 x the sp size"):
        to_layout(np.arange(12)[None], "zigzag", 4)


def test_zigzag_rounds_are_half_a_block_pair_of_full_tiles():
    """Every round but the diagonal one is exactly half the block pair, on every device, as
    whole tiles (none partly masked); the diagonal round is the causal half."""
    n, t, c = 4, 256, 8
    local = t // n
    tiles = (local // c) ** 2
    zigzag = tile_schedule("zigzag", n, t, c, c) / tiles
    np.testing.assert_allclose(zigzag[1:], 0.5)
    per_half = local // 2 // c
    diagonal = (2 * per_half * (per_half + 1) / 2 + per_half**2) / tiles
    np.testing.assert_allclose(zigzag[0], diagonal)
    for r in range(1, n):  # no visible tile straddles the mask
        for j in range(n):
            q = original_positions("zigzag", n, j, local).reshape(-1, c)
            k = original_positions("zigzag", n, (j - r) % n, local).reshape(-1, c)
            for a in q:
                for b in k:
                    seen = a[:, None] >= b[None, :]
                    assert seen.all() or not seen.any()


def test_tile_schedule_matches_paper_workload():
    n, t, c = 4, 256, 8
    tiles = (t // n // c) ** 2
    striped = tile_schedule("striped", n, t, c, c) / tiles
    contiguous = tile_schedule("contiguous", n, t, c, c) / tiles
    # striped: every device does about half the block in every round (diagonal tiles included)
    half = (t // n // c + 1) / 2 / (t // n // c)
    np.testing.assert_allclose(striped, half)
    # contiguous: round 0 is causal (about half); later rounds are all (k < j) or nothing
    np.testing.assert_allclose(contiguous[0], half)
    for r in range(1, n):
        for j in range(n):
            assert contiguous[r, j] == (1.0 if (j - r) % n < j else 0.0)
    # a round lasts as long as its busiest device: striped finishes in about half the time
    assert striped.max(axis=1).sum() == pytest.approx(n * half)
    assert contiguous.max(axis=1).sum() == pytest.approx(half + (n - 1))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "layout,sp", [("contiguous", 1), ("striped", 2), ("contiguous", 2), ("zigzag", 2)]
)
def test_hidden_tiles_are_skipped_not_masked(impl, layout, sp):
    """NaN keys/values in the last 16 positions: a computed-then-masked tile would spread
    NaN (NaN + -inf = NaN) into every query of that tile; skipped tiles keep earlier queries
    exact, in the output and in dq. (dK/dV of clean keys legitimately receive 0 * NaN from the
    poisoned query rows, so they are not a skipping signal.)"""
    q, k, v, do, _ = _inputs(21, t=64)
    poison = lambda x: np.concatenate([x[:, :48], np.full_like(x[:, 48:], np.nan)], axis=1)
    mesh = make_mesh(sp=sp)
    lay = lambda x: to_layout(jnp.asarray(x), layout, sp)

    def f(q, k, v):
        return ring_attention(q, k, v, mesh=mesh, layout=layout, q_chunk=8, kv_chunk=8, impl=impl)

    out, vjp = jax.vjp(jax.jit(f), lay(q), lay(poison(k)), lay(poison(v)))
    do_clean = np.concatenate([do[:, :48], np.zeros_like(do[:, 48:])], axis=1)
    dq, dk, dv = (from_layout(g, layout, sp) for g in vjp(lay(do_clean)))
    out = from_layout(out, layout, sp)
    want = _reference(q[:, :48], k[:, :48], v[:, :48], do[:, :48], None)
    _close(out[:, :48], want[0])
    assert np.isnan(np.asarray(out[:, 48:])).all()  # the poisoned keys really are visible there
    _close(dq[:, :48], want[1])


def test_kv_travel_in_the_compute_dtype():
    """K/V (and segment ids) cross the ring in bf16/int32 as the program states it (StableHLO,
    before any backend's own type normalisation); only the dK/dV accumulators travel in
    float32 (anchors.md pitfalls 2 and 3)."""
    import re

    mesh = make_mesh(sp=4)
    q = jnp.ones((2, 64, 4, 16), jnp.bfloat16)
    k = jnp.ones((2, 64, 2, 16), jnp.bfloat16)
    seg = jnp.ones((2, 64), jnp.int32)
    ring = lambda q, k, v: ring_attention(
        q, k, v, mesh=mesh, segment_ids=seg, q_chunk=8, kv_chunk=8
    )
    permuted = lambda fn: re.findall(
        r"collective_permute.*?-> tensor<([^>]*)>", jax.jit(fn).lower(q, k, k).as_text()
    )
    forward = permuted(ring)
    assert forward and {t.split("x")[-1] for t in forward} == {"bf16", "i32"}
    backward = permuted(jax.grad(lambda *a: ring(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
    assert {t.split("x")[-1] for t in backward} == {"bf16", "i32", "f32"}  # + dK/dV in f32


def test_blockwise_ring_has_no_conditional_per_tile():
    """Hidden tiles are skipped by loop bounds: the compiled ring (forward and backward, with
    segments) holds no `conditional` (on a GPU each would read its predicate on the host)."""
    q, k, v, do, seg = _inputs(4, segments=True)
    mesh = make_mesh(sp=4)
    lay = lambda x: to_layout(jnp.asarray(x), "striped", 4)

    def loss(q, k, v):
        o = ring_attention(
            q, k, v, mesh=mesh, segment_ids=lay(seg), q_chunk=4, kv_chunk=4, impl="blockwise"
        )
        return jnp.sum(o * lay(do))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    hlo = grad.lower(lay(q), lay(k), lay(v)).compile().as_text()
    assert hlo.count(" while(") >= 2  # the tile loops are there ...
    assert " conditional(" not in hlo  # ... and nothing branches per tile

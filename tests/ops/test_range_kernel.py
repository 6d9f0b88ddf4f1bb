"""The range-mask kernel adapter (what `impl='tokamax_gpu'` runs on a GPU) on the CPU: the
ring through `range_kernel` fed a dense float32 range-mask attention equals dense attention
for all layouts, segments and GQA, and every ring round of lclm's layouts gets a class whose
call does exactly that round's work. tokamax's own kernels need a Hopper GPU
(`python -m bench.correctness` checks them there)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lclm.ops import attention, from_layout, ring_attention, to_layout
from lclm.ops.attention import dense_attention
from lclm.ops.layout import LAYOUTS, original_positions
from lclm.ops.range_kernel import CLASSES, range_kernel, round_class
from lclm.parallel import make_mesh

F32 = jnp.float32


def _mask(tq, tk, causal, start, end):
    """`[b or 1, tq, tk]` visibility of a range mask, as tokamax defines it."""
    q, k = jnp.arange(tq)[:, None], jnp.arange(tk)[None, :]
    mask = (k <= q)[None] if causal else jnp.ones((1, tq, tk), bool)
    if start is not None:
        mask = mask & (k[None] >= start[..., None])
    if end is not None:
        mask = mask & (k[None] < end[..., None])
    return mask


def _scores(q, k, mask):
    rep = q.shape[2] // k.shape[2]
    k = jnp.repeat(k.astype(F32), rep, axis=2)
    s = jnp.einsum("bqhd,bkhd->bqhk", q.astype(F32), k) * q.shape[-1] ** -0.5
    return jnp.where(mask[:, :, None, :], s, -jnp.inf)


def ref_attend(q, k, v, causal, start, end):
    """Dense float32 attention under a range mask: (o, lse) as tokamax's forward gives them,
    masking with a finite minimum, so a row that sees nothing gets the mean of v and a finite
    lse (which `range_kernel` must replace by 0 and -inf)."""
    mask = _mask(q.shape[1], k.shape[1], causal, start, end)
    s = jnp.where(jnp.isfinite(_scores(q, k, mask)), _scores(q, k, mask), jnp.finfo(F32).min)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - lse[..., None])
    v = jnp.repeat(v.astype(F32), q.shape[2] // v.shape[2], axis=2)
    return jnp.einsum("bqhk,bkhd->bqhd", p, v), lse


def ref_attend_vjp(q, k, v, o, lse, do, causal, start, end):
    """Gradients from the given (global) o and lse, as tokamax's VJP op computes them."""
    rep, hkv = q.shape[2] // k.shape[2], k.shape[2]
    mask = _mask(q.shape[1], k.shape[1], causal, start, end)
    s = _scores(q, k, mask)
    p = jnp.exp(s - lse[..., None])                        # 0 where masked
    kr, vr = (jnp.repeat(x.astype(F32), rep, axis=2) for x in (k, v))
    do, o = do.astype(F32), o.astype(F32)
    delta = jnp.sum(do * o, axis=-1)
    dv = jnp.einsum("bqhk,bqhd->bkhd", p, do)
    ds = p * (jnp.einsum("bqhd,bkhd->bqhk", do, vr) - delta[..., None])
    scale = q.shape[-1] ** -0.5
    dq = jnp.einsum("bqhk,bkhd->bqhd", ds, kr) * scale
    dk = jnp.einsum("bqhk,bqhd->bkhd", ds, q.astype(F32)) * scale
    group = lambda g: g.reshape(g.shape[:2] + (hkv, rep, g.shape[-1])).sum(3)
    return dq, group(dk), group(dv)


@pytest.fixture
def reference_kernel(monkeypatch):
    monkeypatch.setitem(attention.KERNELS, "range_reference",
                        range_kernel(ref_attend, ref_attend_vjp))
    return "range_reference"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("sp,hkv,segments", [(1, 2, True), (2, 4, False), (4, 1, True),
                                             (8, 2, True)])
def test_ring_through_the_range_kernel_matches_dense(reference_kernel, layout, sp, hkv,
                                                     segments):
    rng = np.random.default_rng(sp * 10 + hkv)
    b, t, h, d = 2, 64, 4, 16
    q = rng.standard_normal((b, t, h, d), np.float32)
    k, v = (rng.standard_normal((b, t, hkv, d), np.float32) for _ in range(2))
    do = rng.standard_normal((b, t, h, d), np.float32)
    seg = np.cumsum(rng.random((b, t)) < 0.08, axis=1).astype(np.int32) if segments else None
    want, vjp = jax.vjp(lambda q, k, v: dense_attention(q, k, v, segment_ids=seg), q, k, v)
    want = (want, *vjp(do))
    mesh = make_mesh(sp=sp, fsdp=2 if sp <= 4 else 1)
    lay = lambda x: None if x is None else to_layout(jnp.asarray(x), layout, sp)

    def f(q, k, v):
        return ring_attention(q, k, v, mesh=mesh, layout=layout, segment_ids=lay(seg),
                              impl=reference_kernel)

    out, vjp = jax.vjp(jax.jit(f), lay(q), lay(k), lay(v))
    for got, w in zip((out, *vjp(lay(do))), want):
        got = np.asarray(from_layout(got, layout, sp))
        err = np.max(np.abs(got - np.asarray(w))) / np.max(np.abs(np.asarray(w)))
        assert err < 1e-5, err


@pytest.mark.parametrize("layout,expected", [
    ("striped", {"causal", "strict"}),
    ("contiguous", {"causal", "full", "hidden"}),
    ("zigzag", {"causal", "key half", "query half"}),
])
def test_every_ring_round_gets_a_class_that_does_exactly_its_work(layout, expected):
    n, local = 4, 16
    seen = set()
    for device in range(n):
        for source in range(n):
            q_pos = jnp.asarray(original_positions(layout, n, device, local))
            k_pos = jnp.asarray(original_positions(layout, n, source, local))
            seen.add(CLASSES[int(round_class(q_pos, k_pos))])
    assert seen == expected  # never the 'ranges' fallback, which skips no backward tiles


def test_non_causal_attention_uses_exact_ranges():
    pos = jnp.arange(8)
    assert CLASSES[int(round_class(pos, pos, causal=False))] == "ranges"
    assert CLASSES[int(round_class(pos, pos + 100))] == "hidden"


def test_tokamax_adapter_imports_here_and_is_never_picked_off_gpu(monkeypatch):
    from lclm.ops import tokamax_gpu
    monkeypatch.setattr(attention, "hopper_or_newer", lambda: True)

    assert attention.get_kernel("tokamax_gpu") is tokamax_gpu.KERNEL
    shapes = dict(head_dim=128, q_chunk=512, kv_chunk=512, block=8192)
    assert "GPUs only" in attention.kernel_limits("tokamax_gpu", platform="cpu", **shapes)
    assert attention.choose_kernel("auto", platform="cpu", **shapes) == "blockwise"
    expected = "tokamax_gpu" if tokamax_gpu.available() else "pallas_gpu"
    assert attention.choose_kernel("auto", platform="gpu", **shapes) == expected


@pytest.mark.parametrize("case", ["causal", "strict", "full", "key half", "query half",
                                  "segments", "gqa"])
def test_tokamax_adapter_against_dense_with_tokamaxs_xla_reference_ops(monkeypatch, case):
    """`lclm.ops.tokamax_gpu`'s calls (Mask with ranges, residuals, bind kwargs, the VJP's
    dict) run here against tokamax's own XLA reference ops, which share the Mosaic ops'
    signatures; one block pair, so its own lse is the global one (the reference VJP
    recomputes the softmax instead of reading the residuals)."""
    pytest.importorskip("tokamax", reason="tokamax needs Python >= 3.12 (the [cuda] extra)")
    from tokamax._src.ops.attention import base

    from lclm.ops import tokamax_gpu
    monkeypatch.setattr(tokamax_gpu, "_ops", lambda: (base.DotProductAttention(),
                                                      base.DotProductAttentionVjp(), base.Mask))
    kernel = range_kernel(tokamax_gpu.attend, tokamax_gpu.attend_vjp)
    t, n = 32, 4
    pairs = {"causal": (0, 0), "strict": (1, 3), "full": (3, 1), "key half": (3, 1),
             "query half": (1, 3), "segments": (2, 1), "gqa": (2, 2)}
    layout = {"full": "contiguous", "key half": "zigzag", "query half": "zigzag"}.get(case,
                                                                                     "striped")
    device, source = pairs[case]
    q_pos = jnp.asarray(original_positions(layout, n, device, t))
    k_pos = jnp.asarray(original_positions(layout, n, source, t))
    assert CLASSES[int(round_class(q_pos, k_pos))] == {"segments": "causal", "gqa": "causal"}.get(
        case, case)
    rng = np.random.default_rng(len(case))
    hkv = 1 if case == "gqa" else 4
    q, do = (jnp.asarray(rng.standard_normal((2, t, 4, 16)), jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((2, t, hkv, 16)), jnp.float32) for _ in range(2))
    seg = (jnp.asarray(np.cumsum(rng.random((2, t)) < 0.2, axis=1), jnp.int32)
           if case == "segments" else None)
    tiles = dict(causal=True, q_chunk=t, kv_chunk=t)
    o, lse = kernel.forward(q, k, v, q_pos, k_pos, seg, seg, **tiles)
    grads = kernel.backward(q, k, v, o, lse, do, q_pos, k_pos, seg, seg, **tiles)
    mask = (q_pos[:, None] >= k_pos[None, :])[None]
    if seg is not None:
        mask = mask & (seg[:, :, None] == seg[:, None, :])

    def dense(q, k, v):  # the reference with the same mask, as a boolean matrix
        s = _scores(q, k, jnp.broadcast_to(mask, (2, t, t)))
        lse = jax.nn.logsumexp(s, axis=-1)
        p = jnp.where(jnp.isfinite(lse)[..., None], jnp.exp(s - lse[..., None]), 0.0)
        return jnp.einsum("bqhk,bkhd->bqhd", p, jnp.repeat(v, 4 // hkv, axis=2)), lse

    (want_o, want_lse), vjp = jax.vjp(dense, q, k, v)
    want_grads = vjp((do, jnp.zeros_like(want_lse)))
    np.testing.assert_allclose(np.asarray(o), np.asarray(want_o), atol=2e-5)
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(want_lse))
    finite = np.isfinite(np.asarray(want_lse))
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(want_lse)[finite], atol=2e-5)
    for g, w in zip(grads, want_grads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=5e-5)

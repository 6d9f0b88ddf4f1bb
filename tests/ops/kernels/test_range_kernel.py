"""The range-mask kernel adapter (what `impl='tokamax_gpu'` runs on a GPU) on the CPU: the
ring through `range_kernel` fed a dense float32 range-mask attention equals dense attention
for all layouts, segments and GQA, and every ring round of lclm's layouts gets a class whose
call does exactly that round's work. tokamax's own kernels need a Hopper GPU
(`python -m bench.correctness` checks them there)."""

from types import SimpleNamespace
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lclm.ops import from_layout, kernels, local_attention, ring_attention, to_layout
from lclm.ops.context_parallel.rounds import _site_classes, make_settings, passing_sites
from lclm.ops.kernels.range_kernel import CLASSES, pair_class, range_kernel, round_class
from lclm.ops.kernels.reference import dense_attention
from lclm.ops.layout import LAYOUTS, original_positions
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
    p = jnp.exp(s - lse[..., None])  # 0 where masked
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
    monkeypatch.setitem(
        kernels.KERNELS, "range_reference", range_kernel(ref_attend, ref_attend_vjp)
    )
    return "range_reference"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "sp,hkv,segments,causal",
    [
        (1, 2, True, True),
        (2, 4, False, True),
        (4, 1, True, True),
        (8, 2, True, True),
        (2, 2, False, False),
    ],
)  # non-causal, no segments: no ranges passed
def test_ring_through_the_range_kernel_matches_dense(
    reference_kernel, layout, sp, hkv, segments, causal
):
    rng = np.random.default_rng(sp * 10 + hkv)
    b, t, h, d = 2, 64, 4, 16
    q = rng.standard_normal((b, t, h, d), np.float32)
    k, v = (rng.standard_normal((b, t, hkv, d), np.float32) for _ in range(2))
    do = rng.standard_normal((b, t, h, d), np.float32)
    seg = np.cumsum(rng.random((b, t)) < 0.08, axis=1).astype(np.int32) if segments else None
    _assert_ring_equals_dense(reference_kernel, layout, sp, causal, seg, q, k, v, do)


def _assert_ring_equals_dense(impl, layout, sp, causal, seg, q, k, v, do):
    """The ring through kernel `impl` on sp devices: output and gradients within 1e-5
    (relative to the largest value) of dense float32 attention."""
    want, vjp = jax.vjp(
        lambda q, k, v: dense_attention(q, k, v, causal=causal, segment_ids=seg), q, k, v
    )
    want = (want, *vjp(do))
    mesh = make_mesh(sp=sp, fsdp=2 if sp <= 4 else 1)
    lay = lambda x: None if x is None else to_layout(jnp.asarray(x), layout, sp)

    def f(q, k, v):
        return ring_attention(
            q, k, v, mesh=mesh, layout=layout, causal=causal, segment_ids=lay(seg), impl=impl
        )

    out, vjp = jax.vjp(jax.jit(f), lay(q), lay(k), lay(v))
    for got, w in zip((out, *vjp(lay(do))), want):
        got = np.asarray(from_layout(got, layout, sp))
        err = np.max(np.abs(got - np.asarray(w))) / np.max(np.abs(np.asarray(w)))
        assert err < 1e-5, err


@pytest.mark.parametrize(
    "layout,expected",
    [
        ("striped", {"causal", "strict"}),
        ("contiguous", {"causal", "full", "hidden"}),
        ("zigzag", {"causal", "key half", "query half"}),
    ],
)
def test_every_ring_round_gets_a_class_that_does_exactly_its_work(layout, expected):
    n, local = 4, 16
    seen = set()
    for device in range(n):
        for source in range(n):
            q_pos = jnp.asarray(original_positions(layout, n, device, local))
            k_pos = jnp.asarray(original_positions(layout, n, source, local))
            seen.add(CLASSES[int(round_class(q_pos, k_pos))])
            assert pair_class(q_pos, k_pos) == CLASSES[int(round_class(q_pos, k_pos))]
    assert seen == expected  # never the 'ranges' fallback, which skips no backward tiles


def test_non_causal_attention_uses_exact_ranges():
    pos = jnp.arange(8)
    assert CLASSES[int(round_class(pos, pos, causal=False))] == "ranges"
    assert CLASSES[int(round_class(pos, pos + 100))] == "hidden"


def test_tokamax_adapter_imports_here_and_is_never_picked_off_gpu(monkeypatch):
    from lclm.ops.kernels import tokamax_gpu

    monkeypatch.setattr(tokamax_gpu, "hopper_or_newer", lambda: True)

    assert kernels.get_kernel("tokamax_gpu") is tokamax_gpu.KERNEL
    shapes = dict(head_dim=128, q_chunk=512, kv_chunk=512, block=8192)
    assert "GPUs only" in kernels.get_kernel("tokamax_gpu").limits(platform="cpu", **shapes)
    assert kernels.choose_kernel("auto", platform="cpu", **shapes) == "blockwise"
    expected = "cudnn_gpu" if tokamax_gpu.available() else "pallas_gpu"
    assert kernels.choose_kernel("auto", platform="gpu", **shapes) == expected


@pytest.mark.parametrize(
    "case", ["causal", "strict", "full", "key half", "query half", "segments", "gqa"]
)
def test_tokamax_adapter_against_dense_with_tokamaxs_xla_reference_ops(monkeypatch, case):
    """`lclm.ops.kernels.tokamax_gpu`'s calls (Mask with ranges, residuals, bind kwargs, the VJP's
    dict) run here against tokamax's own XLA reference ops, which share the Mosaic ops'
    signatures; one block pair, so its own lse is the global one (the reference VJP
    recomputes the softmax instead of reading the residuals)."""
    pytest.importorskip("tokamax", reason="tokamax needs Python >= 3.12 (the [cuda] extra)")
    from tokamax._src.ops.attention import base

    from lclm.ops.kernels import tokamax_gpu

    monkeypatch.setattr(
        tokamax_gpu,
        "_ops",
        lambda: (base.DotProductAttention(), base.DotProductAttentionVjp(), base.Mask),
    )
    kernel = range_kernel(tokamax_gpu.attend, tokamax_gpu.attend_vjp)
    t, n = 32, 4
    pairs = {
        "causal": (0, 0),
        "strict": (1, 3),
        "full": (3, 1),
        "key half": (3, 1),
        "query half": (1, 3),
        "segments": (2, 1),
        "gqa": (2, 2),
    }
    layout = {"full": "contiguous", "key half": "zigzag", "query half": "zigzag"}.get(
        case, "striped"
    )
    device, source = pairs[case]
    q_pos = jnp.asarray(original_positions(layout, n, device, t))
    k_pos = jnp.asarray(original_positions(layout, n, source, t))
    assert CLASSES[int(round_class(q_pos, k_pos))] == {"segments": "causal", "gqa": "causal"}.get(
        case, case
    )
    rng = np.random.default_rng(len(case))
    hkv = 1 if case == "gqa" else 4
    q, do = (jnp.asarray(rng.standard_normal((2, t, 4, 16)), jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((2, t, hkv, 16)), jnp.float32) for _ in range(2))
    seg = (
        jnp.asarray(np.cumsum(rng.random((2, t)) < 0.2, axis=1), jnp.int32)
        if case == "segments"
        else None
    )
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


def _counting(calls: list):
    """A range kernel over `ref_attend` that records every call (at trace time): ('attend' or
    'vjp', causal, k_start, k_end)."""

    def attend(q, k, v, causal, start, end):
        calls.append(("attend", causal, start, end))
        return ref_attend(q, k, v, causal, start, end)

    def attend_vjp(q, k, v, o, lse, do, causal, start, end):
        calls.append(("vjp", causal, start, end))
        return ref_attend_vjp(q, k, v, o, lse, do, causal, start, end)

    return range_kernel(attend, attend_vjp)


# (sp, layout, causal) -> conditionals and attend calls of the forward program (the
# backward's are the same, with attend_vjp). sp=4, striped: two call sites, the scanned
# rounds 0..2 and the last round, each a switch over causal/strict (2 + 2 calls); contiguous
# and zigzag: the diagonal round on its own (causal, no switch: 1 call), then the scanned
# rounds 1..2 and the last round, switches over full/hidden (1 + 1: hidden calls nothing) or
# the two halves (2 + 2); non-causal rounds are all 'ranges' (1 + 1, no switch). Before: 1
# (sp=1) or 2 switches of 6 calls each, whatever the layout.
EXPECTED_PROGRAM = {
    (1, "striped", True): (0, 1),
    (4, "striped", True): (2, 4),
    (4, "contiguous", True): (2, 3),
    (4, "zigzag", True): (2, 5),
    (4, "striped", False): (0, 2),
}


@pytest.mark.parametrize("sp,layout,causal", list(EXPECTED_PROGRAM))
def test_one_compiled_branch_where_the_class_is_known(monkeypatch, sp, layout, causal):
    calls = []
    monkeypatch.setitem(kernels.KERNELS, "counting", _counting(calls))
    q = jnp.zeros((2, 64, 4, 16))
    k = jnp.zeros((2, 64, 2, 16))
    seg = jnp.zeros((2, 64), jnp.int32)
    mesh = make_mesh(sp=sp)
    f = lambda q, k, v: ring_attention(
        q, k, v, mesh=mesh, layout=layout, causal=causal, segment_ids=seg, impl="counting"
    )
    forward = jax.jit(f).lower(q, k, k).as_text()
    conditionals, attends = EXPECTED_PROGRAM[sp, layout, causal]
    assert (forward.count("stablehlo.case"), len(calls)) == (conditionals, attends)
    calls.clear()
    grad = jax.jit(jax.grad(lambda *x: f(*x).sum(), argnums=(0, 1, 2))).lower(q, k, k)
    assert grad.as_text().count("stablehlo.case") == 2 * conditionals
    assert [c[0] for c in calls].count("vjp") == attends
    if sp == 1:  # local attention is the ring of one: one call, no conditional
        calls.clear()
        local = jax.jit(lambda q, k, v: local_attention(q, k, v, impl="counting"))
        assert "stablehlo.case" not in local.lower(q, k, k).as_text() and len(calls) == 1


@pytest.mark.parametrize(
    "layout,want",
    [
        ("striped", [{"causal", "strict"}]),
        ("contiguous", [{"causal"}, {"full", "hidden"}]),
        ("zigzag", [{"causal"}, {"key half", "query half"}]),
    ],
)
def test_the_diagonal_round_leaves_the_scanned_switch_where_only_it_has_its_class(
    reference_kernel, layout, want
):
    """The call sites of the rounds before the last at sp=4 and the classes each compiles;
    a kernel that does not specialize on classes keeps one site."""
    s = make_settings(
        4, layout, True, 8, 8, reference_kernel, jnp.zeros((1, 64, 1, 8)), jax.devices()[0]
    )
    sites = passing_sites(s, 16)
    assert [len(r) for r in sites] == ([3] if layout == "striped" else [1, 2])
    classify = kernels.get_kernel(reference_kernel).classify
    assert [set(_site_classes(classify, layout, 4, 16, True, r)) for r in sites] == want
    assert passing_sites(s._replace(impl="blockwise"), 16) == [range(0, 3)]


def test_concrete_positions_pick_the_class_traced_ones_switch_over_all():
    calls = []
    kernel = _counting(calls)
    n, t = 4, 16
    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, t, 2, 8)), F32)
    q_pos, k_pos = (original_positions("striped", n, d, t) for d in (1, 3))  # a strict round
    tiles = dict(causal=True, q_chunk=t, kv_chunk=t)
    run = lambda q, q_pos, k_pos: kernel.forward(q, q, q, q_pos, k_pos, None, None, **tiles)
    known = jax.jit(lambda q: run(q, q_pos, k_pos))(q)  # numpy positions: constants
    assert [c[:2] for c in calls] == [("attend", True)]
    calls.clear()
    traced = jax.jit(run)(q, q_pos, k_pos)
    assert len(calls) == len(CLASSES) - 1  # every class but 'hidden' calls attend
    for got, want in zip(traced, known):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)


@pytest.mark.parametrize(
    "causal,pair,segments,want",
    [
        (False, ("striped", 1, 3), False, (None, None)),  # every key: no ranges at all
        (False, ("striped", 1, 3), True, ("rows", "rows")),  # documents: exact ranges
        (True, ("striped", 2, 2), False, (None, None)),  # causal: the flag alone
        (True, ("striped", 1, 3), False, ("rows", None)),  # strict: k_start >= 1
        (True, ("contiguous", 3, 1), False, (None, None)),  # full
        (True, ("zigzag", 3, 1), False, (None, None)),  # key half
        (True, ("striped", 2, 2), True, ("rows", None)),  # documents: their first keys
    ],
)
def test_ranges_are_passed_only_where_rows_need_them(causal, pair, segments, want):
    calls = []
    kernel = _counting(calls)
    layout, device, source = pair
    n, t, b = 4, 16, 2
    q = jnp.zeros((b, t, 4, 8))
    q_pos, k_pos = (original_positions(layout, n, d, t) for d in (device, source))
    seg = jnp.asarray(np.repeat(np.arange(b * t // 4), 4).reshape(b, t)) if segments else None
    tiles = dict(causal=causal, q_chunk=t, kv_chunk=t)

    def both(q, seg):
        o, lse = kernel.forward(q, q, q, q_pos, k_pos, seg, seg, **tiles)
        return kernel.backward(q, q, q, o, lse, q, q_pos, k_pos, seg, seg, **tiles)

    jax.eval_shape(both, q, seg)  # the calls are made while tracing
    assert [c[:2] for c in calls] == [
        ("attend", causal and layout == "striped"),
        ("vjp", causal and layout == "striped"),
    ]
    for _, _, start, end in calls:
        got = tuple(None if x is None else "rows" for x in (start, end))
        assert got == want
        for x in (start, end):
            assert x is None or x.shape == (b, t)  # per row, never per head


def test_tokamax_gets_key_ranges_with_one_heads_axis_for_every_head(monkeypatch):
    """tokamax's sm90 dK/dV kernel indexes per-head key ranges wrongly with GQA: the adapter
    must hand it `[b, 1, tq]` (the same ranges for every head), in the forward and the VJP.
    Fake tokamax ops record the masks (tokamax itself is not needed)."""
    from lclm.ops.kernels import tokamax_gpu

    masks = []

    class Mask(NamedTuple):
        is_causal: bool
        k_start: object
        k_end: object

    class Forward:
        def __call__(self, q, k, v, *, mask, return_residuals):
            masks.append(mask)
            b, t, h, _ = q.shape
            return jnp.zeros_like(q), (jnp.zeros((b, h, t)), jnp.ones((b, h, t)))

        def bind(self, q, k, v, **kwargs):
            return SimpleNamespace(kwargs=kwargs)

    def vjp(residuals, o, do, q, k, v, *, mask):
        masks.append(mask)
        return {"q": jnp.zeros_like(q), "k": jnp.zeros_like(k), "v": jnp.zeros_like(v)}

    monkeypatch.setattr(tokamax_gpu, "_ops", lambda: (Forward(), vjp, Mask))
    b, t, n = 2, 16, 4
    q = jnp.zeros((b, t, 4, 64), jnp.bfloat16)
    kv = jnp.zeros((b, t, 1, 64), jnp.bfloat16)  # GQA: 4 heads per K/V
    seg = jnp.asarray(np.repeat(np.arange(b * t // 4), 4).reshape(b, t), jnp.int32)
    kernel = tokamax_gpu.KERNEL
    for causal, (device, source) in ((True, (1, 3)), (True, (2, 2)), (False, (0, 1))):
        q_pos, k_pos = (original_positions("striped", n, d, t) for d in (device, source))
        tiles = dict(causal=causal, q_chunk=t, kv_chunk=t)

        def both(q, kv, seg, q_pos=q_pos, k_pos=k_pos, tiles=tiles):
            o, lse = kernel.forward(q, kv, kv, q_pos, k_pos, seg, seg, **tiles)
            return kernel.backward(q, kv, kv, o, lse, q, q_pos, k_pos, seg, seg, **tiles)

        jax.eval_shape(both, q, kv, seg)
    # forward and VJP each: strict, causal (with k_start, and without it: skip_zero_starts'
    # other branch) and exact ranges
    assert len(masks) == 8
    assert sum(m.k_start is None for m in masks) == 2
    shapes = {x.shape for m in masks for x in (m.k_start, m.k_end) if x is not None}
    assert shapes == {(b, 1, t)}
    with pytest.raises(ValueError, match="per row"):
        tokamax_gpu._mask(Mask, True, jnp.zeros((b, 4, t), jnp.int32), None)


@pytest.fixture
def skipping_kernel(monkeypatch):
    """The reference range kernel with `skip_zero_starts` (as tokamax_gpu's is built)."""
    monkeypatch.setitem(
        kernels.KERNELS,
        "range_skipping",
        range_kernel(ref_attend, ref_attend_vjp, skip_zero_starts=True),
    )
    return "range_skipping"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "sp,documents", [(1, "one"), (1, "packed"), (4, "one"), (4, "packed"), (4, "mixed")]
)
def test_skipping_zero_starts_matches_dense(skipping_kernel, layout, sp, documents):
    """Values and gradients equal dense attention whichever branch a call takes: rows of one
    document (k_start 0 everywhere: no range passed), packed rows, and a batch of both."""
    rng = np.random.default_rng(sp)
    b, t, h, hkv, d = 2, 64, 4, 2, 16
    q, do = (rng.standard_normal((b, t, h, d), np.float32) for _ in range(2))
    k, v = (rng.standard_normal((b, t, hkv, d), np.float32) for _ in range(2))
    packed = np.cumsum(rng.random((b, t)) < 0.08, axis=1).astype(np.int32)
    seg = {
        "one": np.ones((b, t), np.int32),
        "packed": packed,
        "mixed": np.stack([np.ones(t, np.int32), packed[1]]),
    }[documents]
    _assert_ring_equals_dense(skipping_kernel, layout, sp, True, seg, q, k, v, do)


@pytest.mark.parametrize("documents,skipped", [("one", True), ("packed", False), ("mixed", False)])
def test_a_start_of_zero_everywhere_is_not_passed(documents, skipped):
    """The branch taken on the device: rows whose documents all begin at the block's first key
    run the op without k_start (one conditional per call, forward and backward); any later
    start keeps it. The ops here mark their outputs by whether they got a start."""

    def attend(q, k, v, causal, start, end):
        o, lse = ref_attend(q, k, v, causal, start, end)
        return o + (1000.0 if start is None else 0.0), lse

    def attend_vjp(q, k, v, o, lse, do, causal, start, end):
        dq, dk, dv = ref_attend_vjp(q, k, v, o, lse, do, causal, start, end)
        return dq + (1000.0 if start is None else 0.0), dk, dv

    kernel = range_kernel(attend, attend_vjp, skip_zero_starts=True)
    t = 16
    pos = jnp.arange(t)
    seg = {
        "one": np.ones((2, t), np.int32),
        "packed": np.repeat(np.arange(8), 4).reshape(2, t),
        "mixed": np.stack([np.ones(t, np.int32), np.repeat(np.arange(2), 8)]),
    }[documents]
    q = jnp.asarray(np.random.default_rng(0).standard_normal((2, t, 2, 8)), F32)
    forward = jax.jit(
        lambda q, seg: kernel.forward(
            q, q, q, pos, pos, seg, seg, causal=True, q_chunk=t, kv_chunk=t
        )
    )
    o, lse = forward(q, jnp.asarray(seg))
    assert bool(np.all(np.asarray(o) > 500)) == skipped
    assert forward.lower(q, jnp.asarray(seg)).as_text().count("stablehlo.case") == 1
    plain = range_kernel(ref_attend, ref_attend_vjp)  # the same, never skipping
    dq, want = (
        jax.jit(
            lambda q, o, lse, seg, k=k: k.backward(
                q, q, q, o, lse, q, pos, pos, seg, seg, causal=True, q_chunk=t, kv_chunk=t
            )[0]
        )(q, o, lse, jnp.asarray(seg))
        for k in (kernel, plain)
    )
    np.testing.assert_allclose(np.asarray(dq - want), 1000.0 if skipped else 0.0, atol=1e-2)

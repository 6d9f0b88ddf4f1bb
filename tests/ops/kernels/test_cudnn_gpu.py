"""`impl='cudnn_gpu'` on the CPU: packed documents become cuDNN's offsets and lengths, each
step picks plain causal, packed or the ring by documents per row, and a ring of one member
hands a kernel's whole-sequence attention the work. cuDNN's own calls need a GPU: they were
checked against float32 dense attention on an H200 (bench/results/gpu-lease-h200)."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lclm.ops import kernels, local_attention, ring_attention
from lclm.ops.kernels import blockwise, cudnn_gpu
from lclm.ops.kernels.reference import dense_attention
from lclm.parallel import make_mesh

ROWS = jnp.array(
    [[1, 1, 1, 2, 2, 3, 3, 3], [5, 5, 5, 5, 5, 5, 5, 5], [1, 1, 2, 2, 2, 0, 0, 0]]
)  # the last: two documents and padding


def test_segment_ids_become_cudnns_packed_layout():
    lengths, offsets = cudnn_gpu.document_offsets(ROWS, 4)
    np.testing.assert_array_equal(lengths, [[3, 2, 3, -1], [8, -1, -1, -1], [2, 3, 3, -1]])
    np.testing.assert_array_equal(
        offsets, [[0, 3, 5, -1, -1], [0, -1, -1, -1, -1], [0, 2, 5, -1, -1]]
    )
    assert int(cudnn_gpu.document_count(ROWS)) == 3
    # every token is in exactly one listed document
    assert np.all(np.where(lengths >= 0, lengths, 0).sum(1) == ROWS.shape[1])
    # exactly the bound: all listed, the last offset slot -1; past it: cut at the bound in both
    lengths, offsets = cudnn_gpu.document_offsets(ROWS[:1], 3)
    np.testing.assert_array_equal(lengths, [[3, 2, 3]])
    np.testing.assert_array_equal(offsets, [[0, 3, 5, -1]])
    lengths, offsets = cudnn_gpu.document_offsets(ROWS[:1], 2)
    np.testing.assert_array_equal(lengths, [[3, 2]])
    np.testing.assert_array_equal(offsets, [[0, 3, -1]])


@pytest.mark.parametrize(
    "rows,call",
    [
        (jnp.ones((2, 64), jnp.int32), 0),  # plain causal
        (jnp.repeat(jnp.arange(1, 5), 16)[None].repeat(2, 0), 1),  # packed
        (jnp.arange(64)[None].repeat(2, 0), 2),  # too many: ring
    ],
)
def test_each_step_picks_plain_packed_or_the_ring_by_documents_per_row(rows, call):
    assert int(cudnn_gpu.call_index(rows)) == call
    assert int(cudnn_gpu.document_count(rows)) == [1, 4, 64][call]


def _inputs(t=64, h=4, kvh=2, d=16):
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (2, t, h, d), jnp.float32)
    k, v = (jax.random.normal(x, (2, t, kvh, d), jnp.float32) for x in ks[1:3])
    return q, k, v, jax.random.normal(ks[3], (2, t, h, d), jnp.float32)


@pytest.mark.parametrize(
    "docs,branch",
    [(0, "causal"), (1, "causal"), (4, "packed"), (cudnn_gpu.MAX_DOCUMENTS + 8, "ring")],
)
def test_whole_attention_equals_dense_in_every_branch(monkeypatch, docs, branch):
    """The branches' calls stand in for cuDNN's (dense float32, what cuDNN was checked
    against on the GPU; the plain one without segments); what is tested is the switch, with
    the segment ids a jit argument as in training, and the ring fallback around them."""
    ran = []

    def tagged(name, out):
        jax.debug.callback(lambda: ran.append(name))
        return out

    monkeypatch.setattr(cudnn_gpu, "_on_gpu", lambda: True)
    monkeypatch.setattr(
        cudnn_gpu, "_causal", lambda q, k, v: tagged("causal", dense_attention(q, k, v))
    )
    monkeypatch.setattr(
        cudnn_gpu,
        "_packed",
        lambda q, k, v, seg: tagged("packed", dense_attention(q, k, v, segment_ids=seg)),
    )
    q, k, v, do = _inputs(t=128)
    # row 0: `docs` documents, row 1: one
    seg = (
        None
        if docs == 0
        else jnp.stack([jnp.arange(128) * docs // 128, jnp.full(128, 7)]).astype(jnp.int32)
    )
    assert seg is None or int(cudnn_gpu.document_count(seg)) == docs

    several = []  # what the fallback is told of its rows each time it is traced

    def whole(q, k, v, seg):
        def ring(several_documents=False):
            several.append(several_documents)
            return tagged(
                "ring",
                local_attention(
                    q, k, v, segment_ids=seg, impl="blockwise", q_chunk=32, kv_chunk=32
                ),
            )

        return cudnn_gpu.whole(q, k, v, seg, causal=True, fallback=ring)

    want, want_vjp = jax.vjp(lambda q, k, v: dense_attention(q, k, v, segment_ids=seg), q, k, v)
    got, got_vjp = jax.vjp(jax.jit(whole), q, k, v, seg)
    for g, w in zip((got, *got_vjp(do)[:3]), (want, *want_vjp(do))):
        assert np.max(np.abs(np.asarray(g) - np.asarray(w))) < 1e-5
    jax.effects_barrier()
    assert set(ran) == {branch}
    # the switch's ring branch serves rows of more than MAX_DOCUMENTS documents only
    assert several == ([] if seg is None else [True])


@pytest.mark.skipif(jax.devices()[0].platform == "gpu", reason="a GPU is attached")
def test_cudnn_is_called_where_its_checks_read_the_gpu_built_for(monkeypatch):
    """On this CPU, and for a described GPU that jax's cuDNN checks cannot read, whole
    attention is the ring's; within `checks_for` (an ahead-of-time compile: lclm.plan.aot) it
    is cuDNN's, noted as lowered, and the checks read the described GPU until it ends."""
    monkeypatch.setattr(cudnn_gpu, "_causal", lambda q, k, v: "cuDNN's")
    q, k, v, _ = _inputs()
    whole = lambda: cudnn_gpu.whole(q, k, v, None, causal=True, fallback=lambda: "the ring's")
    fa = cudnn_gpu._fused()
    h100 = types.SimpleNamespace(
        platform="gpu", device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0"
    )
    assert whole() == "the ring's"
    with kernels.compiling_for(h100), kernels.recording() as record:
        assert whole() == "the ring's" and record.kernels == []
        with cudnn_gpu.checks_for(h100):
            assert whole() == "cuDNN's" and record.kernels == ["cudnn_gpu"]
            assert fa.check_compute_capability("9.0") and not fa.check_compute_capability("10.0")
            assert fa.is_cuda_compute_capability_equal("9.0")
    assert not fa.check_compute_capability("9.0")  # jax's own again: no local GPU


@pytest.fixture
def whole_calls(monkeypatch):
    """Registers `impl='with_whole'`: blockwise with a whole-sequence attention that records
    each call (its query shape) and hands the work to the ring. Returns the record."""
    calls = []

    def whole(q, k, v, seg, *, causal, fallback):
        calls.append(q.shape)
        return fallback()

    monkeypatch.setitem(kernels.KERNELS, "with_whole", blockwise.KERNEL._replace(whole=whole))
    return calls


def test_a_ring_of_one_member_hands_the_kernels_whole_attention_the_work(whole_calls):
    q, k, v, _ = _inputs()
    chunks = dict(q_chunk=16, kv_chunk=16, impl="with_whole")
    placed = dict(chunks, layout="contiguous")  # original order on the mesh too
    want = dense_attention(q, k, v)
    for attend, sp, called in (
        (lambda: local_attention(q, k, v, **chunks), None, 1),
        (lambda: ring_attention(q, k, v, mesh=make_mesh(sp=1), **placed), 1, 1),
        (lambda: ring_attention(q, k, v, mesh=make_mesh(sp=2), **placed), 2, 0),
    ):
        whole_calls.clear()
        np.testing.assert_allclose(attend(), want, atol=1e-5)
        assert len(whole_calls) == called, sp


@pytest.mark.parametrize(
    "remat,called", [("none", True), ("full", True), ("attention", False), ("offload", False)]
)
def test_remat_policies_that_keep_the_rings_residuals_keep_the_ring(whole_calls, remat, called):
    """'attention' and 'offload' save the ring's named output and log-sum-exp; a whole-sequence
    attention with residuals of its own (cuDNN's) would run its forward again instead."""
    from lclm.config import AttentionConfig, ModelConfig
    from lclm.models.decoder import init_params, loss_terms

    c = ModelConfig(n_layers=1, remat=remat)
    t = 32
    batch = dict(
        tokens=jnp.zeros((1, t), jnp.int32),
        targets=jnp.zeros((1, t), jnp.int32),
        loss_mask=jnp.ones((1, t), jnp.float32),
        positions=jnp.arange(t)[None],
        segment_ids=jnp.ones((1, t), jnp.int32),
    )
    attention = AttentionConfig(q_chunk=16, kv_chunk=16, impl="with_whole")
    jax.grad(lambda p: loss_terms(c, p, batch, attention=attention)[0])(
        init_params(c, jax.random.key(0))
    )
    assert bool(whole_calls) == called

"""What tests/ops/test_strategies.py (every strategy against the dense reference) does not
hold: usp at other Ulysses degrees, the strategies through the range-kernel adapter, their
one-line errors, the model's loss under every strategy, and the collectives each compiled
strategy really holds."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ops.kernels.test_range_kernel import ref_attend, ref_attend_vjp
from test_ring_attention import _close
from test_strategies import check

from bench.strategies import collectives, gradient_program
from lclm.config import AttentionConfig, ModelConfig
from lclm.models.decoder import init_params, loss_terms
from lclm.ops import kernels
from lclm.ops.context_parallel import STRATEGIES, context_parallel_attention, layout_shards
from lclm.ops.context_parallel.ulysses import USP
from lclm.ops.kernels.range_kernel import range_kernel
from lclm.ops.layout import batch_to_layout
from lclm.parallel import make_mesh
from lclm.workdir.state import shard_params


# usp at the degrees tests/ops/test_strategies.py (which runs it at ulysses=2) does not: K/V
# heads replicated x4 inside a group, and the two ends (a ring of one: ulysses = sp; one
# member per group: ulysses = 1)
@pytest.mark.parametrize(
    "layout,mesh_kw,h,hkv,segments,ulysses",
    [
        ("contiguous", dict(sp=8), 8, 1, False, 4),
        ("striped", dict(fsdp=2, sp=4), 4, 4, True, 4),
        ("zigzag", dict(fsdp=2, sp=4), 4, 2, True, 1),
    ],
)
def test_usp_matches_dense(layout, mesh_kw, h, hkv, segments, ulysses):
    check("usp", layout, mesh_kw, h, hkv, segments, ulysses=ulysses)


@pytest.fixture
def range_reference(monkeypatch):
    """The range-mask adapter (what tokamax runs behind) on a dense op: its calls specialise
    on the block pair's class, which all_gather's rounds take from the ring's call sites."""
    monkeypatch.setitem(
        kernels.KERNELS, "range_reference", range_kernel(ref_attend, ref_attend_vjp)
    )
    return "range_reference"


# every strategy at zigzag (its rounds are half block pairs); all_gather, which takes its
# rounds' classes from the ring's call sites, at the other layouts too
@pytest.mark.parametrize(
    "strategy,layout",
    [
        *((strategy, "zigzag") for strategy in STRATEGIES),
        ("all_gather", "striped"),
        ("all_gather", "contiguous"),
    ],
)
def test_strategy_through_the_range_kernel(range_reference, strategy, layout):
    check(strategy, layout, dict(sp=4), 4, 2, True, impl=range_reference)


def test_ulysses_needs_query_heads_divisible_by_sp():
    q = jnp.zeros((2, 64, 4, 16))
    with pytest.raises(ValueError, match="4 query heads per tp shard over sp=8"):
        context_parallel_attention(q, q, q, mesh=make_mesh(sp=8), strategy="ulysses")
    with pytest.raises(ValueError, match="unknown attention strategy 'mesh'"):
        context_parallel_attention(q, q, q, mesh=make_mesh(sp=2), strategy="mesh")
    with pytest.raises(ValueError, match="4 query heads per tp shard over ulysses=8"):
        context_parallel_attention(q, q, q, mesh=make_mesh(sp=8), strategy=USP(ulysses=8))
    with pytest.raises(ValueError, match="ulysses=3 does not divide sp=8"):
        context_parallel_attention(q, q, q, mesh=make_mesh(sp=8), strategy=USP(ulysses=3))


CFG = ModelConfig(
    vocab_size=97,
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=48,
    dtype="float32",
    ffn_chunk=8,
    loss_chunk=4,
)


def test_model_loss_and_grads_do_not_depend_on_the_strategy():
    """remat='attention' (the default) included: the strategies save the same names."""
    rng = np.random.default_rng(0)
    b, t, layout = 4, 32, "zigzag"
    tokens = rng.integers(0, CFG.vocab_size, (b, t + 1)).astype(np.int32)
    seg = np.cumsum(rng.random((b, t)) < 0.1, axis=1).astype(np.int32)
    batch = dict(
        tokens=tokens[:, :-1],
        targets=tokens[:, 1:],
        segment_ids=seg,
        loss_mask=(rng.random((b, t)) < 0.7).astype(np.float32),
        positions=np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)),
    )
    mesh = make_mesh(fsdp=2, sp=4)
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    params = shard_params(CFG, init_params(CFG, jax.random.key(0)), mesh)
    runs = {}
    for strategy in STRATEGIES:
        attn = AttentionConfig(
            layout=layout,
            q_chunk=4,
            kv_chunk=4,
            strategy=strategy,
            ulysses=2 if strategy == "usp" else 1,
        )
        laid = batch_to_layout(batch, layout, layout_shards(attn, 4))  # as the loader lays it
        mean = lambda p, attn=attn, laid=laid: jnp.divide(
            *loss_terms(CFG, p, laid, mesh=mesh, attention=attn)
        )
        runs[strategy] = jax.jit(jax.value_and_grad(mean))(params)
    want_loss, want_grads = runs["ring"]
    for strategy, (loss, grads) in runs.items():
        assert abs(float(loss) - float(want_loss)) < 1e-5, strategy
        for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
            _close(g, w)


def _programs(strategy, ulysses=1):
    """(counts of each collective in the compiled gradient program of one strategy at sp=4,
    bf16 inputs; the StableHLO it was compiled from, which states the types it sends)."""
    lowered = gradient_program(strategy, ulysses)
    counts, _ = collectives(lowered.compile().as_text())
    return counts, lowered.as_text()


def _sent_types(program, op):
    """Element types of what each `op` of a StableHLO program sends."""
    return {
        t.split("x")[-1]
        for t in re.findall(rf"stablehlo\.{op}\".*?[)>] : \(tensor<([^>]*)>", program, re.S)
    }


def test_compiled_strategies_hold_their_own_collectives():
    ag, program = _programs("all_gather")
    # K, V and segment ids gathered (a repeated gather of the same array may be merged),
    # dK and dV reduce-scattered; nothing travels a ring
    assert ag["all-gather"] >= 3 and ag["reduce-scatter"] == 2, ag
    assert ag["collective-permute"] == 0 and ag["all-to-all"] == 0, ag
    # K/V gathered in the compute dtype, their gradients summed in float32
    assert _sent_types(program, "all_gather") == {"bf16", "i32"}
    assert _sent_types(program, "reduce_scatter") == {"f32"}
    uly, program = _programs("ulysses")
    # q, k, v in; do in and dq, dk, dv out (o's own all-to-all is dead in a gradient of
    # a sum); segment ids gathered
    assert uly["all-to-all"] == 7 and uly["all-gather"] == 1, uly
    assert uly["collective-permute"] == 0 and uly["reduce-scatter"] == 0, uly
    assert _sent_types(program, "all_to_all") == {"bf16"}
    usp, program = _programs("usp", ulysses=2)
    # ulysses' all-to-alls inside each pair of devices, the ring's hops between the pairs
    # (K/V and segment ids forward; K/V and float32 dK/dV backward), nothing gathered but
    # the segment ids
    assert usp["all-to-all"] == 7 and usp["all-gather"] == 1, usp
    assert usp["collective-permute"] >= 3 and usp["reduce-scatter"] == 0, usp
    assert _sent_types(program, "all_to_all") == {"bf16"}

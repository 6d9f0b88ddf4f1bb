"""The decoder (every family): causality; loss and gradients independent of mesh and layout."""

import dataclasses
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lclm.config import AttentionConfig, ModelConfig
from lclm.families import FAMILIES
from lclm.models.decoder import forward, init_params, loss_terms
from lclm.ops.context_parallel import STRATEGIES, layout_shards
from lclm.ops.layout import batch_to_layout, from_layout, to_layout
from lclm.parallel import make_mesh
from lclm.workdir.state import shard_params

CFG = ModelConfig(
    vocab_size=97,
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=48,
    rope_theta=5000.0,
    dtype="float32",
    ffn_chunk=8,
    loss_chunk=4,
)


def _batch(seed, b=4, t=32):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CFG.vocab_size, (b, t + 1)).astype(np.int32)
    seg = np.cumsum(rng.random((b, t)) < 0.1, axis=1).astype(np.int32)
    starts = np.maximum.accumulate(
        np.where(np.diff(seg, prepend=-1, axis=1) != 0, np.arange(t), 0), axis=1
    )
    return dict(
        tokens=tokens[:, :-1],
        targets=tokens[:, 1:],
        loss_mask=(rng.random((b, t)) < 0.7).astype(np.float32),
        positions=(np.arange(t) - starts).astype(np.int32),
        segment_ids=seg,
    )


def _loss_and_grads(cfg, params, batch, mesh, layout, strategy="ring"):
    attn = AttentionConfig(
        layout=layout,
        q_chunk=4,
        kv_chunk=4,
        strategy=strategy,
        ulysses=2 if strategy == "usp" else 1,
    )
    n = 1 if mesh is None else layout_shards(attn, mesh.shape["sp"])
    batch = batch_to_layout({k: jnp.asarray(v) for k, v in batch.items()}, layout, n)
    if mesh is not None:
        params = shard_params(cfg, params, mesh)

    def mean_loss(p):
        total, count = loss_terms(cfg, p, batch, mesh=mesh, attention=attn)
        return total / count

    loss, grads = jax.jit(jax.value_and_grad(mean_loss))(params)
    return float(loss), jax.tree.map(np.asarray, grads)


@pytest.mark.parametrize(
    "mesh_kw,layout,scan",
    [
        (dict(sp=4), "striped", True),
        (dict(sp=4, fsdp=2), "contiguous", True),
        (dict(sp=4, fsdp=2), "zigzag", True),
        (dict(tp=2, sp=2), "zigzag", False),
        (dict(tp=2, sp=2), "striped", False),
        (dict(fsdp=2), "striped", True),
        (dict(dp=2, fsdp=2, tp=2), "striped", True),
    ],
)
def test_loss_and_grads_do_not_depend_on_mesh_or_layout(mesh_kw, layout, scan):
    seed = zlib.crc32(repr((tuple(mesh_kw.items()), layout)).encode())
    params = init_params(CFG, jax.random.key(seed))
    batch = _batch(seed)
    want_loss, want_grads = _loss_and_grads(CFG, params, batch, None, "contiguous")
    cfg = dataclasses.replace(CFG, scan_layers=scan)
    loss, grads = _loss_and_grads(cfg, params, batch, make_mesh(**mesh_kw), layout)
    assert loss == pytest.approx(want_loss, rel=1e-5)
    flat_want = dict(jax.tree_util.tree_leaves_with_path(want_grads))
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        w = flat_want[path]
        err = np.max(np.abs(g - w)) / (np.max(np.abs(w)) + 1e-12)
        assert err < 1e-4, f"{jax.tree_util.keystr(path)}: relative error {err:.2e}"


def test_a_head_dim_apart_from_dim_over_heads_trains_alike_on_any_mesh():
    """Mistral-NeMo and Qwen3 set head_dim apart from dim / heads: here 4 heads of 12 over a
    dim of 32. Loss and gradients on fsdp x tp x sp = 2 x 2 x 2 (zigzag) equal one device's."""
    cfg = dataclasses.replace(CFG, head_dim=12)
    params = init_params(cfg, jax.random.key(3))
    assert params["layers"]["wq"].shape[-2:] == (4, 12)
    assert params["layers"]["wo"].shape[-3:] == (4, 12, 32)
    batch = _batch(3)
    want_loss, want_grads = _loss_and_grads(cfg, params, batch, None, "contiguous")
    loss, grads = _loss_and_grads(cfg, params, batch, make_mesh(fsdp=2, tp=2, sp=2), "zigzag")
    assert loss == pytest.approx(want_loss, rel=1e-5)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        assert np.max(np.abs(g - w)) / (np.max(np.abs(w)) + 1e-12) < 1e-4


# a mesh per strategy that it runs on with 4 heads over 2 kv heads (Ulysses splits heads)
STRATEGY_MESHES = {
    "ring": dict(sp=4, tp=2),
    "all_gather": dict(sp=2, tp=2, fsdp=2),
    "ulysses": dict(sp=4, fsdp=2),
    "usp": dict(sp=4, tp=2),
}


@pytest.mark.parametrize("strategy", list(STRATEGY_MESHES))
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != CFG.family])
def test_every_family_trains_alike_under_every_strategy(family, strategy):
    """Each registered family's layer options (Qwen2's q/k/v biases, Qwen3's q/k norms), tied
    embeddings and a head_dim apart from dim / heads under each strategy: loss and gradients
    on the mesh equal one device's, the options' own gradients included (CFG's family is
    the other tests')."""
    assert set(STRATEGY_MESHES) == set(STRATEGIES)  # a new strategy joins this test
    cfg = dataclasses.replace(CFG, family=family, tie_embeddings=True, head_dim=12)
    params = init_params(cfg, jax.random.key(5))
    keys = iter(jax.random.split(jax.random.key(6), 8))
    for name in ("bq", "bk", "bv", "q_norm", "k_norm"):  # non-trivial, so that they count
        if name in params["layers"]:
            w = params["layers"][name]
            params["layers"][name] = w + 0.3 * jax.random.normal(next(keys), w.shape)
    options = FAMILIES[family].qkv_bias or FAMILIES[family].qk_norm
    assert bool({"bq", "q_norm"} & set(params["layers"])) == options
    batch = _batch(11)
    want_loss, want_grads = _loss_and_grads(cfg, params, batch, None, "contiguous")
    loss, grads = _loss_and_grads(
        cfg, params, batch, make_mesh(**STRATEGY_MESHES[strategy]), "striped", strategy=strategy
    )
    assert loss == pytest.approx(want_loss, rel=1e-5)
    flat_want = dict(jax.tree_util.tree_leaves_with_path(want_grads))
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        w = flat_want[path]
        assert np.abs(w).max() > 0, jax.tree_util.keystr(path)
        err = np.max(np.abs(g - w)) / np.max(np.abs(w))
        assert err < 1e-4, f"{jax.tree_util.keystr(path)}: relative error {err:.2e}"


@pytest.mark.parametrize("layout", ["striped", "contiguous", "zigzag"])
def test_changing_a_token_never_changes_earlier_logits(layout):
    params = init_params(CFG, jax.random.key(7))
    rng = np.random.default_rng(11)
    t, sp, p = 32, 4, 19
    tokens = rng.integers(0, CFG.vocab_size, (2, t)).astype(np.int32)
    changed = tokens.copy()
    changed[:, p] = (changed[:, p] + 1) % CFG.vocab_size
    mesh = make_mesh(sp=sp, fsdp=2)
    attn = AttentionConfig(layout=layout, q_chunk=4, kv_chunk=4)
    pos = np.broadcast_to(np.arange(t, dtype=np.int32), tokens.shape)
    run = jax.jit(
        lambda pr, tok: forward(CFG, pr, tok, to_layout(pos, layout, sp), mesh=mesh, attention=attn)
    )
    a = from_layout(np.asarray(run(params, to_layout(tokens, layout, sp))), layout, sp)
    b = from_layout(np.asarray(run(params, to_layout(changed, layout, sp))), layout, sp)
    np.testing.assert_array_equal(a[:, :p], b[:, :p])
    assert np.abs(a[:, p:] - b[:, p:]).max(axis=-1).min() > 0  # later positions do change
    # and the ring's logits equal the single-device model's
    ref = np.asarray(forward(CFG, params, jnp.asarray(tokens)))
    np.testing.assert_allclose(a, ref, rtol=1e-4, atol=1e-4)


def _grad_and_program(cfg, params, batch, mesh):
    attn = AttentionConfig(q_chunk=4, kv_chunk=4)
    batch = batch_to_layout({k: jnp.asarray(v) for k, v in batch.items()}, "striped", 4)

    def mean_loss(p):
        total, count = loss_terms(cfg, p, batch, mesh=mesh, attention=attn)
        return total / count

    grad = jax.jit(jax.grad(mean_loss))
    return grad(params), grad.lower(params).compile().as_text()


@pytest.mark.parametrize("scan", [True, False])
def test_attention_remat_keeps_the_ring_output_and_never_reruns_the_ring(scan):
    """remat='attention' saves the ring's output and log-sum-exp by name: gradients equal
    the unsaved ('full') and the no-remat ones, and the backward holds the ring's forward
    transfers once (the forward pass) instead of twice (forward + recomputation)."""
    params = init_params(CFG, jax.random.key(5))
    batch, mesh = _batch(5), make_mesh(sp=4)
    params = shard_params(CFG, params, mesh)
    runs = {
        remat: _grad_and_program(
            dataclasses.replace(CFG, remat=remat, scan_layers=scan), params, batch, mesh
        )
        for remat in ("none", "full", "attention")
    }
    want = jax.tree.leaves(runs["none"][0])
    for remat in ("full", "attention"):
        for g, w in zip(jax.tree.leaves(runs[remat][0]), want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-7)
    permutes = {remat: hlo.count("collective-permute") for remat, (_, hlo) in runs.items()}
    forward_ring = permutes["full"] - permutes["none"]  # what full remat recomputes
    assert forward_ring > 0 and permutes["attention"] == permutes["none"], permutes


def _collectives(cfg, attn, params, batch, mesh, op: str) -> list[str]:
    """The result types of every `op` (e.g. all-to-all) in the compiled gradient program."""
    batch = batch_to_layout(
        {k: jnp.asarray(v) for k, v in batch.items()},
        attn.layout,
        layout_shards(attn, mesh.shape["sp"]),
    )

    def mean_loss(p):
        total, count = loss_terms(cfg, p, batch, mesh=mesh, attention=attn)
        return total / count

    hlo = jax.jit(jax.grad(mean_loss)).lower(params).compile().as_text()
    return re.findall(rf"= (.+?) {op}(?:-start)?\(", hlo)


@pytest.mark.slow  # compiles train steps: about 50 s on 2 cores
def test_attention_remat_of_all_gather_and_ulysses_is_what_the_planner_assumes():
    """remat='attention' under the other strategies, on the compiled program: all_gather's
    backward gathers no K/V again (only the int32 segment ids, a few bytes per token), and
    Ulysses' backward re-runs its forward all-to-alls as with full remat, which
    lclm.plan.strategies counts for every policy but 'none'."""
    params = init_params(CFG, jax.random.key(7))
    batch, mesh = _batch(7), make_mesh(sp=4)
    params = shard_params(CFG, params, mesh)
    ops = {}
    for strategy, op in (("all_gather", "all-gather"), ("ulysses", "all-to-all")):
        attn = AttentionConfig(q_chunk=4, kv_chunk=4, strategy=strategy)
        ops[strategy] = {
            remat: _collectives(
                dataclasses.replace(CFG, remat=remat), attn, params, batch, mesh, op
            )
            for remat in ("none", "attention", "full")
        }
    floats = {
        remat: sorted(t for t in types if not t.startswith("s32"))
        for remat, types in ops["all_gather"].items()
    }
    assert floats["attention"] == floats["none"], floats
    a2a = {remat: len(types) for remat, types in ops["ulysses"].items()}
    assert a2a["none"] < a2a["attention"] == a2a["full"], a2a


def test_offload_remat_moves_saved_activations_to_host_with_equal_gradients():
    """remat='offload' keeps what 'attention' keeps plus each layer's input, in host memory:
    the backward's residuals are host arrays in the program, and gradients are unchanged."""
    params = init_params(CFG, jax.random.key(6))
    batch, mesh = _batch(6), make_mesh(sp=4)
    params = shard_params(CFG, params, mesh)
    attn = AttentionConfig(q_chunk=4, kv_chunk=4)
    b = batch_to_layout({k: jnp.asarray(v) for k, v in batch.items()}, "striped", 4)
    grads, programs = {}, {}
    for remat in ("none", "attention", "offload"):
        cfg = dataclasses.replace(CFG, remat=remat)

        def mean_loss(p, cfg=cfg):
            total, count = loss_terms(cfg, p, b, mesh=mesh, attention=attn)
            return total / count

        grad = jax.grad(mean_loss)
        grads[remat] = jax.jit(grad)(params)
        programs[remat] = str(jax.make_jaxpr(grad)(params))
    for g, w in zip(jax.tree.leaves(grads["offload"]), jax.tree.leaves(grads["none"])):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-7)
    assert "<host>" not in programs["none"]
    host = set(re.findall(r"\w+<host>\[[\d,]+\]", programs["offload"]))
    b_, t, d, h = batch["tokens"].shape[0], batch["tokens"].shape[1], CFG.dim, CFG.n_heads
    # stacked over the layers: their inputs, and (in the ring's per-device shapes) the ring
    # outputs `[..., heads, head_dim]` and log-sum-exps `[..., heads]`
    stacked_inputs = f"[{CFG.n_layers},{b_},{t},{d}]"
    assert f"f32<host>{stacked_inputs}" in host, host
    # ... and no longer on the device, where 'attention' keeps them
    assert f"f32{stacked_inputs}" in programs["attention"]
    assert f"f32{stacked_inputs}" not in programs["offload"]
    stacked = [a for a in host if a.startswith(f"f32<host>[{CFG.n_layers},")]
    assert any(a.endswith(f",{h},{d // h}]") for a in stacked), host
    assert any(a.endswith(f",{h}]") for a in stacked), host

"""The NNX view of the decoder (every family): the functional tree, logits, gradients, shardings."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lclm.families import FAMILIES
from lclm.models.decoder import (
    AttentionConfig,
    ModelConfig,
    forward,
    init_params,
    is_param_entry,
    loss_terms,
    param_table,
)
from lclm.parallel import make_mesh
from lclm.workdir.state import param_shardings

# flax is the optional [nnx] extra (the test extra installs it)
nnx = pytest.importorskip("flax.nnx", reason="the NNX view needs the optional flax (lclm[nnx])")
from lclm.models.nnx_decoder import (  # noqa: E402
    DecoderModule,
    flax_axis_rules,
    from_params,
    to_params,
)

# every sharded dimension divides by its mesh axes on the (fsdp=2, tp=2, sp=2) mesh, where
# flax's shape-blind rules and lclm's agree
CFG = ModelConfig(
    vocab_size=64,
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=48,
    dtype="float32",
    ffn_chunk=8,
    loss_chunk=8,
)
ATTN = AttentionConfig(q_chunk=8, kv_chunk=8)


def _batch(seed, b=2, t=16):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CFG.vocab_size, (b, t + 1)).astype(np.int32)
    seg = np.repeat(np.arange(2, dtype=np.int32), t // 2)[None].repeat(b, 0)  # 2 documents
    return {
        k: jnp.asarray(v)
        for k, v in dict(
            tokens=tokens[:, :-1],
            targets=tokens[:, 1:],
            loss_mask=(rng.random((b, t)) < 0.7).astype(np.float32),
            positions=np.tile(np.arange(t // 2, dtype=np.int32), 2)[None].repeat(b, 0),
            segment_ids=seg,
        ).items()
    }


def _assert_same_tree(got, want, atol=0.0):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(
            np.asarray(g), np.asarray(w), rtol=0, atol=atol, err_msg=jax.tree_util.keystr(path)
        )


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_state_is_the_canonical_tree_both_ways(tie, family):
    """Every family's tree, its layer options (Qwen2's biases, Qwen3's q/k norms) included."""
    cfg = dataclasses.replace(CFG, tie_embeddings=tie, family=family)
    params = init_params(cfg, jax.random.key(0))
    module = from_params(cfg, params)
    assert ("lm_head" in nnx.state(module)) is not tie
    layers = set(nnx.state(module)["layers"])
    assert ({"bq", "bk", "bv"} <= layers) == FAMILIES[family].qkv_bias
    assert ({"q_norm", "k_norm"} <= layers) == FAMILIES[family].qk_norm
    tokens = _batch(1)["tokens"]
    np.testing.assert_array_equal(
        np.asarray(module(tokens)), np.asarray(forward(cfg, params, tokens))
    )
    back = to_params(module)
    _assert_same_tree(back, params)
    # wrapped, not copied
    assert all(a is b for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)))
    # the same tree a second time: state is not consumed or renamed by the conversion
    _assert_same_tree(to_params(from_params(cfg, back)), params)


def test_constructor_initialises_with_lclm_init_params():
    key = jax.random.key(3)
    _assert_same_tree(to_params(DecoderModule(CFG, rngs=key)), init_params(CFG, key))
    _assert_same_tree(
        to_params(DecoderModule(CFG, rngs=nnx.Rngs(params=4))),
        init_params(CFG, nnx.Rngs(params=4).params()),
    )


def test_bad_arguments_are_refused():
    params = init_params(CFG, jax.random.key(0))
    with pytest.raises(ValueError, match="exactly one"):
        DecoderModule(CFG)
    with pytest.raises(ValueError, match="exactly one"):
        DecoderModule(CFG, rngs=jax.random.key(0), params=params)
    params["layers"]["wq"] = params["layers"]["wq"][:, :, :2]
    with pytest.raises(ValueError, match=r"\['layers'\]\['wq'\]"):
        from_params(CFG, params)


def test_each_param_carries_its_logical_axes():
    table = jax.tree_util.tree_flatten_with_path(param_table(CFG), is_leaf=is_param_entry)[0]
    want = {tuple(k.key for k in path): axes for path, (_, axes) in table}
    got = {
        path: v.out_sharding
        for path, v in nnx.to_flat_state(nnx.state(DecoderModule(CFG, rngs=nnx.Rngs(0))))
    }
    assert got == want


def test_logits_equal_the_functional_forward():
    params, batch = init_params(CFG, jax.random.key(1)), _batch(1)
    args = (batch["tokens"], batch["positions"], batch["segment_ids"])
    want = jax.jit(lambda p: forward(CFG, p, *args, attention=ATTN))(params)
    got = nnx.jit(lambda m: m(*args, attention=ATTN))(from_params(CFG, params))
    assert got.shape == (2, 16, CFG.vocab_size)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6)


@pytest.mark.parametrize("objective", ["loss_terms", "logits"])
def test_nnx_grad_equals_jax_grad_of_the_functional_model(objective):
    params, batch = init_params(CFG, jax.random.key(2)), _batch(2)
    args = (batch["tokens"], batch["positions"], batch["segment_ids"])
    # a random projection of the logits: every logit gets its own cotangent
    proj = jax.random.normal(jax.random.key(9), (2, 16, CFG.vocab_size))

    def functional(p):
        if objective == "logits":
            return jnp.sum(forward(CFG, p, *args, attention=ATTN) * proj)
        total, count = loss_terms(CFG, p, batch, attention=ATTN)
        return total / count

    def of_module(m):
        if objective == "logits":
            return jnp.sum(m(*args, attention=ATTN) * proj)
        total, count = m.loss_terms(batch, attention=ATTN)
        return total / count

    want_loss, want = jax.jit(jax.value_and_grad(functional))(params)
    loss, grads = nnx.jit(nnx.value_and_grad(of_module))(from_params(CFG, params))
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-6)
    assert all(np.abs(np.asarray(w)).max() > 0 for w in jax.tree.leaves(want))
    _assert_same_tree(nnx.to_pure_dict(grads), want, atol=1e-6)


def test_flax_sharding_by_lclm_rules_matches_lclm_sharding():
    mesh = make_mesh(fsdp=2, tp=2, sp=2)
    module = DecoderModule(CFG, rngs=jax.random.key(4))
    want = jax.tree.map(lambda s: s.spec, param_shardings(CFG, mesh))
    state = nnx.state(module)
    with nnx.logical_axis_rules(flax_axis_rules()):
        specs = nnx.to_pure_dict(nnx.get_partition_spec(state))
        shardings = nnx.get_named_sharding(state, mesh)
    assert specs == want
    # placed by flax's shardings, the module's arrays sit where lclm puts them, and compute
    # the same logits
    tokens = _batch(4)["tokens"]
    unsharded = np.asarray(nnx.jit(lambda m: m(tokens))(module))
    nnx.update(module, jax.device_put(state, shardings))
    placed = jax.tree.map(lambda a: a.sharding.spec, to_params(module))
    assert placed == want
    np.testing.assert_allclose(
        np.asarray(nnx.jit(lambda m: m(tokens))(module)), unsharded, rtol=0, atol=1e-5
    )

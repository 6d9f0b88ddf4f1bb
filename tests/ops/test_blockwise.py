"""Blockwise feed-forward and cross-entropy equal their dense counterparts (values, grads)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lclm.ops.ffn import blockwise_ffn, swiglu
from lclm.ops.loss import blockwise_cross_entropy, losses_of_hidden
from lclm.parallel import make_mesh
from lclm.parallel.mesh import logical_sharding


def _rel(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-12)


@pytest.mark.parametrize("save_hidden", [False, True])
@pytest.mark.parametrize("n_shards,chunk", [(1, 8), (4, 4), (4, 64)])
def test_blockwise_ffn_matches_dense(n_shards, chunk, save_hidden):
    rng = np.random.default_rng(n_shards * 100 + chunk)
    x = rng.standard_normal((2, 32, 16), np.float32)
    w = [rng.standard_normal(s, np.float32) * 0.3 for s in ((16, 24), (16, 24), (24, 16))]
    mesh = make_mesh(sp=n_shards)
    constrain = lambda a, axes: jax.lax.with_sharding_constraint(
        a, logical_sharding(mesh, axes, a.shape)
    )
    f = lambda x, *w: jnp.sum(
        jnp.sin(
            blockwise_ffn(
                x, *w, chunk=chunk, n_shards=n_shards, constrain=constrain, save_hidden=save_hidden
            )
        )
    )
    g = lambda x, *w: jnp.sum(jnp.sin(swiglu(x, *w)))
    got = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3)))(x, *w)
    want = jax.value_and_grad(g, argnums=(0, 1, 2, 3))(x, *w)
    assert _rel(got[0], want[0]) < 1e-5
    for a, b in zip(got[1], want[1]):
        assert _rel(a, b) < 1e-5


def test_saved_hidden_activations_spare_two_matmuls_per_chunk():
    """save_hidden keeps (gate, up) for the backward: the compiled forward+backward has 9
    matmuls per chunk instead of 11 (the recomputed projections are gone, not just unused;
    each loop body is compiled once), and holds the saved projections: more temporary
    memory."""
    x = jnp.ones((1, 64, 16), jnp.float32)
    w = [jnp.full(s, 0.1, jnp.float32) for s in ((16, 48), (16, 48), (48, 16))]

    def compiled(save_hidden):
        f = lambda x, *w: jnp.sum(jnp.sin(blockwise_ffn(x, *w, chunk=16, save_hidden=save_hidden)))
        return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3))).lower(x, *w).compile()

    dots = {s: compiled(s).as_text().count(" dot(") for s in (False, True)}
    assert dots == {False: 11, True: 9}, dots
    sizes = {s: compiled(s).memory_analysis().temp_size_in_bytes for s in (False, True)}
    assert sizes[True] > sizes[False] + 64 * 48 * 4, sizes  # at least one saved [seq, ffn]


@pytest.mark.parametrize("n_shards,chunk", [(1, 8), (4, 2), (2, 16)])
def test_blockwise_cross_entropy_is_a_global_token_mean(n_shards, chunk):
    rng = np.random.default_rng(n_shards * 10 + chunk)
    b, t, d, v = 2, 32, 8, 11
    h = rng.standard_normal((b, t, d), np.float32)
    w = rng.standard_normal((d, v), np.float32)
    targets = rng.integers(0, v, (b, t)).astype(np.int32)
    mask = np.zeros((b, t), np.float32)
    mask[0, :3] = 1  # very unequal rows: a mean of row means would differ
    mask[1] = 1

    def blockwise(h, w):
        total, count = blockwise_cross_entropy(h, w, targets, mask, chunk=chunk, n_shards=n_shards)
        return total / count

    def dense(h, w):
        logits = h @ w
        lp = jax.nn.log_softmax(logits, -1)
        nll = -jnp.take_along_axis(lp, targets[..., None], -1)[..., 0]
        return jnp.sum(nll * mask) / jnp.sum(mask)

    got = jax.jit(jax.value_and_grad(blockwise, argnums=(0, 1)))(h, w)
    want = jax.value_and_grad(dense, argnums=(0, 1))(h, w)
    assert _rel(got[0], want[0]) < 1e-5
    for a, c in zip(got[1], want[1]):
        assert _rel(a, c) < 1e-5
    # losses_of_hidden itself is the per-token negative log-likelihood
    np.testing.assert_allclose(
        losses_of_hidden(h, w, targets),
        -np.take_along_axis(np.asarray(jax.nn.log_softmax(h @ w)), targets[..., None], -1)[..., 0],
        rtol=1e-5,
        atol=1e-5,
    )


def test_blockwise_loss_memory_does_not_hold_full_logits():
    """The compiled backward never allocates [batch, seq, vocab] logits at once."""
    b, t, d, v, chunk = 1, 1024, 16, 4096, 64
    h = jnp.ones((b, t, d))
    w = jnp.ones((d, v)) * 0.01
    targets = jnp.zeros((b, t), jnp.int32)
    mask = jnp.ones((b, t))
    f = lambda h, w: blockwise_cross_entropy(h, w, targets, mask, chunk=chunk)[0]
    compiled = jax.jit(jax.grad(f, argnums=(0, 1))).lower(h, w).compile()
    full_logits = b * t * v * 4
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < full_logits / 4, f"temporary memory {temp} vs full logits {full_logits}"

"""The plain single-device training step every lclm train-step row is compared with.

What a JAX user writes without lclm, on the same `ModelConfig` and parameter tree: scanned
layers under one of three remat settings (`REMATS`: none, `dots` =
`jax.checkpoint_policies.checkpoint_dots`, or `full` = nothing saved), attention through
`jax.nn.dot_product_attention` (cuDNN's fused kernel on GPUs, XLA elsewhere; GQA without
repeating K/V), an unchunked SwiGLU, a cross-entropy over sequence chunks (each chunk's logits
recomputed in the backward) and lclm's own AdamW. No mesh, no ring, no document masks (the
bench's synthetic batch is one document per row). Only the attention, the feed-forward and the
loss differ from lclm's step; RMSNorm and RoPE are lclm's functions, the same math.

A fair baseline is the fastest of these that fits: `bench.train_step` times all three (in one
process, in the order of `REMATS`, along which memory grows) and compares lclm's rows with
`fastest_that_fits`.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import optax
from jax import lax

from lclm.config import ModelConfig
from lclm.models.decoder import apply_rope, rms_norm, rope_tables
from lclm.workdir.state import TrainState

F32 = jnp.float32
# layer remat settings timed, in the order they run (each keeps more than the one before, so
# memory grows along it): name -> jax.checkpoint policy (None: no remat at all)
REMATS = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "none": None,
}


def fastest_that_fits(records: list[dict]) -> dict | None:
    """The record, among one model and length's remat variants, of the fastest step that ran
    ('ok' status: it compiled, fit in device memory and finished); None if none did."""
    ran = [r for r in records if r.get("status") == "ok" and r.get("step_s")]
    return min(ran, key=lambda r: r["step_s"], default=None)


def attention_implementation() -> Literal["cudnn"] | None:
    """cuDNN on GPUs (failing loudly if it cannot run, rather than timing XLA's fallback);
    XLA's default elsewhere. The GPU is the one the program is built for (`compiling_for`'s
    described GPU in `--compile-only`), not necessarily this host's."""
    from lclm.ops.kernels import platform_family, target_device

    return "cudnn" if platform_family(target_device().platform) == "gpu" else None


def _layer(c: ModelConfig, x, p, rope):
    """One transformer block. x `[batch, seq, dim]` in the compute dtype."""
    p = jax.tree.map(lambda w: w.astype(jnp.dtype(c.dtype)), p)
    h = rms_norm(x, p["attn_norm"], c.norm_eps)
    q = apply_rope(jnp.einsum("btd,dhk->bthk", h, p["wq"]), *rope)
    k = apply_rope(jnp.einsum("btd,dhk->bthk", h, p["wk"]), *rope)
    v = jnp.einsum("btd,dhk->bthk", h, p["wv"])
    o = jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation=attention_implementation()
    )
    x = x + jnp.einsum("bthk,hkd->btd", o, p["wo"])
    h = rms_norm(x, p["ffn_norm"], c.norm_eps)
    gate = jnp.einsum("btd,df->btf", h, p["w_gate"])
    up = jnp.einsum("btd,df->btf", h, p["w_up"])
    return x + jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, p["w_down"])


def _chunked_cross_entropy(h, w_out, targets, mask, chunk: int):
    """(sum of masked losses, mask sum) float32; h `[batch, seq, dim]`, w_out `[dim, vocab]`.
    Logits exist one `[batch, chunk, vocab]` slice at a time, in the backward too."""
    b, t, d = h.shape
    chunk = min(chunk, t)
    split = lambda a: jnp.moveaxis(a.reshape(b, t // chunk, chunk, *a.shape[2:]), 1, 0)

    @jax.checkpoint
    def one(carry, xs):
        hc, tc, mc = xs
        logits = jnp.einsum("btd,dv->btv", hc, w_out, preferred_element_type=F32)
        picked = jnp.take_along_axis(logits, tc[..., None], axis=-1)[..., 0]
        loss = (jax.nn.logsumexp(logits, axis=-1) - picked) * mc
        return carry + loss.sum(), None

    total, _ = lax.scan(one, jnp.zeros((), F32), (split(h), split(targets), split(mask)))
    return total, mask.sum()


def loss_terms(c: ModelConfig, params, batch, remat: str = "full"):
    """(sum of masked token losses, number of unmasked tokens), as lclm's `loss_terms`.
    batch: `[batch, seq]` arrays in original order (tokens, targets, loss_mask, positions);
    remat: a key of `REMATS`."""
    x = jnp.take(params["embed"].astype(jnp.dtype(c.dtype)), batch["tokens"], axis=0)
    rope = rope_tables(batch["positions"], c)
    layer = lambda x, p: _layer(c, x, p, rope)
    if REMATS[remat] is not None:
        layer = jax.checkpoint(layer, policy=REMATS[remat])
    x, _ = lax.scan(lambda x, p: (layer(x, p), None), x, params["layers"])
    h = rms_norm(x, params["final_norm"], c.norm_eps)
    w_out = params["embed"].T if c.tie_embeddings else params["lm_head"]
    return _chunked_cross_entropy(
        h,
        w_out.astype(jnp.dtype(c.dtype)),
        batch["targets"],
        batch["loss_mask"].astype(F32),
        c.loss_chunk,
    )


def make_step(c: ModelConfig, optimizer: optax.GradientTransformation, remat: str = "full"):
    """`step(state, batch) -> (state, metrics)`, not yet jitted: mean loss, AdamW update."""

    def step(state: TrainState, batch):
        def mean_loss(params):
            total, count = loss_terms(c, params, batch, remat)
            return total / jnp.maximum(count, 1.0)

        loss, grads = jax.value_and_grad(mean_loss)(state.params)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return TrainState(state.step + 1, params, opt_state), dict(loss=loss)

    return step


def init_state(c: ModelConfig, optimizer: optax.GradientTransformation, seed: int) -> TrainState:
    from lclm.models.decoder import init_params

    params = jax.jit(lambda k: init_params(c, k))(jax.random.key(seed))
    return TrainState(jnp.zeros((), jnp.int32), params, jax.jit(optimizer.init)(params))

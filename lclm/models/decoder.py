"""The decoder every model family shares (LLaMA, Qwen2/2.5, Qwen3, Mistral): RMSNorm, RoPE,
SwiGLU, GQA, as pure functions over a param tree. A family (`lclm.families`, named by
`model.family`) adds options to the one layer: biases on q/k/v (Qwen2), an RMSNorm over each
head's q and k (Qwen3).

Parameters live in one canonical layout whatever the run's settings: layer weights are
stacked on a leading `layers` axis (`scan_layers` only chooses scan vs. a Python loop), q/k
weights use HuggingFace's rotate-half RoPE convention, and attention weights keep heads as
their own axis (`wq [layers, dim, heads, head_dim]`).

Token order: the model is layout-agnostic. It receives per-token arrays in whatever order
the data pipeline produced (striped for the ring), RoPE uses the `positions` it is given
(original positions), and attention masks are derived inside the ring from the layout.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from lclm.config.model import REMAT, ROPE_SCALINGS, AttentionConfig, ModelConfig, yarn_mscale
from lclm.families import get_family
from lclm.ops.context_parallel import (
    context_parallel_attention,
    local_attention,
    strategy_of,
)
from lclm.ops.context_parallel.rounds import SAVED_NAMES
from lclm.ops.ffn import blockwise_ffn
from lclm.ops.loss import blockwise_cross_entropy
from lclm.parallel.mesh import logical_sharding


def param_count(c: ModelConfig, include_embeddings: bool = True) -> int:
    shapes = jax.tree.leaves(param_shapes(c), is_leaf=lambda x: isinstance(x, tuple))
    total = sum(math.prod(s) for s in shapes)
    return total if include_embeddings else total - c.vocab_size * c.dim


def param_table(c: ModelConfig):
    """name -> (shape, logical axes) of every parameter, in the canonical layout."""
    L, D, H, K, Dh, F, V = (
        c.n_layers,
        c.dim,
        c.n_heads,
        c.n_kv_heads,
        c.head_dim,
        c.ffn_dim,
        c.vocab_size,
    )
    layers = {
        "attn_norm": ((L, D), ("layers", "norm")),
        "wq": ((L, D, H, Dh), ("layers", "embed", "heads", "head_dim")),
        "wk": ((L, D, K, Dh), ("layers", "embed", "kv_heads", "head_dim")),
        "wv": ((L, D, K, Dh), ("layers", "embed", "kv_heads", "head_dim")),
        "wo": ((L, H, Dh, D), ("layers", "heads", "head_dim", "embed")),
        "ffn_norm": ((L, D), ("layers", "norm")),
        "w_gate": ((L, D, F), ("layers", "embed", "mlp")),
        "w_up": ((L, D, F), ("layers", "embed", "mlp")),
        "w_down": ((L, F, D), ("layers", "mlp", "embed")),
    }
    family = get_family(c.family)
    if family.qkv_bias:
        layers.update(
            bq=((L, H, Dh), ("layers", "heads", "head_dim")),
            bk=((L, K, Dh), ("layers", "kv_heads", "head_dim")),
            bv=((L, K, Dh), ("layers", "kv_heads", "head_dim")),
        )
    if family.qk_norm:  # one weight per head dimension, shared by the heads
        layers.update(q_norm=((L, Dh), ("layers", "norm")), k_norm=((L, Dh), ("layers", "norm")))
    table = {
        "embed": ((V, D), ("vocab", "embed")),
        "layers": layers,
        "final_norm": ((D,), ("norm",)),
    }
    if not c.tie_embeddings:
        table["lm_head"] = ((D, V), ("embed", "vocab"))
    return table


def is_param_entry(x):
    """A leaf of `param_table`: (shape, logical axes)."""
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], tuple)


def param_shapes(c: ModelConfig):
    """Pytree of parameter shapes."""
    return jax.tree.map(lambda e: e[0], param_table(c), is_leaf=is_param_entry)


BIASES = ("bq", "bk", "bv")


def init_params(c: ModelConfig, key):
    """Random parameters in `param_dtype`: normal(init_std) matrices, unit norm weights, zero
    biases."""
    table = param_table(c)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(table, is_leaf=is_param_entry)
    keys = jax.random.split(key, len(leaves))
    dtype = jnp.dtype(c.param_dtype)

    def one(path, entry, k):
        shape, axes = entry
        if axes[-1] == "norm":
            return jnp.ones(shape, dtype)
        if path[-1].key in BIASES:
            return jnp.zeros(shape, dtype)
        return (c.init_std * jax.random.normal(k, shape, jnp.float32)).astype(dtype)

    return jax.tree.unflatten(treedef, [one(*e, k) for e, k in zip(leaves, keys)])


def rms_norm(x, weight, eps):
    """RMSNorm in float32, returned in x's dtype. x `[..., dim]`, weight `[dim]`."""
    xf = x.astype(jnp.float32)
    y = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * weight.astype(jnp.float32)).astype(x.dtype)


def rope_frequencies(c: ModelConfig) -> np.ndarray:
    """The `head_dim/2` rotation frequencies (radians per position, float32) of `c`: theta's
    geometric series, then `c.rope_scaling` (computed in float64, a trace-time constant).

    llama3 scaling divides by `rope_factor` the frequencies whose wavelength exceeds
    `original / low_freq_factor` positions, keeps those shorter than
    `original / high_freq_factor`, and blends linearly in `original / wavelength` between.
    yarn divides by `rope_factor` the dimensions that turn fewer than `beta_slow` times over
    the original context, keeps those that turn more than `beta_fast` times, and ramps
    linearly in the dimension index between (HF's `_compute_yarn_parameters`)."""
    half = np.arange(0, c.head_dim, 2, dtype=np.float64)
    inv = c.rope_theta ** (-half / c.head_dim)
    if c.rope_scaling == "linear":
        inv = inv / c.rope_factor
    elif c.rope_scaling == "llama3":
        low, high = c.rope_low_freq_factor, c.rope_high_freq_factor
        # 1: keep, 0: divide by factor; in between (the medium band) a linear blend
        keep = np.clip(
            (c.rope_original_max_positions * inv / (2 * np.pi) - low) / (high - low), 0.0, 1.0
        )
        inv = inv * (keep + (1 - keep) / c.rope_factor)
    elif c.rope_scaling == "yarn":
        # the dimension that turns `rotations` times over the original context
        dim_of = lambda rotations: (
            c.head_dim
            * math.log(c.rope_original_max_positions / (rotations * 2 * math.pi))
            / (2 * math.log(c.rope_theta))
        )
        low, high = dim_of(c.rope_beta_fast), dim_of(c.rope_beta_slow)
        if c.rope_truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, c.head_dim - 1)
        high = high + 0.001 if low == high else high  # HF's guard against 0 / 0
        # 1: keep (extrapolate), 0: divide by factor (interpolate)
        keep = 1 - np.clip((np.arange(c.head_dim // 2) - low) / (high - low), 0.0, 1.0)
        inv = inv * (keep + (1 - keep) / c.rope_factor)
    elif c.rope_scaling != "none":
        raise ValueError(f"rope_scaling={c.rope_scaling!r}; use one of {ROPE_SCALINGS}")
    return inv.astype(np.float32)


def rope_scale(c: ModelConfig) -> float:
    """What cos and sin are multiplied by (so q and k each, the logits by its square): yarn's
    attention factor (`rope_attention_factor`, 0: 0.1 ln(factor) + 1), else 1."""
    if c.rope_scaling != "yarn":
        return 1.0
    if c.rope_attention_factor:
        return c.rope_attention_factor
    return yarn_mscale(c.rope_factor)


def rope_tables(positions, c: ModelConfig):
    """cos/sin `[batch, seq, 1, head_dim/2]` (float32) for integer positions `[batch, seq]`."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope_frequencies(c))
    scale = rope_scale(c)
    return scale * jnp.cos(angles)[:, :, None, :], scale * jnp.sin(angles)[:, :, None, :]


def apply_rope(x, cos, sin):
    """Rotate-half RoPE (HuggingFace convention). x `[batch, seq, heads, head_dim]`."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


LAYER_INPUT = "layer_input"  # the name remat policies know a layer's input by

# model.remat -> its JAX checkpoint policy, keeping what lclm.config.model.REMAT says it
# keeps ('none' runs no jax.checkpoint)
_REMAT = {
    "full": jax.checkpoint_policies.nothing_saveable,
    # the ring's output and log-sum-exp are kept: the backward recomputes the layer's cheap
    # parts (norms, projections, RoPE, FFN chunks) but never the ring forward
    "attention": jax.checkpoint_policies.save_only_these_names(*SAVED_NAMES),
    # for the longest sequences on few devices: what 'attention' keeps, and each layer's
    # input, go to host memory during the forward and come back for the backward
    "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=[LAYER_INPUT, *SAVED_NAMES],
        offload_src="device",
        offload_dst="pinned_host",
    ),
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


def _constrainer(mesh):
    if mesh is None:
        return lambda x, axes: x
    return lambda x, axes: lax.with_sharding_constraint(x, logical_sharding(mesh, axes, x.shape))


def compute_weights(c: ModelConfig, p):
    """A layer's weights cast to the compute dtype."""
    return jax.tree.map(lambda w: w.astype(jnp.dtype(c.dtype)), p)


def attention_inputs(c: ModelConfig, p, x, rope):
    """Rotated q `[batch, seq, heads, head_dim]`, k and v `[batch, seq, kv_heads, head_dim]`
    of a layer's input x `[batch, seq, dim]` (p: the layer's weights in the compute dtype),
    with the family's options: q/k/v biases, then q and k RMS-normalised per head, both
    before RoPE (as transformers' Qwen2 and Qwen3 do)."""
    family = get_family(c.family)
    h = rms_norm(x, p["attn_norm"], c.norm_eps)
    q, k, v = (jnp.einsum("btd,dhk->bthk", h, p[w]) for w in ("wq", "wk", "wv"))
    if family.qkv_bias:
        q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    if family.qk_norm:
        q, k = rms_norm(q, p["q_norm"], c.norm_eps), rms_norm(k, p["k_norm"], c.norm_eps)
    return apply_rope(q, *rope), apply_rope(k, *rope), v


def decoder_layer(c: ModelConfig, params, x, rope, attend, feed_forward, constrain=None):
    """One transformer block, written once for training and decoding: (output x, what
    `attend` returned besides its output: the keys and values a decoder caches).

    x `[batch, seq, dim]` in the compute dtype; params: the layer's stored weights.
    attend(q, k, v) -> (o `[batch, seq, heads, head_dim]`, k, v) with the rotated q, k, v of
    `attention_inputs`; feed_forward(h, params, weights) -> the SwiGLU output for the normed
    h, given the stored weights and those cast to the compute dtype. constrain(x, axes)
    places activations on a mesh (None: nowhere)."""
    constrain = constrain or (lambda t, axes: t)
    p = compute_weights(c, params)
    heads = ("batch", "seq", "act_heads", None)
    q, k, v = (constrain(t, heads) for t in attention_inputs(c, p, x, rope))
    o, k, v = attend(q, k, v)
    x = x + constrain(
        jnp.einsum("bthk,hkd->btd", o.astype(x.dtype), p["wo"]), ("batch", "seq", "act_embed")
    )
    x = x + feed_forward(rms_norm(x, p["ffn_norm"], c.norm_eps), params, p)
    return constrain(x, ("batch", "seq", "act_embed")), k, v


def layer_with_kv(c: ModelConfig, a: AttentionConfig, mesh, x, p, rope, segment_ids):
    """One transformer block as trained and prefilled: (output x, its rotated k and v, which
    a decoder caches). x `[batch, seq, dim]` in the compute dtype."""
    constrain = _constrainer(mesh)
    x = checkpoint_name(x, LAYER_INPUT)  # every use below takes the named value
    chunks = dict(
        q_chunk=a.q_chunk,
        kv_chunk=a.kv_chunk,
        impl=a.impl,
        segment_ids=segment_ids,
        whole=not REMAT[c.remat].attention_residuals,
    )
    n_shards = 1 if mesh is None else mesh.shape["sp"]

    def attend(q, k, v):
        if mesh is None:
            return local_attention(q, k, v, **chunks), k, v
        return (
            context_parallel_attention(
                q, k, v, mesh=mesh, strategy=strategy_of(a), layout=a.layout, **chunks
            ),
            k,
            v,
        )

    def feed_forward(h, stored, _):
        # the stored (float32) weights, cast inside the op: their gradients are summed over
        # the chunks in float32. remat='none' asks for no recomputation: the chunks'
        # projections are kept for the backward
        return blockwise_ffn(
            h,
            stored["w_gate"],
            stored["w_up"],
            stored["w_down"],
            chunk=c.ffn_chunk,
            n_shards=n_shards,
            constrain=constrain,
            dtype=jnp.dtype(c.dtype),
            save_hidden=REMAT[c.remat].everything,
        )

    return decoder_layer(c, p, x, rope, attend, feed_forward, constrain)


def _layer(c: ModelConfig, a: AttentionConfig, mesh, x, p, rope, segment_ids):
    """One transformer block, as trained (the k/v outputs are not needed)."""
    return layer_with_kv(c, a, mesh, x, p, rope, segment_ids)[0]


def embed(c: ModelConfig, params, tokens, mesh=None):
    """Token embeddings `[batch, seq, dim]` in the compute dtype for tokens `[batch, seq]`.

    The table is gathered over its embed dimension first, as FSDP gathers every weight: a
    lookup into a table sharded along embed yields activations sharded along embed, which XLA
    can only reshard to (batch, seq) by replicating them whole on every device."""
    constrain = _constrainer(mesh)
    table = constrain(params["embed"].astype(jnp.dtype(c.dtype)), ("vocab", None))
    return constrain(jnp.take(table, tokens, axis=0), ("batch", "seq", "act_embed"))


def hidden_states(
    c: ModelConfig,
    params,
    tokens,
    positions,
    segment_ids=None,
    *,
    mesh=None,
    attention: AttentionConfig = AttentionConfig(),
):
    """Final-normed hidden states `[batch, seq, dim]` for tokens `[batch, seq]`.

    positions `[batch, seq]` are the tokens' RoPE positions; segment_ids `[batch, seq]` (or
    None) keep packed documents apart. All per-token inputs are in the mesh's layout order.
    """
    x = embed(c, params, tokens, mesh)
    rope = rope_tables(positions, c)
    layer: Callable[..., Any] = functools.partial(_layer, c, attention, mesh)
    if not REMAT[c.remat].everything:
        layer = jax.checkpoint(layer, policy=_REMAT[c.remat])
    if c.scan_layers:
        x, _ = lax.scan(lambda x, p: (layer(x, p, rope, segment_ids), None), x, params["layers"])
    else:
        for i in range(c.n_layers):
            x = layer(x, jax.tree.map(lambda w, i=i: w[i], params["layers"]), rope, segment_ids)
    return rms_norm(x, params["final_norm"], c.norm_eps)


def output_weights(c: ModelConfig, params):
    """The `[dim, vocab]` projection to logits (the tied embedding when configured)."""
    w = params["embed"].T if c.tie_embeddings else params["lm_head"]
    return w.astype(jnp.dtype(c.dtype))


def forward(
    c: ModelConfig,
    params,
    tokens,
    positions=None,
    segment_ids=None,
    *,
    mesh=None,
    attention: AttentionConfig = AttentionConfig(),
):
    """Float32 logits `[batch, seq, vocab]` (materialised: for checks and evaluation).

    Without a mesh this runs on one device in original order (positions default to arange).
    """
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    h = hidden_states(c, params, tokens, positions, segment_ids, mesh=mesh, attention=attention)
    return jnp.einsum(
        "btd,dv->btv", h, output_weights(c, params), preferred_element_type=jnp.float32
    )


def loss_terms(
    c: ModelConfig,
    params,
    batch,
    *,
    mesh=None,
    attention: AttentionConfig = AttentionConfig(),
    document_mask: bool = True,
):
    """(sum of masked token losses, number of unmasked tokens) of a batch, float32.

    batch: dict of `[batch, seq]` arrays `tokens`, `targets`, `loss_mask`, `positions`,
    `segment_ids`, all in the same (layout) order. The blockwise loss never builds the full
    logits. Divide the two totals for the global token-mean loss.
    """
    seg = batch["segment_ids"] if document_mask else None
    h = hidden_states(
        c, params, batch["tokens"], batch["positions"], seg, mesh=mesh, attention=attention
    )
    n_shards = 1 if mesh is None else mesh.shape["sp"]
    w_out = params["embed"].T if c.tie_embeddings else params["lm_head"]  # cast inside
    return blockwise_cross_entropy(
        h,
        w_out,
        batch["targets"],
        batch["loss_mask"],
        chunk=c.loss_chunk,
        n_shards=n_shards,
        constrain=_constrainer(mesh),
        dtype=jnp.dtype(c.dtype),
    )

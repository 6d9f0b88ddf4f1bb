"""Greedy decoding: a ring-attention prefill that fills a KV cache, then cached steps.

Prefill runs the model's own layers (`lclm.models.llama.layer_with_kv`: striped ring attention over
`sp` when a mesh is given, the blockwise kernel on one device otherwise) over the prompt in
the mesh's token layout, and keeps every layer's rotated keys and values as the cache. The
cache stays in layout order and sharded over `sp` like the prefill's activations: attention
over a set of keys does not depend on their order, RoPE was applied at the original
positions, and visibility comes from segment ids, so nothing is unstriped.

Each decode step feeds one token per row through the layers with plain softmax attention
over the prefill cache plus a small cache of the tokens decoded so far (float32 scores, the
two parts merged by one joint softmax). Under `jit` on a mesh this is GSPMD over the sharded
cache (the reductions over the sequence become collectives); it is meant for a few tokens.

Shapes: B rows, P prefill tokens, M decode slots, L layers, K kv heads, Dh head dim.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lclm.config import AttentionConfig, LlamaConfig
from lclm.data.loader import batch_sharding
from lclm.models import llama
from lclm.ops.ffn import swiglu
from lclm.ops.layout import batch_to_layout, to_layout

F32 = jnp.float32


class Cache(NamedTuple):
    """Keys/values of the prompt and of the decoded tokens, per layer.

    k, v `[L, B, P, K, Dh]` (layout order, sharded like the prefill); visible `[B, P]` bool
    (a prompt key that decoded tokens may attend to: same segment as the last prompt token);
    new_k, new_v `[L, B, M, K, Dh]` (slot s holds the s-th decoded token).
    """
    k: jax.Array
    v: jax.Array
    visible: jax.Array
    new_k: jax.Array
    new_v: jax.Array


def _logits(c: LlamaConfig, params, x):
    """Float32 logits `[B, V]` of final-layer states x `[B, D]`."""
    h = llama.rms_norm(x, params["final_norm"], c.norm_eps)
    return jnp.einsum("bd,dv->bv", h, llama.output_weights(c, params),
                      preferred_element_type=F32)


def prefill(c: LlamaConfig, a: AttentionConfig, params, tokens, positions, segment_ids, *,
            last: int, max_new: int, mesh=None):
    """Run the prompt; returns (logits `[B, V]` float32 after the token at layout index
    `last`, the `Cache` with `max_new` empty decode slots).

    tokens, positions, segment_ids `[B, P]` in the mesh's layout order (original order
    without a mesh). The layer stack is the model's own, so the hidden states (and logits)
    are exactly those of `llama.forward`.
    """
    x = llama.embed(c, params, tokens, mesh)
    rope = llama.rope_tables(positions, c)

    def layer(x, p):
        x, k, v = llama.layer_with_kv(c, a, mesh, x, p, rope, segment_ids)
        return x, (k, v)

    x, (k, v) = lax.scan(layer, x, params["layers"])
    visible = segment_ids == segment_ids[:, last:last + 1]
    shape = (c.n_layers, tokens.shape[0], max_new, c.n_kv_heads, c.head_dim)
    empty = jnp.zeros(shape, k.dtype)
    return _logits(c, params, x[:, last]), Cache(k, v, visible, empty, empty)


def _cached_attention(q, cache_k, cache_v, visible, new_k, new_v, n_new):
    """Softmax attention of one query per row over the prompt cache and the first `n_new`
    decode slots. q `[B, 1, H, Dh]`; cache_k/v `[B, P, K, Dh]`; visible `[B, P]`;
    new_k/v `[B, M, K, Dh]`. Returns `[B, 1, H, Dh]` float32."""
    b, _, h, d = q.shape
    kh = cache_k.shape[2]
    qg = q.reshape(b, kh, h // kh, d)  # GQA: query heads grouped by their kv head
    scores = lambda k: jnp.einsum("bhgd,bkhd->bhgk", qg, k, preferred_element_type=F32) * d ** -0.5
    s_old = jnp.where(visible[:, None, None, :], scores(cache_k), -jnp.inf)
    s_new = jnp.where((jnp.arange(new_k.shape[1]) < n_new)[None, None, None, :],
                      scores(new_k), -jnp.inf)
    m = jnp.maximum(s_old.max(-1), s_new.max(-1))[..., None]  # finite: slot 0 is always seen
    p_old, p_new = jnp.exp(s_old - m), jnp.exp(s_new - m)
    denom = p_old.sum(-1) + p_new.sum(-1)
    o = (jnp.einsum("bhgk,bkhd->bhgd", p_old, cache_v.astype(F32))
         + jnp.einsum("bhgk,bkhd->bhgd", p_new, new_v.astype(F32))) / denom[..., None]
    return o.reshape(b, 1, h, d)


def decode_step(c: LlamaConfig, params, cache: Cache, token, position, step, *, mesh=None):
    """Feed token `[B]` at RoPE position `[B]` into decode slot `step` (scalar int); returns
    (logits `[B, V]` float32 for the next token, new_k, new_v): only the decode slots are
    returned, so the (large) prompt cache is never copied."""
    x = llama.embed(c, params, token[:, None], mesh)
    rope = llama.rope_tables(position[:, None], c)

    def layer(x, inputs):
        p, cache_k, cache_v, new_k, new_v = inputs
        p = llama.compute_weights(c, p)
        q, k, v = llama.attention_inputs(c, p, x, rope)
        new_k = lax.dynamic_update_slice_in_dim(new_k, k.astype(new_k.dtype), step, axis=1)
        new_v = lax.dynamic_update_slice_in_dim(new_v, v.astype(new_v.dtype), step, axis=1)
        o = _cached_attention(q, cache_k, cache_v, cache.visible, new_k, new_v, step + 1)
        x = x + jnp.einsum("bthk,hkd->btd", o.astype(x.dtype), p["wo"])
        h = llama.rms_norm(x, p["ffn_norm"], c.norm_eps)
        x = x + swiglu(h, p["w_gate"], p["w_up"], p["w_down"])
        return x, (new_k, new_v)

    layers = (params["layers"], cache.k, cache.v, cache.new_k, cache.new_v)
    x, (new_k, new_v) = lax.scan(layer, x, layers)
    return _logits(c, params, x[:, 0]), new_k, new_v


@functools.lru_cache(maxsize=16)
def _compiled(c: LlamaConfig, a: AttentionConfig, mesh, last: int, max_new: int):
    """Jitted (prefill, decode step) for one model, mesh and prompt shape."""
    run_prefill = jax.jit(functools.partial(prefill, c, a, last=last, max_new=max_new,
                                            mesh=mesh))
    run_step = jax.jit(functools.partial(decode_step, c, mesh=mesh))
    return run_prefill, run_step


def last_layout_index(layout: str, sp: int, length: int) -> int:
    """Where the final token (original position length-1) sits in `layout` order."""
    order = to_layout(np.arange(length)[None], layout, sp)[0]
    return int(np.flatnonzero(order == length - 1)[0])


def greedy_generate(c: LlamaConfig, a: AttentionConfig, params, tokens, positions,
                    segment_ids, max_new: int, mesh=None) -> np.ndarray:
    """Greedy continuation `[B, max_new]` int32 of prompts that end at the last column.

    tokens, positions, segment_ids: numpy `[B, P]` in original order (front padding goes in
    its own segment, see `lclm.eval.line_retrieval`); P must suit the mesh (`sp` and the
    chunks divide it) and B the mesh's batch axes. Decoded token s sits at position
    positions[:, -1] + 1 + s.
    """
    sp = 1 if mesh is None else mesh.shape["sp"]
    layout = a.layout if mesh is not None else "contiguous"
    batch = dict(tokens=tokens, positions=positions, segment_ids=segment_ids)
    batch = {k: np.asarray(v, np.int32) for k, v in batch_to_layout(batch, layout, sp).items()}
    if mesh is not None:
        batch = {k: jax.device_put(v, batch_sharding(mesh)) for k, v in batch.items()}
    run_prefill, run_step = _compiled(c, a, mesh, last_layout_index(layout, sp, tokens.shape[1]),
                                      max_new)
    if max_new < 1:
        raise ValueError(f"max_new={max_new}; decode at least one token")
    logits, cache = run_prefill(params, batch["tokens"], batch["positions"],
                                batch["segment_ids"])
    out = [jnp.argmax(logits, -1).astype(jnp.int32)]
    next_position = jnp.asarray(positions[:, -1] + 1, jnp.int32)
    # simulated CPU devices: one program in flight at a time (as in the training loop,
    # overlapping multi-device CPU programs can stall XLA's collective rendezvous)
    sync = jax.block_until_ready if jax.devices()[0].platform == "cpu" else (lambda x: x)
    for s in range(max_new - 1):
        logits, new_k, new_v = sync(run_step(params, cache, out[-1], next_position + s,
                                             jnp.int32(s)))
        cache = cache._replace(new_k=new_k, new_v=new_v)
        out.append(jnp.argmax(logits, -1).astype(jnp.int32))
    return np.asarray(jax.device_get(jnp.stack(out, axis=1)))

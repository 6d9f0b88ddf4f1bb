"""Decoding: a ring-attention prefill that fills a KV cache, then cached steps, each token
chosen greedily or sampled (temperature, top-k, top-p).

Prefill runs the model's own layers (`lclm.models.decoder.layer_with_kv`: striped ring
attention over `sp` when a mesh is given, the blockwise kernel on one device otherwise) over
the prompt in the mesh's token layout, and keeps every layer's rotated keys and values as the
cache. The cache stays in layout order and sharded over `sp` like the prefill's activations:
attention over a set of keys does not depend on their order, RoPE was applied at the
original positions, and visibility comes from segment ids, so nothing is unstriped.

Each decode step feeds one token per row through the same layers (`decoder.decoder_layer`,
every family's options included) with plain softmax attention over the prefill cache plus a
small cache of the tokens decoded so far (float32 scores, the two parts merged by one joint
softmax). Under `jit` on a mesh this is GSPMD over the sharded cache (the reductions over
the sequence become collectives); it is meant for a few tokens.

Prompts of different lengths share one row length P: each is padded at the front with a
separate pad segment (`pad_front`), so its last token is the row's last and no prompt token
sees the padding; `padded_length` gives a P that the mesh's `sp` and the chunks divide.

Shapes: B rows, P prefill tokens, M decode slots, L layers, K kv heads, Dh head dim, V vocab.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lclm.config import AttentionConfig, ModelConfig
from lclm.data.loader import batch_sharding
from lclm.models import decoder
from lclm.ops.context_parallel import kernel_block, layout_shards
from lclm.ops.ffn import swiglu
from lclm.ops.layout import batch_to_layout, to_layout

F32 = jnp.float32

# chooses decoded token s of every row: (logits `[B, V]` float32, s) -> ids `[B]` int32
Pick = Callable[[jax.Array, int], jax.Array]


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


def _logits(c: ModelConfig, params, x):
    """Float32 logits `[B, V]` of final-layer states x `[B, D]`."""
    h = decoder.rms_norm(x, params["final_norm"], c.norm_eps)
    return jnp.einsum("bd,dv->bv", h, decoder.output_weights(c, params), preferred_element_type=F32)


def prefill(
    c: ModelConfig,
    a: AttentionConfig,
    params,
    tokens,
    positions,
    segment_ids,
    *,
    last: int,
    max_new: int,
    mesh=None,
):
    """Run the prompt; returns (logits `[B, V]` float32 after the token at layout index
    `last`, the `Cache` with `max_new` empty decode slots).

    tokens, positions, segment_ids `[B, P]` in the mesh's layout order (original order
    without a mesh). The layer stack is the model's own, so the hidden states (and logits)
    are exactly those of `decoder.forward`.
    """
    x = decoder.embed(c, params, tokens, mesh)
    rope = decoder.rope_tables(positions, c)

    def layer(x, p):
        x, k, v = decoder.layer_with_kv(c, a, mesh, x, p, rope, segment_ids)
        return x, (k, v)

    x, (k, v) = lax.scan(layer, x, params["layers"])
    visible = segment_ids == segment_ids[:, last : last + 1]
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
    scores = lambda k: jnp.einsum("bhgd,bkhd->bhgk", qg, k, preferred_element_type=F32) * d**-0.5
    s_old = jnp.where(visible[:, None, None, :], scores(cache_k), -jnp.inf)
    s_new = jnp.where(
        (jnp.arange(new_k.shape[1]) < n_new)[None, None, None, :], scores(new_k), -jnp.inf
    )
    m = jnp.maximum(s_old.max(-1), s_new.max(-1))[..., None]  # finite: slot 0 is always seen
    p_old, p_new = jnp.exp(s_old - m), jnp.exp(s_new - m)
    denom = p_old.sum(-1) + p_new.sum(-1)
    o = (
        jnp.einsum("bhgk,bkhd->bhgd", p_old, cache_v.astype(F32))
        + jnp.einsum("bhgk,bkhd->bhgd", p_new, new_v.astype(F32))
    ) / denom[..., None]
    return o.reshape(b, 1, h, d)


def decode_step(c: ModelConfig, params, cache: Cache, token, position, step, *, mesh=None):
    """Feed token `[B]` at RoPE position `[B]` into decode slot `step` (scalar int); returns
    (logits `[B, V]` float32 for the next token, new_k, new_v): only the decode slots are
    returned, so the (large) prompt cache is never copied."""
    x = decoder.embed(c, params, token[:, None], mesh)
    rope = decoder.rope_tables(position[:, None], c)

    def layer(x, inputs):
        p, cache_k, cache_v, new_k, new_v = inputs

        def attend(q, k, v):
            nk = lax.dynamic_update_slice_in_dim(new_k, k.astype(new_k.dtype), step, axis=1)
            nv = lax.dynamic_update_slice_in_dim(new_v, v.astype(new_v.dtype), step, axis=1)
            return _cached_attention(q, cache_k, cache_v, cache.visible, nk, nv, step + 1), nk, nv

        x, new_k, new_v = decoder.decoder_layer(
            c, p, x, rope, attend, lambda h, _, w: swiglu(h, w["w_gate"], w["w_up"], w["w_down"])
        )
        return x, (new_k, new_v)

    layers = (params["layers"], cache.k, cache.v, cache.new_k, cache.new_v)
    x, (new_k, new_v) = lax.scan(layer, x, layers)
    return _logits(c, params, x[:, 0]), new_k, new_v


@functools.lru_cache(maxsize=16)
def _compiled(c: ModelConfig, a: AttentionConfig, mesh, last: int, max_new: int):
    """Jitted (prefill, decode step) for one model, mesh and prompt shape."""
    run_prefill = jax.jit(functools.partial(prefill, c, a, last=last, max_new=max_new, mesh=mesh))
    run_step = jax.jit(functools.partial(decode_step, c, mesh=mesh))
    return run_prefill, run_step


def padded_length(n: int, sp: int, ffn_chunk: int, attention: AttentionConfig) -> int:
    """The smallest P >= n that `sp` divides, whose per-device block P/sp the FFN chunk
    divides and whose attention runs (`kernel_block`: a ring shard, half of one with zigzag,
    the whole sequence under ulysses) the attention chunks divide, each chunk capped at what
    it tiles as the ring and blockwise ops cap it."""
    a, ring = attention, layout_shards(attention, sp)

    def fits(p: int) -> bool:
        if a.layout == "zigzag" and ring > 1 and (p // ring) % 2:
            return False
        run, local = kernel_block(a, sp, p), p // sp
        return local % min(ffn_chunk, local) == 0 and all(
            run % min(c, run) == 0 for c in (a.q_chunk, a.kv_chunk)
        )

    p = -(-n // sp) * sp
    while not fits(p):
        p += sp
    return p


def pad_front(
    prompts: list[np.ndarray], length: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows `[B, length]` (tokens, positions, segment_ids) of prompts right-aligned.

    Padding has segment 0 and the document segment 1, so no document token sees padding;
    document positions run 0..n-1 like a packed training row.
    """
    b = len(prompts)
    tokens = np.full((b, length), pad_id, np.int32)
    positions = np.tile(np.arange(length, dtype=np.int32), (b, 1))
    segments = np.zeros((b, length), np.int32)
    for r, p in enumerate(prompts):
        n = len(p)
        if n > length:
            raise ValueError(f"prompt of {n} tokens does not fit {length}")
        tokens[r, length - n :] = p
        positions[r, length - n :] = np.arange(n)
        segments[r, length - n :] = 1
    return tokens, positions, segments


def greedy(logits, step: int):
    """The most likely token of every row (a `Pick`)."""
    return jnp.argmax(logits, -1).astype(jnp.int32)


def sampler(temperature: float, top_k: int = 0, top_p: float = 1.0, seed: int = 0) -> Pick:
    """A `Pick` drawing from softmax(logits / temperature) over the `top_k` most likely tokens
    (0: all) that are also in the smallest set whose probability reaches `top_p` (1: all).
    Token s is drawn with key fold_in(key(seed), s): a seed gives the same tokens every run."""
    key = jax.random.key(seed)
    return lambda logits, step: _sample(
        logits, jax.random.fold_in(key, step), temperature, top_k, top_p
    )


@jax.jit
def _sample(logits, key, temperature, top_k, top_p):
    """One draw per row from the filtered distribution (see `sampler`); logits `[B, V]`."""
    logits = logits / temperature
    ranked = -jnp.sort(-logits, axis=-1)  # [B, V] most likely first
    probs = jax.nn.softmax(ranked, axis=-1)
    above = jnp.cumsum(probs, -1) - probs  # mass ranked above each token; the first is 0
    rank = jnp.arange(logits.shape[-1])
    keep = ((top_k < 1) | (rank < top_k)) & ((top_p >= 1) | (above < top_p))
    # the least likely kept logit; ties with it are kept as well
    cutoff = jnp.min(jnp.where(keep, ranked, jnp.inf), axis=-1, keepdims=True)
    filtered = jnp.where(logits >= cutoff, logits, -jnp.inf)
    return jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32)


def last_layout_index(layout: str, sp: int, length: int) -> int:
    """Where the final token (original position length-1) sits in `layout` order."""
    order = to_layout(np.arange(length)[None], layout, sp)[0]
    return int(np.flatnonzero(order == length - 1)[0])


def generate(
    c: ModelConfig,
    a: AttentionConfig,
    params,
    tokens,
    positions,
    segment_ids,
    max_new: int,
    mesh=None,
    pick: Pick = greedy,
    stop_ids: Sequence[int] = (),
) -> np.ndarray:
    """Continuation `[B, n]` int32 (n <= max_new) of prompts that end at the last column,
    each token chosen by `pick`. A row ends at its first token in `stop_ids` (EOS, a chat
    template's end of turn): later columns of that row repeat it, and decoding stops once
    every row has ended (n is then the longest row's length), so a short answer costs no
    more steps than it has tokens.

    tokens, positions, segment_ids: numpy `[B, P]` in original order (front padding goes in
    its own segment, see `pad_front`); P must suit the mesh (`sp` and the chunks divide it,
    see `padded_length`) and B the mesh's batch axes. Decoded token s sits at position
    positions[:, -1] + 1 + s.
    """
    sp = 1 if mesh is None else layout_shards(a, mesh.shape["sp"])  # the layout's shards
    layout = a.layout if mesh is not None else "contiguous"
    batch = dict(tokens=tokens, positions=positions, segment_ids=segment_ids)
    batch = {k: np.asarray(v, np.int32) for k, v in batch_to_layout(batch, layout, sp).items()}
    if mesh is not None:
        batch = {k: jax.device_put(v, batch_sharding(mesh)) for k, v in batch.items()}
    run_prefill, run_step = _compiled(
        c, a, mesh, last_layout_index(layout, sp, tokens.shape[1]), max_new
    )
    if max_new < 1:
        raise ValueError(f"max_new={max_new}; decode at least one token")
    logits, cache = run_prefill(params, batch["tokens"], batch["positions"], batch["segment_ids"])
    stops = np.asarray(list(stop_ids), np.int32)
    out = [pick(logits, 0)]
    ended = np.isin(np.asarray(jax.device_get(out[-1])), stops)
    next_position = jnp.asarray(positions[:, -1] + 1, jnp.int32)
    # simulated CPU devices: one program in flight at a time (as in the training loop,
    # overlapping multi-device CPU programs can stall XLA's collective rendezvous)
    sync = jax.block_until_ready if jax.devices()[0].platform == "cpu" else (lambda x: x)
    for s in range(max_new - 1):
        if len(stops) and ended.all():
            break
        logits, new_k, new_v = sync(
            run_step(params, cache, out[-1], next_position + s, jnp.int32(s))
        )
        cache = cache._replace(new_k=new_k, new_v=new_v)
        out.append(sync(pick(logits, s + 1)))
        if len(stops):  # a host read per step: only when there is something to stop at
            ended |= np.isin(np.asarray(jax.device_get(out[-1])), stops)
    ids = np.array(jax.device_get(jnp.stack(out, axis=1)))  # writable: rows are cut below
    for row in ids:
        hit = np.flatnonzero(np.isin(row, stops))
        if len(hit):
            row[hit[0] :] = row[hit[0]]
    return ids


def greedy_generate(
    c: ModelConfig,
    a: AttentionConfig,
    params,
    tokens,
    positions,
    segment_ids,
    max_new: int,
    mesh=None,
    stop_ids: Sequence[int] = (),
) -> np.ndarray:
    """The greedy continuation `[B, n <= max_new]` (`generate` with `greedy`)."""
    return generate(c, a, params, tokens, positions, segment_ids, max_new, mesh, stop_ids=stop_ids)

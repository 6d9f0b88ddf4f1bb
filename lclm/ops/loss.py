"""Cross-entropy over the vocabulary, computed blockwise: logits never exist for the whole
sequence (seed 004). The loss is a global token mean: sum of masked token losses / count."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from lclm.ops.blockwise import split_chunks


def token_losses(h, w_out, targets):
    """h `[..., dim]`, w_out `[dim, vocab]`, targets `[...]` -> float32 losses `[...]`."""
    logits = jnp.einsum("...d,dv->...v", h, w_out, preferred_element_type=jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return lse - picked


def blockwise_cross_entropy(h, w_out, targets, loss_mask, *, chunk: int, n_shards: int = 1,
                            constrain=lambda x, axes: x):
    """Masked cross-entropy sums of `h [batch, seq, dim]` against `targets [batch, seq]`.

    Returns `(loss_sum, token_count)` as float32 scalars over the whole (global) batch; the
    caller divides once, so every unmasked token weighs the same whatever its row or chunk.
    """
    seq_axes = (None, "batch", "seq", None)
    hs = constrain(split_chunks(h, n_shards, chunk), seq_axes + ("act_embed",))
    ts = constrain(split_chunks(targets, n_shards, chunk), seq_axes)
    ms = constrain(split_chunks(loss_mask.astype(jnp.float32), n_shards, chunk), seq_axes)

    @jax.checkpoint
    def chunk_sum(hc, tc, mc):
        return jnp.sum(token_losses(hc, w_out, tc) * mc)

    def body(total, xs):
        return total + chunk_sum(*xs), None

    total, _ = lax.scan(body, jnp.zeros((), jnp.float32), (hs, ts, ms))
    return total, jnp.sum(loss_mask.astype(jnp.float32))

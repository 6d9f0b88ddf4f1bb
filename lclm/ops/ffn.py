"""SwiGLU feed-forward, computed blockwise over the sequence (seed 004)."""

from __future__ import annotations

import jax
from jax import lax

from lclm.ops.blockwise import merge_chunks, split_chunks


def swiglu(x, w_gate, w_up, w_down):
    """x `[..., dim]`, w_gate/w_up `[dim, ffn]`, w_down `[ffn, dim]` -> `[..., dim]`."""
    h = jax.nn.silu(x @ w_gate) * (x @ w_up)
    return h @ w_down


def blockwise_ffn(x, w_gate, w_up, w_down, *, chunk: int, n_shards: int = 1,
                  constrain=lambda x, axes: x):
    """SwiGLU of `x [batch, seq, dim]` one sequence chunk at a time, rematerialised.

    The `[chunk, ffn]` hidden activation exists for one chunk at a time, in the forward and
    (recomputed) in the backward. `n_shards` is the number of `sp` shards of the sequence;
    `constrain(array, logical_axes)` pins the chunked activations' sharding.
    """
    xs = constrain(split_chunks(x, n_shards, chunk), (None, "batch", "seq", None, "act_embed"))
    body = jax.checkpoint(lambda xc: swiglu(xc, w_gate, w_up, w_down))
    ys = lax.map(body, xs)
    return merge_chunks(ys)

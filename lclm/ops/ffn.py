"""SwiGLU feed-forward, computed blockwise over the sequence (Blockwise Parallel Transformer)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from lclm.ops.chunking import merge_chunks, split_chunks

_CHUNK_AXES = (None, "batch", "seq", None, "act_embed")


def swiglu(x, w_gate, w_up, w_down):
    """x `[..., dim]`, w_gate/w_up `[dim, ffn]`, w_down `[ffn, dim]` -> `[..., dim]`."""
    return _swiglu_hidden(x, w_gate, w_up, w_down)[0]


def _swiglu_hidden(x, w_gate, w_up, w_down):
    """(swiglu(x), its (gate, up) projections `[..., ffn]`)."""
    g, u = _projections(x, w_gate, w_up)
    return (jax.nn.silu(g) * u) @ w_down, (g, u)


def weight_grad(a, b):
    """`a [..., m]`, `b [..., n]` -> float32 `[m, n]`, summed over all leading axes: a weight's
    gradient from its input and output cotangent, never rounded to the compute dtype."""
    lead = tuple(range(a.ndim - 1))
    return lax.dot_general(a, b, ((lead, lead), ((), ())), preferred_element_type=jnp.float32)


def blockwise_ffn(
    x,
    w_gate,
    w_up,
    w_down,
    *,
    chunk: int,
    n_shards: int = 1,
    constrain=lambda x, axes: x,
    dtype=None,
    save_hidden: bool = False,
):
    """SwiGLU of `x [batch, seq, dim]` one sequence chunk at a time, rematerialised.

    The `[chunk, ffn]` hidden activation exists for one chunk at a time, in the forward and
    (recomputed) in the backward. With `save_hidden` the forward keeps every chunk's gate and
    up projections instead (compute dtype, `2 x batch x seq x ffn` values) and the backward
    skips the two matmuls that would recompute them (forward and backward: 9 matmuls per
    chunk instead of 11): for runs with the memory to spare (`remat='none'`).

    `n_shards` is the number of `sp` shards of the sequence; `constrain(array,
    logical_axes)` pins the chunked activations' sharding. With `dtype` the weights are cast
    to it for the matmuls (pass float32 parameters: their gradients stay float32 end to end);
    without it they are used as given.

    The weight gradients are summed over the chunks in float32 (each chunk's contribution is a
    matmul with float32 output), whatever the compute dtype, and returned in the weights' own
    dtype: a bfloat16 running sum would lose more precision with every chunk.
    """
    return _blockwise_ffn(chunk, n_shards, constrain, dtype, save_hidden, x, (w_gate, w_up, w_down))


def _cast(ws, dtype):
    return ws if dtype is None else tuple(w.astype(dtype) for w in ws)


def _projections(xc, w_gate, w_up):
    """A chunk's gate and up projections `[..., ffn]`."""
    return xc @ w_gate, xc @ w_up


def _chunks_forward(chunk, n_shards, constrain, dtype, x, ws, save_hidden):
    """(y, the chunks' (gate, up) `[n_chunks, ..., chunk, ffn]` or None)."""
    w_gate, w_up, w_down = _cast(ws, dtype)
    xs = constrain(split_chunks(x, n_shards, chunk), _CHUNK_AXES)

    def one(xc):
        y, hidden = _swiglu_hidden(xc, w_gate, w_up, w_down)
        return y, (hidden if save_hidden else None)

    ys, hidden = lax.map(one, xs)
    return merge_chunks(ys), hidden


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _blockwise_ffn(chunk, n_shards, constrain, dtype, save_hidden, x, ws):
    return _chunks_forward(chunk, n_shards, constrain, dtype, x, ws, False)[0]


def _blockwise_ffn_fwd(chunk, n_shards, constrain, dtype, save_hidden, x, ws):
    # residuals: the inputs, and with save_hidden each chunk's gate and up projections
    y, hidden = _chunks_forward(chunk, n_shards, constrain, dtype, x, ws, save_hidden)
    return y, (x, ws, hidden)


def _blockwise_ffn_bwd(chunk, n_shards, constrain, dtype, save_hidden, res, dy):
    x, ws, hidden = res
    w_gate, w_up, w_down = _cast(ws, dtype)
    xs = constrain(split_chunks(x, n_shards, chunk), _CHUNK_AXES)
    dys = constrain(split_chunks(dy, n_shards, chunk), _CHUNK_AXES)

    def body(acc, inputs):
        xc, dyc, saved = inputs
        # the activations' cotangents exactly as autodiff of `swiglu` computes them ...
        (g, u), input_vjp = jax.vjp(lambda xc: _projections(xc, w_gate, w_up), xc)
        if saved is not None:  # XLA drops the recomputed projections: nothing reads them
            g, u = saved
        h, act_vjp = jax.vjp(lambda g, u: jax.nn.silu(g) * u, g, u)
        (dh,) = jax.vjp(lambda h: h @ w_down, h)[1](dyc)
        dg, du = act_vjp(dh)
        (dxc,) = input_vjp((dg, du))
        # ... and the weights' as float32 matmuls, added to float32 sums
        grads = (weight_grad(xc, dg), weight_grad(xc, du), weight_grad(h, dyc))
        return tuple(a + g for a, g in zip(acc, grads)), dxc

    zeros = tuple(jnp.zeros(w.shape, jnp.float32) for w in ws)
    sums, dxs = lax.scan(body, zeros, (xs, dys, hidden))
    dx = merge_chunks(constrain(dxs, _CHUNK_AXES))
    return dx, tuple(s.astype(w.dtype) for s, w in zip(sums, ws))


_blockwise_ffn.defvjp(_blockwise_ffn_fwd, _blockwise_ffn_bwd)

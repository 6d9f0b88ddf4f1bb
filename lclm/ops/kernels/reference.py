"""Dense attention: the float32 reference every kernel and the ring are tested against.

Not a kernel (no block pairs, no skipped tiles): it materialises the `[tq, tk]` scores, so it
serves tests, `bench.correctness` and the dense baseline of `bench.max_context`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lclm.ops.kernels.contract import F32


def dense_attention(
    q,
    k,
    v,
    *,
    causal: bool = True,
    segment_ids=None,
    positions=None,
    k_positions=None,
    k_segment_ids=None,
):
    """Plain float32 softmax attention: the reference every blockwise path is tested against.

    q `[b, tq, h, d]`, k/v `[b, tk, kv_heads, d]`, segment_ids `[b, tq]`, positions `[tq]`
    (original positions of the given order; default arange). The keys' own positions and
    segment ids (`[tk]`, `[b, tk]`) default to the queries' (self-attention). Rows with
    nothing visible give 0. Materialises `[tq, tk]` scores.
    """
    q, k, v = (x.astype(F32) for x in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    pos = jnp.arange(q.shape[1]) if positions is None else positions
    k_pos = pos if k_positions is None else k_positions
    k_seg = segment_ids if k_segment_ids is None else k_segment_ids
    mask = jnp.ones((1, 1, q.shape[1], k.shape[1]), bool)
    if causal:
        mask = mask & (pos[:, None] >= k_pos[None, :])[None, None]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, None, :, None] == k_seg[:, None, None, :])
    s = jnp.where(mask, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(mask, p, 0.0)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)

"""Masks as per-query key ranges: the form range-based fused kernels take (k_start, k_end).

Inside any ring round of lclm's layouts, the keys a query may see are one contiguous run of
the local key indices: every layout keeps key positions increasing along a block, and packed
documents are contiguous in original order (segment ids never decrease along a row), so
"same document and not after the query" is an interval. `key_ranges` computes it per query
with binary searches; `ranges_mask` expands ranges back to a dense mask (tests compare it
with the positions-and-segments mask every kernel implements).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

I32 = jnp.int32


def key_ranges(q_pos, k_pos, q_seg=None, k_seg=None, *, causal: bool = True):
    """Visible keys of each query as `[k_start, k_end)` local key indices (empty: equal).

    q_pos `[tq]`, k_pos `[tk]` int original positions (k_pos increasing); q_seg `[batch, tq]`,
    k_seg `[batch, tk]` segment ids (non-decreasing along k) or None. Returns int32 arrays
    `[batch, tq]` (`[1, tq]` without segments).
    """
    tq, tk = q_pos.shape[0], k_pos.shape[0]
    start = jnp.zeros((1, tq), I32)
    end = (
        jnp.searchsorted(k_pos, q_pos, side="right").astype(I32)[None]
        if causal
        else jnp.full((1, tq), tk, I32)
    )
    if q_seg is not None:
        start = jnp.maximum(start, segment_starts(q_seg, k_seg))
        end = jnp.minimum(end, segment_starts(q_seg, k_seg, side="right"))
    return start, jnp.maximum(end, start)


def segment_starts(q_seg, k_seg, side: str = "left"):
    """Per query, the first key of its segment `[batch, tq]` int32 (`side='right'`: one past
    the last). k_seg `[batch, tk]` never decreasing, q_seg `[batch, tq]`."""
    search = jax.vmap(lambda ks, qs: jnp.searchsorted(ks, qs, side=side))
    return search(k_seg, q_seg).astype(I32)


def ranges_mask(k_start, k_end, tk: int):
    """Dense visibility `[batch, tq, tk]` bool of per-query ranges `[batch, tq]`."""
    k = jnp.arange(tk)
    return (k >= k_start[..., None]) & (k < k_end[..., None])

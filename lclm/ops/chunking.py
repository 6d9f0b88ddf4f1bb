"""Chunking of a sequence axis that is sharded over `sp`, for blockwise (rematerialised) ops.

`[b, t, ...]` with t split into `n` contiguous shards becomes `[chunks, b, n, c, ...]`: the
scan runs over `chunks`, every device walking its own shard, so no data moves between
devices and only one chunk's intermediates are alive at a time.
"""

from __future__ import annotations

import jax.numpy as jnp


def chunk_size(local_len: int, chunk: int) -> int:
    c = min(chunk, local_len)
    if local_len % c:
        raise ValueError(f"local sequence length {local_len} is not divisible by chunk {c}")
    return c


def split_chunks(x, n_shards: int, chunk: int):
    """`[b, t, ...]` -> `[t/(n*c), b, n, c, ...]` (c = effective chunk)."""
    b, t = x.shape[:2]
    c = chunk_size(t // n_shards, chunk)
    x = x.reshape((b, n_shards, t // n_shards // c, c) + x.shape[2:])
    return jnp.moveaxis(x, 2, 0)


def merge_chunks(x):
    """Inverse of `split_chunks`."""
    x = jnp.moveaxis(x, 0, 2)
    b, n, k, c = x.shape[:4]
    return x.reshape((b, n * k * c) + x.shape[4:])

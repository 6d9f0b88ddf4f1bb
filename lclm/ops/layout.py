"""Token layouts over the sequence-parallel axis, and the masks they imply.

A layout is the order in which the tokens of a row are stored before the sequence axis is
split into `n` equal contiguous shards (one per `sp` device).

- `'contiguous'`: original order; device j holds positions j*c ... j*c + c - 1.
- `'striped'`: device j holds positions j, j+n, j+2n, ... so local index x on device j is
  original position x*n + j (Striped Attention).
- `'zigzag'`: the row is cut into 2n equal chunks and device j holds chunks j and 2n-1-j (in
  that order). Under a causal mask every ring round is then exactly half of a block pair, as
  full rectangles: from a device k < j both query halves see the first key half; from k > j
  the second query half sees all keys (the load balance of striping with contiguous tiles).

Striping is applied once on the host, to every per-token array of a batch together, and
`unstripe` puts any per-token output back into original order. Attention masks are derived
from original positions (`original_positions`), so the model itself never sees the layout.
"""

from __future__ import annotations

import numpy as np

from lclm.config.model import LAYOUTS


def _check(length: int, n: int) -> None:
    if n < 1 or length % n:
        raise ValueError(f"sequence length {length} is not divisible by the sp size {n}")


def stripe(x, n: int, axis: int = 1):
    """Reorder `x` along `axis` so that contiguous shards of `n` devices hold strided tokens.

    Works on numpy and jax arrays. Output position d*L + x holds input position x*n + d,
    with L = length // n.
    """
    length = x.shape[axis]
    _check(length, n)
    if n == 1:
        return x
    ax = axis % x.ndim
    shape = x.shape[:ax] + (length // n, n) + x.shape[ax + 1 :]
    y = x.reshape(shape)
    y = y.swapaxes(ax, ax + 1)
    return y.reshape(x.shape)


def unstripe(x, n: int, axis: int = 1):
    """Inverse of `stripe`: put a striped per-token array back into original order."""
    length = x.shape[axis]
    _check(length, n)
    if n == 1:
        return x
    ax = axis % x.ndim
    shape = x.shape[:ax] + (n, length // n) + x.shape[ax + 1 :]
    y = x.reshape(shape)
    y = y.swapaxes(ax, ax + 1)
    return y.reshape(x.shape)


def _identity(x, n: int, axis: int = 1):
    _check(x.shape[axis], n)
    return x


def _zigzag_chunks(n: int) -> np.ndarray:
    """Chunk order of the zigzag layout: [0, 2n-1, 1, 2n-2, ..., n-1, n]."""
    return np.stack([np.arange(n), 2 * n - 1 - np.arange(n)], axis=1).reshape(-1)


def _by_chunks(x, order: np.ndarray, axis: int):
    """Reorder `x`'s `axis`, cut into len(order) equal chunks, as `order` says."""
    length, parts = x.shape[axis], len(order)
    if length % parts:
        raise ValueError(
            f"sequence length {length} is not divisible by 2 x the sp size "
            f"({parts}), as the zigzag layout needs"
        )
    ax = axis % x.ndim
    y = x.reshape(x.shape[:ax] + (parts, length // parts) + x.shape[ax + 1 :])
    return y.take(order, axis=ax).reshape(x.shape)


def zigzag(x, n: int, axis: int = 1):
    """Original order -> zigzag: shard j of `n` holds chunks j and 2n-1-j of 2n."""
    return x if n == 1 else _by_chunks(x, _zigzag_chunks(n), axis)


def unzigzag(x, n: int, axis: int = 1):
    """Inverse of `zigzag`."""
    return x if n == 1 else _by_chunks(x, np.argsort(_zigzag_chunks(n)), axis)


# layout -> (original order -> layout, layout -> original order)
_PERMUTATIONS = {
    "striped": (stripe, unstripe),
    "contiguous": (_identity, _identity),
    "zigzag": (zigzag, unzigzag),
}


def _permutation(layout: str, inverse: bool):
    if layout not in _PERMUTATIONS:
        raise ValueError(f"unknown layout {layout!r}; use one of {LAYOUTS}")
    return _PERMUTATIONS[layout][int(inverse)]


def to_layout(x, layout: str, n: int, axis: int = 1):
    """Put an array in original token order into `layout` for `n` sequence shards."""
    return _permutation(layout, inverse=False)(x, n, axis)


def from_layout(x, layout: str, n: int, axis: int = 1):
    """Inverse of `to_layout`."""
    return _permutation(layout, inverse=True)(x, n, axis)


def original_positions(layout: str, n: int, device, local_len: int, xp=np):
    """Original token positions `[local_len]` held by sequence shard `device` (may be traced).

    `xp` is the array module (numpy on the host, jax.numpy inside a traced ring).
    """
    local = xp.arange(local_len, dtype=np.int32)
    if layout == "striped":
        return local * n + device
    if layout == "contiguous":
        return device * local_len + local
    if layout == "zigzag":
        half = local_len // 2
        return xp.where(
            local < half, device * half + local, (2 * n - 1 - device) * half + local - half
        )
    raise ValueError(f"unknown layout {layout!r}; use one of {LAYOUTS}")


def batch_to_layout(batch: dict, layout: str, n: int) -> dict:
    """Apply `to_layout` to every per-token `[batch, seq]` array of a batch, together."""
    return {k: to_layout(v, layout, n, axis=1) for k, v in batch.items()}

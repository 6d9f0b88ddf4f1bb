"""Token layouts over the sequence-parallel axis, and the masks they imply.

A layout is the order in which the tokens of a row are stored before the sequence axis is
split into `n` equal contiguous shards (one per `sp` device).

- `'contiguous'`: original order; device j holds positions j*c ... j*c + c - 1.
- `'striped'`: device j holds positions j, j+n, j+2n, ... so local index x on device j is
  original position x*n + j (Striped Attention, seed 000).

Striping is applied once on the host, to every per-token array of a batch together, and
`unstripe` puts any per-token output back into original order. Attention masks are derived
from original positions (`original_positions`), so the model itself never sees the layout.
"""

from __future__ import annotations

import numpy as np

LAYOUTS = ("striped", "contiguous")


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
    shape = x.shape[:ax] + (length // n, n) + x.shape[ax + 1:]
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
    shape = x.shape[:ax] + (n, length // n) + x.shape[ax + 1:]
    y = x.reshape(shape)
    y = y.swapaxes(ax, ax + 1)
    return y.reshape(x.shape)


def _identity(x, n: int, axis: int = 1):
    _check(x.shape[axis], n)
    return x


# layout -> (original order -> layout, layout -> original order)
_PERMUTATIONS = {"striped": (stripe, unstripe), "contiguous": (_identity, _identity)}


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
    raise ValueError(f"unknown layout {layout!r}; use one of {LAYOUTS}")


def batch_to_layout(batch: dict, layout: str, n: int) -> dict:
    """Apply `to_layout` to every per-token `[batch, seq]` array of a batch, together."""
    return {k: to_layout(v, layout, n, axis=1) for k, v in batch.items()}

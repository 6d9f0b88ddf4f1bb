"""A ring-ready block-pair kernel built on a fused attention that takes masks as key ranges.

Fused GPU kernels such as tokamax's Mosaic GPU flash attention take a mask as per-query key
ranges `[k_start, k_end)` plus a causal flag, and skip hidden tiles in their backward only for
the plain causal mask. `range_kernel(attend, attend_vjp)` turns such a pair of functions into
lclm's `Kernel` (see `lclm.ops.attention`) by classifying each block pair from its positions
(a few reductions) and running, with `lax.switch`, the call that does exactly its work on
static slices:

- `hidden`: nothing visible: o = 0, lse = -inf, zero gradients, no call;
- `causal`: local query x sees keys y <= x (diagonal rounds; striped rounds from k <= j);
- `strict`: y < x (striped rounds from k > j): causal over the keys shifted one place later,
  index 0 hidden by k_start >= 1, so the backward still skips tiles;
- `full`: every key before every query (contiguous rounds from k < j);
- `key half` / `query half` (zigzag rounds off the diagonal): full attention of all queries
  to the first half of the keys / of the second half of the queries to all keys;
- `ranges`: anything else (and non-causal attention): exact ranges from `key_ranges`.

Packed documents: in every class but `ranges` the visible keys precede (or equal) the query
in position, so with segment ids non-decreasing along a row (lclm's packing) a query's
document is cut out by `k_start` alone: the first key of its segment.

`attend(q, k, v, causal, k_start, k_end) -> (o, lse)`: q `[b, tq, h, d]`, k/v `[b, tk, hkv, d]`,
k_start/k_end int32 `[b, tq]` or None, causal a Python bool; o `[b, tq, h, d]` (any float
dtype), lse `[b, tq, h]` float32 natural log (-inf for rows with nothing visible).
`attend_vjp(q, k, v, o, lse, do, causal, k_start, k_end) -> (dq, dk, dv)` with the *global*
o and lse (finite where the row sees anything anywhere).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from lclm.ops.attention import F32, Kernel
from lclm.ops.key_ranges import key_ranges

CLASSES = ("hidden", "causal", "strict", "full", "key half", "query half", "ranges")


def round_class(q_pos, k_pos, causal: bool = True):
    """Index into `CLASSES` of a block pair with (increasing) positions q_pos `[tq]`, k_pos
    `[tk]`: a traced int32 scalar (the first class whose pattern the positions match)."""
    if not causal:
        return jnp.int32(CLASSES.index("ranges"))
    tq, tk = q_pos.shape[0], k_pos.shape[0]
    no = jnp.bool_(False)
    square = tq == tk
    hq, hk = tq // 2, tk // 2
    tests = {
        "hidden": q_pos.max() < k_pos.min(),
        "causal": (jnp.all(q_pos >= k_pos) & jnp.all(q_pos[:-1] < k_pos[1:])) if square else no,
        "strict": (jnp.all(q_pos < k_pos) & jnp.all(q_pos[1:] >= k_pos[:-1])) if square else no,
        "full": k_pos.max() <= q_pos.min(),
        "key half": ((k_pos[:hk].max() <= q_pos.min()) & (k_pos[hk:].min() > q_pos.max())
                     if tk % 2 == 0 and tk > 1 else no),
        "query half": ((q_pos[:hq].max() < k_pos.min()) & (q_pos[hq:].min() >= k_pos.max())
                       if tq % 2 == 0 and tq > 1 else no),
        "ranges": jnp.bool_(True),
    }
    return jnp.argmax(jnp.stack([tests[c] for c in CLASSES])).astype(jnp.int32)


def _doc_start(q_seg, k_seg):
    """First key of each query's segment `[b, tq]` int32 (None without segments)."""
    if q_seg is None:
        return None
    first = jax.vmap(lambda ks, qs: jnp.searchsorted(ks, qs, side="left"))
    return first(k_seg, q_seg).astype(jnp.int32)


def _sees_nothing(q_pos, k_pos, q_seg, k_seg, causal: bool, batch: int):
    """`[b, tq]` bool: queries with no visible key in this pair. They get o = 0, lse = -inf
    and no gradient, as the contract says, even from an op that fills empty rows otherwise."""
    start, end = key_ranges(q_pos, k_pos, q_seg, k_seg, causal=causal)
    return jnp.broadcast_to(end <= start, (batch, q_pos.shape[0]))


def _shift_keys(x):
    """Keys one place later along axis 1 (index 0 repeats the first key; it is never
    visible): a strictly causal round becomes a causal one."""
    return None if x is None else jnp.concatenate([x[:, :1], x[:, :-1]], axis=1)


def _unshift(dx):
    """Gradients of shifted keys back to the original places (the last key saw nothing)."""
    return jnp.concatenate([dx[:, 1:], jnp.zeros_like(dx[:, :1])], axis=1)


def _at_least(start, n: int, shape):
    return jnp.full(shape, n, jnp.int32) if start is None else jnp.maximum(start, n)


def range_kernel(attend, attend_vjp) -> Kernel:
    """lclm's block-pair `Kernel` from a range-mask attention and its VJP (module docstring)."""

    def forward(q, k, v, q_pos, k_pos, q_seg, k_seg, *, causal, q_chunk, kv_chunk):
        del q_chunk, kv_chunk  # the fused kernel picks its own tiles
        b, tq, h, d = q.shape
        hq, hk = tq // 2, k.shape[1] // 2

        def call(q, k, v, causal, start, end=None):
            o, lse = attend(q, k, v, causal, start, end)
            return o.astype(F32), lse.astype(F32)

        def nothing(rows):
            return jnp.zeros((b, rows, h, d), F32), jnp.full((b, rows, h), -jnp.inf, F32)

        def ranges():
            start, end = key_ranges(q_pos, k_pos, q_seg, k_seg, causal=causal)
            return call(q, k, v, False, jnp.broadcast_to(start, (b, tq)),
                        jnp.broadcast_to(end, (b, tq)))

        def query_half():
            o, lse = call(q[:, hq:], k, v, False,
                          _doc_start(None if q_seg is None else q_seg[:, hq:], k_seg))
            zero_o, zero_lse = nothing(hq)
            return (jnp.concatenate([zero_o, o], axis=1),
                    jnp.concatenate([zero_lse, lse], axis=1))

        # every branch is traced whatever the class: the halves only exist for even lengths
        halves = tq % 2 == 0 and k.shape[1] % 2 == 0 and min(tq, k.shape[1]) > 1
        branches = [
            lambda: nothing(tq),
            lambda: call(q, k, v, True, _doc_start(q_seg, k_seg)),
            lambda: call(q, _shift_keys(k), _shift_keys(v), True,
                         _at_least(_doc_start(q_seg, _shift_keys(k_seg)), 1, (b, tq))),
            lambda: call(q, k, v, False, _doc_start(q_seg, k_seg)),
            (lambda: call(q, k[:, :hk], v[:, :hk], False,
                          _doc_start(q_seg, None if k_seg is None else k_seg[:, :hk])))
            if halves else ranges,
            query_half if halves else ranges,
            ranges,
        ]
        o, lse = lax.switch(round_class(q_pos, k_pos, causal), branches)
        blind = _sees_nothing(q_pos, k_pos, q_seg, k_seg, causal, b)
        return (jnp.where(blind[..., None, None], 0.0, o),
                jnp.where(blind[..., None], -jnp.inf, lse))

    def backward(q, k, v, o, lse, do, q_pos, k_pos, q_seg, k_seg, *, causal, q_chunk,
                 kv_chunk):
        del q_chunk, kv_chunk
        tq = q.shape[1]
        hq, hk = tq // 2, k.shape[1] // 2
        lse = jnp.where(jnp.isfinite(lse), lse, 0.0)  # rows that see nothing anywhere
        # rows that see nothing in this pair contribute nothing, whatever the op does with them
        blind = _sees_nothing(q_pos, k_pos, q_seg, k_seg, causal, q.shape[0])
        do = jnp.where(blind[..., None, None], jnp.zeros_like(do), do)
        halves = tq % 2 == 0 and k.shape[1] % 2 == 0 and min(tq, k.shape[1]) > 1

        def call(q, k, v, o, lse, do, causal, start, end=None):
            return tuple(g.astype(F32) for g in
                         attend_vjp(q, k, v, o, lse, do, causal, start, end))

        def zeros():
            return (jnp.zeros(q.shape, F32), jnp.zeros(k.shape, F32), jnp.zeros(v.shape, F32))

        def strict():
            start = _at_least(_doc_start(q_seg, _shift_keys(k_seg)), 1, q.shape[:2])
            dq, dk, dv = call(q, _shift_keys(k), _shift_keys(v), o, lse, do, True, start)
            return dq, _unshift(dk), _unshift(dv)

        def key_half():
            start = _doc_start(q_seg, None if k_seg is None else k_seg[:, :hk])
            dq, dk, dv = call(q, k[:, :hk], v[:, :hk], o, lse, do, False, start)
            pad = lambda g: jnp.concatenate([g, jnp.zeros_like(g)], axis=1)
            return dq, pad(dk), pad(dv)

        def query_half():
            start = _doc_start(None if q_seg is None else q_seg[:, hq:], k_seg)
            dq, dk, dv = call(q[:, hq:], k, v, o[:, hq:], lse[:, hq:], do[:, hq:], False, start)
            return jnp.concatenate([jnp.zeros_like(dq), dq], axis=1), dk, dv

        def ranges():
            start, end = key_ranges(q_pos, k_pos, q_seg, k_seg, causal=causal)
            shape = q.shape[:2]
            return call(q, k, v, o, lse, do, False, jnp.broadcast_to(start, shape),
                        jnp.broadcast_to(end, shape))

        branches = [
            zeros,
            lambda: call(q, k, v, o, lse, do, True, _doc_start(q_seg, k_seg)),
            strict,
            lambda: call(q, k, v, o, lse, do, False, _doc_start(q_seg, k_seg)),
            key_half if halves else ranges,
            query_half if halves else ranges,
            ranges,
        ]
        dq, dk, dv = lax.switch(round_class(q_pos, k_pos, causal), branches)
        return jnp.where(blind[..., None, None], 0.0, dq), dk, dv

    return Kernel(forward, backward)

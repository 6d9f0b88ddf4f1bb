"""A ring-ready block-pair kernel built on a fused attention that takes masks as key ranges.

Fused GPU kernels such as tokamax's Mosaic GPU flash attention take a mask as per-query key
ranges `[k_start, k_end)` plus a causal flag, and skip hidden tiles in their backward only for
the plain causal mask. `range_kernel(attend, attend_vjp)` turns such a pair of functions into
lclm's `Kernel` (see `lclm.ops.kernels.contract`) by classifying each block pair from its positions
(a few reductions) and running the call that does exactly its work on static slices:

- `hidden`: nothing visible: o = 0, lse = -inf, zero gradients, no call;
- `causal`: local query x sees keys y <= x (diagonal rounds; striped rounds from k <= j);
- `strict`: y < x (striped rounds from k > j): causal over the keys shifted one place later,
  index 0 hidden by k_start >= 1, so the backward still skips tiles;
- `full`: every key before every query (contiguous rounds from k < j);
- `key half` / `query half` (zigzag rounds off the diagonal): full attention of all queries
  to the first half of the keys / of the second half of the queries to all keys;
- `ranges`: anything else (and non-causal attention): exact ranges from `key_ranges` (none
  at all, k_start = k_end = None, for non-causal attention without segments: every key).

One compiled branch where the class is known: XLA compiles every branch of a `lax.switch`
(each a fused-kernel call in the forward and the backward) and XLA:GPU reads the index of
each executed one on the host. So the class is picked in Python whenever it is known while
tracing: from concrete positions (numpy, or a call outside `jit`), or from `classes=`, the
classes a call site can meet, which the ring derives on the host from its layout with
`RangeKernel.classify` (positions inside the ring are traced: they depend on
`lax.axis_index`). One class (sp=1, non-causal): a direct call; several (the ring's devices
differ, e.g. striped rounds from k < j and k > j): a `lax.switch` over those only; unknown
(traced positions, no `classes`): over all.

Packed documents: in every class but `ranges` the visible keys precede (or equal) the query
in position, so with segment ids non-decreasing along a row (lclm's packing) a query's
document is cut out by `k_start` alone: the first key of its segment. With
`skip_zero_starts`, a call whose k_start is 0 for every query (no document begins inside the
block after its first key: one document per row) runs without it, chosen by a `lax.cond`
(two compiled calls per call site; on XLA:GPU one host sync per call, as it reads the
predicate): for ops that pay for a range on every tile.

`attend(q, k, v, causal, k_start, k_end) -> (o, lse)`: q `[b, tq, h, d]`, k/v `[b, tk, hkv, d]`,
k_start/k_end int32 `[b, tq]` or None, causal a Python bool; o `[b, tq, h, d]` (any float
dtype), lse `[b, tq, h]` float32 natural log (-inf for rows with nothing visible).
`attend_vjp(q, k, v, o, lse, do, causal, k_start, k_end) -> (dq, dk, dv)` with the *global*
o and lse (finite where the row sees anything anywhere).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lclm.ops.kernels.contract import F32, Kernel, serves_any
from lclm.ops.kernels.key_ranges import key_ranges, segment_starts

CLASSES = ("hidden", "causal", "strict", "full", "key half", "query half", "ranges")


def _patterns(q_pos, k_pos, xp):
    """Whether the block pair matches each class's pattern, bool `[len(CLASSES)]`, computed
    with the array module `xp` (jax.numpy while tracing, numpy on the host)."""
    tq, tk = q_pos.shape[0], k_pos.shape[0]
    no = xp.bool_(False)
    square = tq == tk
    hq, hk = tq // 2, tk // 2
    tests = {
        "hidden": q_pos.max() < k_pos.min(),
        "causal": (xp.all(q_pos >= k_pos) & xp.all(q_pos[:-1] < k_pos[1:])) if square else no,
        "strict": (xp.all(q_pos < k_pos) & xp.all(q_pos[1:] >= k_pos[:-1])) if square else no,
        "full": k_pos.max() <= q_pos.min(),
        "key half": (
            (k_pos[:hk].max() <= q_pos.min()) & (k_pos[hk:].min() > q_pos.max())
            if tk % 2 == 0 and tk > 1
            else no
        ),
        "query half": (
            (q_pos[:hq].max() < k_pos.min()) & (q_pos[hq:].min() >= k_pos.max())
            if tq % 2 == 0 and tq > 1
            else no
        ),
        "ranges": xp.bool_(True),
    }
    return xp.stack([tests[c] for c in CLASSES])


def round_class(q_pos, k_pos, causal: bool = True):
    """Index into `CLASSES` of a block pair with (increasing) positions q_pos `[tq]`, k_pos
    `[tk]`: a traced int32 scalar (the first class whose pattern the positions match)."""
    if not causal:
        return jnp.int32(CLASSES.index("ranges"))
    return jnp.argmax(_patterns(q_pos, k_pos, jnp)).astype(jnp.int32)


def pair_class(q_pos, k_pos, causal: bool = True) -> str:
    """`round_class` of concrete positions (numpy, or jax arrays outside `jit`), on the host:
    the class's name."""
    if not causal:
        return "ranges"
    return CLASSES[int(np.argmax(_patterns(np.asarray(q_pos), np.asarray(k_pos), np)))]


def _host(x):
    """x as a numpy array, or None while it is traced (its values unknown until run)."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def possible_classes(q_pos, k_pos, causal: bool, classes=None) -> list[int]:
    """Indices into `CLASSES` (sorted) of the classes a block pair can be in while tracing:
    `classes` (names) where the caller knows them, the one class of concrete positions (or of
    non-causal attention), else all of them."""
    if not causal:
        classes = ("ranges",)
    elif classes is None:
        q_host, k_host = _host(q_pos), _host(k_pos)
        known = q_host is not None and k_host is not None
        classes = (pair_class(q_host, k_host, causal),) if known else CLASSES
    return sorted({CLASSES.index(c) for c in classes})


def _by_class(possible: list[int], q_pos, k_pos, causal: bool, branches):
    """`branches[c]()` for the block pair's class c: a direct call when only one class is
    possible (no conditional in the program), else a `lax.switch` over the possible ones."""
    if len(possible) == 1:
        return branches[possible[0]]()
    slot = np.zeros(len(CLASSES), np.int32)  # class index -> position among the branches
    slot[possible] = np.arange(len(possible))
    return lax.switch(
        jnp.asarray(slot)[round_class(q_pos, k_pos, causal)], [branches[c] for c in possible]
    )


def _doc_start(q_seg, k_seg):
    """First key of each query's segment `[b, tq]` int32 (None without segments)."""
    return None if q_seg is None else segment_starts(q_seg, k_seg)


def _shift_keys(x):
    """Keys one place later along axis 1 (index 0 repeats the first key; it is never
    visible): a strictly causal round becomes a causal one."""
    return None if x is None else jnp.concatenate([x[:, :1], x[:, :-1]], axis=1)


def _unshift(dx):
    """Gradients of shifted keys back to the original places (the last key saw nothing)."""
    return jnp.concatenate([dx[:, 1:], jnp.zeros_like(dx[:, :1])], axis=1)


def _first_half(x):
    return None if x is None else x[:, : x.shape[1] // 2]


def _pad_half(dx):
    """Gradients of the first half of the keys back to all of them (the rest saw nothing)."""
    return jnp.concatenate([dx, jnp.zeros_like(dx)], axis=1)


# how a call sees the keys, and how its key gradients go back to the block's places
_KEYS = {
    "all": (lambda x: x, lambda dx: dx),
    "first half": (_first_half, _pad_half),
    "shifted": (_shift_keys, _unshift),
}


class _Call(NamedTuple):
    """The one attention call that does a class's work: queries `rows`, keys as `keys` says
    (`_KEYS`), and the mask (causal flag, k_start / k_end `[b, len(rows)]` or None)."""

    rows: slice
    keys: str
    causal: bool
    start: jax.Array | None
    end: jax.Array | None = None


def _calls(q_pos, k_pos, q_seg, k_seg, causal: bool, shape):
    """(per class of `CLASSES`: a function giving its `_Call`, or None for nothing visible;
    `[b, tq]` bool of the queries that see nothing in this pair). `shape` is q's `[b, tq]`."""
    start, end = key_ranges(q_pos, k_pos, q_seg, k_seg, causal=causal)
    blind = jnp.broadcast_to(end <= start, shape)
    tq, tk = shape[1], k_pos.shape[0]
    every = slice(None)
    ranges = lambda: _Call(
        every, "all", False, jnp.broadcast_to(start, shape), jnp.broadcast_to(end, shape)
    )
    if q_seg is None and not causal:  # every key for every query: no ranges to pass
        ranges = lambda: _Call(every, "all", False, None)
    # a switch traces every possible branch, whatever the class: halves need even lengths
    halves = tq % 2 == 0 and tk % 2 == 0 and min(tq, tk) > 1
    late = slice(tq // 2, None)
    calls = [
        None,
        lambda: _Call(every, "all", True, _doc_start(q_seg, k_seg)),
        lambda: _Call(
            every, "shifted", True, _at_least(_doc_start(q_seg, _shift_keys(k_seg)), 1, shape)
        ),
        lambda: _Call(every, "all", False, _doc_start(q_seg, k_seg)),
        (lambda: _Call(every, "first half", False, _doc_start(q_seg, _first_half(k_seg))))
        if halves
        else ranges,
        (
            lambda: _Call(
                late, "all", False, _doc_start(None if q_seg is None else q_seg[:, late], k_seg)
            )
        )
        if halves
        else ranges,
        ranges,
    ]
    return calls, blind


def _place(x, rows: slice, fill):
    """A call's per-query result `[b, rows, ...]` at its rows of the block: the queries before
    `rows.start` (the zigzag query half) get `fill`."""
    if not rows.start:
        return x
    return jnp.concatenate(
        [jnp.full((x.shape[0], rows.start) + x.shape[2:], fill, x.dtype), x], axis=1
    )


# True while the ring traces a whole sequence known to hold several documents in some row
# (`rounds.Settings.several_documents`: cuDNN's fallback for rows of many documents): a k_start
# that is 0 for every query is then impossible, and `skip_zero_starts`' conditional dead code
_SEVERAL_DOCUMENTS = contextvars.ContextVar("lclm_several_documents", default=False)


@contextlib.contextmanager
def several_documents(known: bool):
    """Within (while tracing): some row of the block holds more than one document, so calls
    run with their k_start and no conditional (`known` False: no effect)."""
    token = _SEVERAL_DOCUMENTS.set(known or _SEVERAL_DOCUMENTS.get())
    try:
        yield
    finally:
        _SEVERAL_DOCUMENTS.reset(token)


def _at_least(start, n: int, shape):
    return jnp.full(shape, n, jnp.int32) if start is None else jnp.maximum(start, n)


class RangeKernel(Kernel):
    """A `Kernel` made by `range_kernel`: its passes also take `classes=`, the names (of
    `CLASSES`) of the classes a call site can meet, and `classify(q_pos, k_pos, causal)`
    (numpy positions) gives a block pair's class, so that a caller with static knowledge (the
    ring: its layout, every device and round a call site serves) can compute them."""

    __slots__ = ()
    classify = staticmethod(pair_class)


def range_kernel(
    attend, attend_vjp, limits=serves_any, *, skip_zero_starts: bool = False
) -> RangeKernel:
    """lclm's block-pair `Kernel` from a range-mask attention and its VJP (module docstring)
    and the op's `limits` (`contract.Kernel.limits`). Rows that see nothing in a pair get
    o = 0, lse = -inf and no gradient, as the contract says, even from an op that fills empty
    rows otherwise. `skip_zero_starts`: see the module docstring."""

    def masked(call: _Call, op):
        """op(k_start, k_end) of a call; without a k_start that is 0 for every query where
        `skip_zero_starts` (the shifted keys' start is never 0: no conditional there)."""
        if (
            not skip_zero_starts
            or call.start is None
            or call.end is not None
            or call.keys == "shifted"
            or _SEVERAL_DOCUMENTS.get()
        ):
            return op(call.start, call.end)
        return lax.cond(
            jnp.all(call.start == 0), lambda: op(None, None), lambda: op(call.start, None)
        )

    def forward(q, k, v, q_pos, k_pos, q_seg, k_seg, *, causal, q_chunk, kv_chunk, classes=None):
        del q_chunk, kv_chunk  # the fused kernel picks its own tiles
        b, tq, h, d = q.shape
        calls, blind = _calls(q_pos, k_pos, q_seg, k_seg, causal, (b, tq))

        def run(call):
            if call is None:
                return jnp.zeros((b, tq, h, d), F32), jnp.full((b, tq, h), -jnp.inf, F32)
            c = call()
            keys = _KEYS[c.keys][0]
            o_c, lse_c = masked(
                c, lambda start, end: attend(q[:, c.rows], keys(k), keys(v), c.causal, start, end)
            )
            return (
                _place(o_c.astype(F32), c.rows, 0.0),
                _place(lse_c.astype(F32), c.rows, -jnp.inf),
            )

        o, lse = _by_class(
            possible_classes(q_pos, k_pos, causal, classes),
            q_pos,
            k_pos,
            causal,
            [functools.partial(run, c) for c in calls],
        )
        return (
            jnp.where(blind[..., None, None], 0.0, o),
            jnp.where(blind[..., None], -jnp.inf, lse),
        )

    def backward(
        q, k, v, o, lse, do, q_pos, k_pos, q_seg, k_seg, *, causal, q_chunk, kv_chunk, classes=None
    ):
        del q_chunk, kv_chunk
        calls, blind = _calls(q_pos, k_pos, q_seg, k_seg, causal, q.shape[:2])
        lse = jnp.where(jnp.isfinite(lse), lse, 0.0)  # rows that see nothing anywhere
        # rows that see nothing in this pair contribute nothing, whatever the op does with them
        do = jnp.where(blind[..., None, None], jnp.zeros_like(do), do)

        def run(call):
            if call is None:
                return (jnp.zeros(q.shape, F32), jnp.zeros(k.shape, F32), jnp.zeros(v.shape, F32))
            c = call()
            keys, back = _KEYS[c.keys]
            r = c.rows
            dq, dk, dv = masked(
                c,
                lambda start, end: attend_vjp(
                    q[:, r], keys(k), keys(v), o[:, r], lse[:, r], do[:, r], c.causal, start, end
                ),
            )
            # bf16 per-round gradients: a fused op returns a round's dq/dk/dv in the input
            # dtype (tokamax: bf16 when training; float32 inside the kernel), so each round's
            # share is rounded once, then the ring adds rounds in float32 (`_ring_backward`'s
            # dq and travelling dK/dV accumulators): errors add over sp rounds, not compound.
            # `bench.correctness` checks a ring of 4; check sp=8 against dense on the device.
            return (_place(dq.astype(F32), r, 0.0), back(dk.astype(F32)), back(dv.astype(F32)))

        dq, dk, dv = _by_class(
            possible_classes(q_pos, k_pos, causal, classes),
            q_pos,
            k_pos,
            causal,
            [functools.partial(run, c) for c in calls],
        )
        return jnp.where(blind[..., None, None], 0.0, dq), dk, dv

    return RangeKernel(forward, backward, limits, compute_dtype_rounds=True)

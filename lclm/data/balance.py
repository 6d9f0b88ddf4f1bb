"""Balanced attention work: which device and micro-batch trains which row of a step.

With packed documents and document masks a row's attention work is the number of (query,
key) pairs of the same document with key <= query: the sum of its documents' squared
lengths / 2, so a row of one 64K document costs ~64x a row of 64 1K documents although both
hold 64K tokens. Devices that hold rows of the same length then take different times, and
every step waits for the slowest. `attention_work` counts that work exactly, per sequence
(sp) device of a layout, in closed form from the documents' bounds; `balance_permutation`
reorders a step's rows so that within every micro-batch each batch shard gets about the
same.

Only the quadratic term is counted. Everything else a row costs (projections, FFN, loss) is
linear in its tokens, and every row holds `seq_len` tokens, so it is the same for every row
and, as every bin holds the same number of rows, for every bin: it moves no bin ahead of
another, and leaving it out changes no assignment.

Where rows land (`lclm.train.step._micro_batches`, `lclm.data.loader.batch_sharding`): the
batch axis is split over its shards in contiguous blocks, and row i*accum + a of the step
goes to micro-batch a, so local row o of a process (whose rows start on a shard boundary)
goes to shard o // (rows per shard) and micro-batch o % accum.
"""

from __future__ import annotations

import functools

import numpy as np

from lclm.ops.layout import original_positions


@functools.lru_cache(maxsize=64)
def _runs(layout: str, n: int, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The query positions of each sequence shard as arithmetic runs: (first, step, count),
    each `[n, K]` int64 (K: the most runs of a shard; unused runs have count 0).

    Taken from the layout's own token -> device map (`original_positions`): striped is one
    run of step n per device, contiguous one run of step 1, zigzag two."""
    per_device = []
    for device in range(n):
        p = original_positions(layout, n, device, seq_len // n).astype(np.int64)
        runs, i = [], 0
        while i < len(p):
            step = int(p[i + 1] - p[i]) if i + 1 < len(p) else 1
            diffs = np.diff(p[i:])
            breaks = np.flatnonzero(diffs != step)
            count = int(breaks[0]) + 1 if len(breaks) else len(p) - i
            runs.append((int(p[i]), step, count))
            i += count
        per_device.append(runs)
    k = max(len(r) for r in per_device)
    table = np.zeros((3, n, k), np.int64)
    table[1] = 1
    for device, runs in enumerate(per_device):
        table[:, device, : len(runs)] = np.array(runs, np.int64).T
    return table[0], table[1], table[2]


def documents(segment_ids: np.ndarray, document_mask: bool = True):
    """The documents of rows `[rows, seq]` (segment ids in original order, each document one
    contiguous run of equal ids, as `lclm.data.packing.Packer` packs them): (row, start, end)
    int64 `[documents]` each, end exclusive. Without document masks a row is one document."""
    rows, seq = segment_ids.shape
    if not document_mask:
        return np.arange(rows), np.zeros(rows, np.int64), np.full(rows, seq, np.int64)
    first = np.ones((rows, 1), bool)
    starts = np.flatnonzero(
        np.concatenate([first, segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    )
    row = starts // seq
    # a row's first token always starts a document, so the next start is in the same row or
    # is the next row's position 0 (= this row's end)
    ends = np.append(starts[1:], rows * seq) - row * seq
    return row, starts - row * seq, ends


def attention_work(
    segment_ids: np.ndarray, layout: str, n: int, document_mask: bool = True
) -> np.ndarray:
    """Causal attention pairs per sequence shard: `[rows, seq]` segment ids in original order
    -> `[rows, n]` int64, entry (r, j) the number of (query, key) pairs of row r with the same
    segment id and key <= query whose query sits on shard j of `layout` (`lclm.ops.layout`)
    for `n` shards. With `document_mask` False a row is one causal block.

    A query at position p of a document starting at a sees p - a + 1 keys; over the queries of
    one arithmetic run of a shard inside the document (m queries from p0, step s) that sums to
    m (p0 - a + 1) + s m (m - 1) / 2."""
    rows, seq = segment_ids.shape
    row, start, end = documents(segment_ids, document_mask)
    first, step, count = _runs(layout, n, seq)  # [n, K]
    a, e = start[:, None, None], end[:, None, None]  # [docs, 1, 1]
    # the run's indices i with a <= first + step*i < e, clipped to [0, count)
    lo = np.clip(-((first - a) // step), 0, count)
    hi = np.clip(-((first - e) // step), 0, count)
    m = np.maximum(hi - lo, 0)
    p0 = first + step * lo
    pairs = (m * (p0 - a + 1) + step * m * (m - 1) // 2).sum(axis=2)  # [docs, n]
    work = np.zeros((rows, n), np.int64)
    np.add.at(work, row, pairs)
    return work


def bin_of_position(rows: int, shards: int, accum: int) -> np.ndarray:
    """`[rows]`: the bin (shard * accum + micro-batch) that local row o is trained in."""
    o = np.arange(rows)
    return (o // (rows // shards)) * accum + o % accum


def _check_bins(rows: int, shards: int, accum: int) -> None:
    if rows % (shards * accum):
        raise ValueError(
            f"{rows} rows do not split evenly into {shards} batch shards x {accum} micro-batches"
        )


def _longest_first(work: np.ndarray, bins: int) -> np.ndarray:
    """Longest processing time first, every bin taking rows // bins rows: `[rows, n]` work,
    rows in decreasing order -> `[rows]` bin of each. Each row goes to the bin with room whose
    busiest shard would be least loaded after taking it (ties: the lower bin)."""
    rows, n = work.shape
    capacity = rows // bins
    loads = np.zeros((bins, n), np.int64)
    taken = np.zeros(bins, np.int64)
    assigned = np.empty(rows, np.int64)
    for r in range(rows):
        after = (loads + work[r]).max(axis=1)
        after[taken >= capacity] = np.iinfo(np.int64).max
        b = int(np.argmin(after))
        loads[b] += work[r]
        taken[b] += 1
        assigned[r] = b
    return assigned


def assign_bins(work: np.ndarray, shards: int, accum: int) -> np.ndarray:
    """`[rows, n]` work -> `[rows]` bin (shard * accum + micro-batch) of each row, every bin
    taking the same number of rows.

    Micro-batches run one after another, each as slow as its busiest device, so a step's
    attention time is the sum over micro-batches of their busiest device's work. Rows in
    decreasing order of their busiest shard's work (ties: lower row first) are cut into
    `accum` equal groups, the heaviest group the first micro-batch (similar rows together:
    for one row per bin this pairing minimises that sum), and each group is spread over the
    batch shards longest-first (`_longest_first`), which keeps its busiest shard low. The
    result depends on the work alone."""
    rows = work.shape[0]
    order = np.argsort(-work.max(axis=1), kind="stable")
    assigned = np.empty(rows, np.int64)
    for a, group in enumerate(np.split(order, accum)):
        assigned[group] = _longest_first(work[group], shards) * accum + a
    return assigned


def balance_permutation(work: np.ndarray, shards: int, accum: int) -> np.ndarray:
    """The row order that balances a step: `[rows, n]` work of this process's rows (n sequence
    shards) -> `[rows]` permutation `order`, so that `batch[order]` puts every row in the
    (batch shard, micro-batch) bin `assign_bins` chose for it. `shards`: the batch shards the
    rows are split over; `accum`: micro-batches per step. Only reorders rows."""
    rows = work.shape[0]
    _check_bins(rows, shards, accum)
    assigned = assign_bins(work, shards, accum)
    target = bin_of_position(rows, shards, accum)
    order = np.empty(rows, np.int64)
    # within a bin, rows keep their relative order (stable sorts: deterministic)
    order[np.argsort(target, kind="stable")] = np.argsort(assigned, kind="stable")
    return order


def bin_loads(work: np.ndarray, shards: int, accum: int) -> np.ndarray:
    """`[rows, n]` work of rows in the order they are trained -> `[accum, shards, n]`: each
    micro-batch's work on each (batch shard, sequence shard) device."""
    rows, n = work.shape
    _check_bins(rows, shards, accum)
    loads = np.zeros((shards * accum, n), work.dtype)
    np.add.at(loads, bin_of_position(rows, shards, accum), work)
    return loads.reshape(shards, accum, n).swapaxes(0, 1)


def imbalance(work: np.ndarray, shards: int, accum: int) -> float:
    """Attention time of a step over its ideal, (sum over micro-batches of the busiest
    device's work) / (sum over micro-batches of the mean device's work): micro-batches run one
    after another and each waits for its slowest device. 1.0 is perfect balance."""
    loads = bin_loads(work, shards, accum).reshape(accum, -1)
    return float(loads.max(axis=1).sum() / max(loads.mean(axis=1).sum(), 1e-30))


def one_vs_many(seq: int, layout: str, n: int, short: int = 1024) -> tuple[float, float]:
    """The planner's bound on row imbalance: (busiest shard's work for a row of one `seq`-token
    document / the same for a row of `short`-token documents, busiest / mean shard's work for
    the one-document row, which no reordering of rows changes)."""
    one = attention_work(np.ones((1, seq), np.int32), layout, n)[0]
    many = attention_work(np.arange(seq)[None] // short, layout, n)[0]
    return float(one.max() / many.max()), float(one.max() / one.mean())

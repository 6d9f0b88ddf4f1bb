"""The trainer's data feed: sources -> documents -> packed rows -> layout -> global batch.

Row r of every global batch comes from its own *slot*: a reader of every `batch_size`-th
document of each source (from document r on), a mixture counter and a packer, so a slot's
consecutive rows continue its documents. What the global batch holds therefore does not
depend on how many processes build it: each process builds only the rows (and sequence
block) that its devices hold, reading only those slots' share of the data, and a checkpoint
written by N processes resumes on M. Striping happens here, on the host, once, for all
per-token arrays together. A background thread prefetches; `state()` is the JSON state
after the last batch handed out.

That state is positions only, a few hundred bytes per slot whatever the documents: for each
slot, where its mixture and source readers stood before it drew the documents still pending
in its packer, and how many of their tokens are already in rows. Restoring draws those
documents again (document i of a source is always the same) and skips the consumed tokens.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import queue
import re
import threading
from collections.abc import Mapping
from typing import NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding

from lclm import storage
from lclm.config.run_config import RunConfig
from lclm.data.ahead import Ahead
from lclm.data.balance import attention_work, balance_permutation
from lclm.data.documents import Partial
from lclm.data.filters import (
    BUCKETS,
    DocumentLengths,
    LengthFilter,
    LengthRules,
    parse_options,
    statistics,
)
from lclm.data.kind import Documents
from lclm.data.packing import ROW_KEYS, Packer
from lclm.data.prepared import TokenizedDocuments
from lclm.data.sources import KINDS, DataError, open_documents
from lclm.data.stats import SourceStats
from lclm.data.stream import DocumentStream, EpochOrders, Mixture
from lclm.errors import ConfigError
from lclm.ops.context_parallel import layout_shards
from lclm.ops.layout import batch_to_layout
from lclm.parallel.mesh import logical_spec

log = logging.getLogger(__name__)


def batch_sharding(mesh) -> NamedSharding:
    """Per-token arrays `[batch, seq]`: batch over (dp, fsdp), sequence over sp."""
    return NamedSharding(mesh, logical_spec(("batch", "seq")))


def abstract_batch(batch_size: int, seq_len: int, sharding) -> dict:
    """A batch's arrays `[batch, seq]` as the train step takes them, placed by `sharding`
    (shapes and dtypes only: what a step is compiled against)."""
    return {
        k: jax.ShapeDtypeStruct(
            (batch_size, seq_len), np.float32 if k == "loss_mask" else np.int32, sharding=sharding
        )
        for k in ROW_KEYS
    }


def _local_path(path: str) -> bool:
    """Whether `path` is an existing local path. Object-store paths are not looked up: parsing
    is also the planner's syntax check, which must not need a bucket's credentials (so there
    an '@number' ending is always a weight, and a ',' of an object's name is written '\\,')."""
    return not storage.is_remote(path) and os.path.exists(path)


class SourceEntry(NamedTuple):
    """One entry of a data.path mixture."""

    kind: str
    path: str
    weight: float
    options: LengthRules = LengthRules()


def _split_options(rest: str) -> tuple[str, str]:
    """(path[@weight], options) of `path[@weight][?key=value&...]`; only a tail that holds
    '=' is options, so a glob's '?' stays in the path."""
    head, sep, tail = rest.rpartition("?")
    return (head, tail) if sep and "=" in tail else (rest, "")


def _entry(entry: str, default_kind: str, key: str) -> SourceEntry:
    """One `[kind:]path[@weight][?options]` entry. A local path that exists is taken as it
    is, so '@' or '?' in a file name is not read as a weight or options."""
    kind, rest = default_kind, entry
    head, sep, tail = entry.partition(":")
    if sep and head in KINDS:
        kind, rest = head, tail
    if _local_path(rest):
        return SourceEntry(kind, rest, 1.0)
    rest, text = _split_options(rest)
    options = parse_options(text, f"config.{key} entry {entry!r}")
    if _local_path(rest) or "@" not in rest:
        return SourceEntry(kind, rest, 1.0, options)
    path, w = rest.rsplit("@", 1)
    try:
        weight = float(w)
    except ValueError:  # not a weight: part of a path (reported as missing later)
        return SourceEntry(kind, rest, 1.0, options)
    if not 0 < weight < float("inf"):
        raise ConfigError(
            f"config.{key} entry {entry!r}: the weight after '@' must be a finite number > 0"
        )
    return SourceEntry(kind, path, weight, options)


# entries are split at commas that no backslash escapes: '\,' is a comma of a file name
_ENTRY_SEPARATOR = re.compile(r"(?<!\\),")


def parse_sources(path: str, default_kind: str, key: str = "data.path") -> list[SourceEntry]:
    """`config.<key>` (data.path, validation.path) as entries: comma-separated
    `[kind:]path[@weight][?key=value&...]`, each path local, gs:// or s3://, the options
    those of `lclm.data.filters`. The whole string is one entry where it names an existing
    local path; in a mixture, a ',' of a file name is written '\\,'."""
    try:
        whole: SourceEntry | None = _entry(path.strip(), default_kind, key)
    except ConfigError:  # not one entry (its options would run into the next entry's)
        whole = None
    if path.strip() and whole is not None and _local_path(whole.path):
        return [whole]
    entries = [
        _entry(e.replace("\\,", ","), default_kind, key)
        for e in (e.strip() for e in _ENTRY_SEPARATOR.split(path))
        if e
    ]
    if not entries:
        raise ConfigError(f"config.{key} is empty; set it to a data file, directory or glob")
    return entries


def host_block(sharding: NamedSharding, global_shape) -> tuple[slice, slice]:
    """This process's (rows, seq) block of the global `[batch, seq]` arrays."""

    def box(indices):
        rows = {(s[0].start or 0, s[0].stop or global_shape[0]) for s in indices}
        seqs = {(s[1].start or 0, s[1].stop or global_shape[1]) for s in indices}
        r = (min(a for a, _ in rows), max(b for _, b in rows))
        q = (min(a for a, _ in seqs), max(b for _, b in seqs))
        return r, q

    # jax annotates the keys with an alias of jax.Device that mypy cannot resolve
    indices: Mapping[jax.Device, tuple[slice, ...]] = sharding.devices_indices_map(
        tuple(global_shape)
    )
    mine = [idx for device, idx in indices.items() if device.process_index == jax.process_index()]
    (r0, r1), (s0, s1) = box(mine)
    return slice(r0, r1), slice(s0, s1)


def _shares(found: list[dict], unit: str) -> list[float]:
    """Each source's share of the tokens drawn: its weight's share where several sources
    share tokens, else in proportion to weight x its mean tokens per document drawn."""
    w = np.asarray([f["weight"] for f in found], np.float64)
    if unit != "tokens" or len(found) == 1:
        w = w * [f["tokens"] / max(f["documents"], 1) for f in found]
    return [float(x) for x in w / (w.sum() or 1.0)]


def _table(found: list[dict]) -> str:
    """The statistics as lines: per source, one epoch's draws and tokens ('~': estimated
    from a sample), its tokens' shares by document length, its share of the run."""
    labels = [label for label, _, _ in BUCKETS]
    # each source named whole (kind, path, options), the column as wide as the longest
    names = [
        f"{f['kind']}:{f['path']}" + (f"?{f['options']}" if f["options"] else "") for f in found
    ]
    width = max([len("source"), *map(len, names)])
    lines = [
        "one epoch per source under its options; tokens by document length; share of "
        "the tokens trained on (~: estimated from a sample)",
        f"{'source':<{width}} {'documents':>11} {'tokens':>15} "
        + " ".join(f"{label:>7}" for label in labels)
        + f" {'share':>7}",
    ]
    for name, f in zip(names, found):
        mark = "~" if f["estimated"] else " "
        cells = " ".join(
            f"{100 * f['buckets'][label]['tokens'] / max(f['tokens'], 1):6.1f}%" for label in labels
        )
        lines.append(
            f"{name:<{width}} {mark}{f['documents']:>10,} {mark}{f['tokens']:>14,} "
            f"{cells} {100 * f['share']:6.1f}%"
        )
    return "\n".join(lines)


class _Source(NamedTuple):
    """An opened data.path entry, shared by the slots."""

    entry: SourceEntry
    docs: object  # a random-access document set (open_documents), read ahead unless prepared
    orders: EpochOrders
    filter: LengthFilter

    def stream(self, row: int, batch_size: int) -> DocumentStream:
        rules = None if self.entry.options.trivial else self.filter
        return DocumentStream(self.docs, self.orders, row, batch_size, rules, self.entry.path)


class _Slot:
    """The reader of one batch row: its mixture of source streams and its packer.

    State: `{"mixture": the mixture's state before the first document pending in the packer
    was drawn (the current one when none is pending), "packer": the packer's positions in the
    documents drawn since}`.
    """

    def __init__(
        self,
        sources: list[_Source],
        unit: str,
        seed: int,
        row: int,
        batch_size: int,
        seq_len: int,
        reset_positions: bool,
    ):
        streams = [s.stream(row, batch_size) for s in sources]
        self.mixture = Mixture(
            streams, [s.entry.weight for s in sources], seed, stream_id=row, unit=unit
        )
        self.packer = Packer(seq_len, reset_positions)
        self._origins: collections.deque[dict] = collections.deque()  # of pending documents
        self._open: Partial | None = None  # the document added last, while it has more parts

    def upcoming(self, batches: int) -> list[list[tuple[int, int]]]:
        """Per source, the documents its reader draws next, soonest first: twice as many as
        it drew per batch over `batches` batches, and two more (what to read ahead)."""
        return [s.upcoming(2 + -(-2 * s.drawn // max(batches, 1))) for s in self.mixture.streams]

    def _draw(self):
        self._origins.append(self.mixture.state())
        return next(self.mixture)

    def _draw_whole(self) -> tuple[np.ndarray, np.ndarray]:
        doc = self._draw()
        return doc.whole() if isinstance(doc, Partial) else doc

    def next_row(self) -> dict[str, np.ndarray]:
        while (row := self.packer.pop_row()) is None:
            part = None if self._open is None else self._open.take()
            if part is not None:  # the document being read: its next part
                self.packer.extend(*part)
                continue
            doc = self._draw()
            self._open = doc if isinstance(doc, Partial) else None
            first = doc.take() if isinstance(doc, Partial) else doc
            assert first is not None  # a document's first part is at least its BOS or EOS
            self.packer.add(*first)
        while len(self._origins) > self.packer.documents:
            self._origins.popleft()
        return row

    def state(self) -> dict:
        origin = self._origins[0] if self._origins else self.mixture.state()
        return dict(mixture=origin, packer=self.packer.state())

    def restore(self, state: dict) -> None:
        self.mixture.restore(state["mixture"])
        self.packer = Packer(self.packer.seq_len, self.packer.reset_positions)
        self._origins.clear()
        self._open = None
        self.packer.restore(state["packer"], self._draw_whole)


class HostBatches:
    """Endless global batches `{key: jax.Array [batch, seq]}` for `config` on `mesh`."""

    def __init__(self, config: RunConfig, mesh, tokenizer, state=None, prefetch: int = 2):
        """`config`: the run's sections (it reads data, attention, the seed and
        train.grad_accum). `state`: what `state()` returned, or a list of such states (one
        per process of the run that saved them). `prefetch`: host batches prepared ahead by a
        background thread (0: none, batches are built when asked for)."""
        d, seed = config.data, config.seed
        # the layout's shards (sp; usp: sp / ulysses)
        self.layout = config.attention.layout
        self.shards = layout_shards(config.attention, mesh.shape["sp"])
        self.sharding = batch_sharding(mesh)
        self.global_shape = (d.batch_size, d.seq_len)
        self.rows, self.seq = host_block(self.sharding, self.global_shape)
        self.stats = SourceStats()
        self.sources: list[_Source] = []
        # entries of one kind and path (a mixture of one source's lengths) share its
        # documents, their lengths as measured and the threads that read them ahead
        opened: dict[tuple[str, str], tuple[Documents, DocumentLengths]] = {}
        for i, entry in enumerate(parse_sources(d.path, d.source)):
            if (entry.kind, entry.path) not in opened:
                docs = open_documents(
                    entry.kind,
                    entry.path,
                    tokenizer,
                    text_field=d.text_field,
                    chat_template=d.chat_template,
                    stats=self.stats,
                )
                if not isinstance(docs, TokenizedDocuments):  # read in microseconds
                    docs = Ahead(docs)
                opened[entry.kind, entry.path] = docs, DocumentLengths(docs)
            docs, lengths = opened[entry.kind, entry.path]
            if len(docs) < d.batch_size:
                raise DataError(
                    f"data source {entry.path} has {len(docs)} usable records but "
                    f"needs at least {d.batch_size}: each of the data.batch_size="
                    f"{d.batch_size} batch rows reads its own share; use more data "
                    "or a smaller data.batch_size"
                )
            self.sources.append(
                _Source(
                    entry,
                    docs,
                    EpochOrders(len(docs), seed * 1009 + i),
                    LengthFilter(docs, entry.options, seed, i, lengths),
                )
            )
        self.unit = d.mixture_unit
        self.slots = {
            r: _Slot(self.sources, self.unit, seed, r, d.batch_size, d.seq_len, d.reset_positions)
            for r in range(self.rows.start, self.rows.stop)
        }
        self._statistics: dict | None = None
        self.batches = 0
        # data.balance (next_host_batch): rows per batch shard and micro-batches per step,
        # the bins that this process's rows are balanced over
        self.balance = d.balance
        shards = {
            idx[0].start for idx in self.sharding.devices_indices_map(self.global_shape).values()
        }
        self.shard_rows, self.grad_accum = d.batch_size // len(shards), config.train.grad_accum
        self.document_mask = d.document_mask
        if state is not None:
            self.restore(state)
        self._built = 0  # batches built by this object: how fast its readers draw
        self._read_ahead()
        self._state = self._snapshot()
        self._logged_skips = 0
        self._stop = threading.Event()
        self._thread = None
        if prefetch > 0:
            self._queue: queue.Queue = queue.Queue(maxsize=prefetch)
            self._thread = threading.Thread(target=self._produce, daemon=True)
            self._thread.start()

    # -- producer side (background thread) --
    def _snapshot(self) -> dict:
        return dict(slots={str(r): s.state() for r, s in self.slots.items()}, batches=self.batches)

    def restore(self, state) -> None:
        states = [s for s in (state if isinstance(state, list) else [state]) if s is not None]
        if not states:  # e.g. a checkpoint converted from HuggingFace: data starts fresh
            return
        slots = {}
        for s in states:
            slots.update(s["slots"])
        missing = [r for r in self.slots if str(r) not in slots]
        if missing:
            raise ValueError(
                f"the saved data state has no reader for batch rows {missing}; "
                "was data.batch_size changed?"
            )
        for r, slot in self.slots.items():
            slot.restore(slots[str(r)])
        self.batches = max(s["batches"] for s in states)

    def next_host_batch(self) -> dict[str, np.ndarray]:
        """The next block of this process, in layout order (synchronous; no device arrays).

        With `data.balance` its rows are first reordered (`lclm.data.balance`) so that each of
        this process's (batch shard, micro-batch) bins gets about the same attention work: the
        loss, a token mean over the whole step, is unchanged. The order is a function of the
        rows alone (a resumed run reorders them the same way; `state()` is untouched) and
        every process holding a row's sequence blocks computes the same one. With several
        processes only each process's own rows are reordered: rows never move between
        processes (balance across processes is left to chance), so the order of a global
        batch's rows, not which rows it holds, depends on how many processes build it."""
        rows = [self.slots[r].next_row() for r in range(self.rows.start, self.rows.stop)]
        batch = {k: np.stack([r[k] for r in rows]) for k in ROW_KEYS}
        if self.balance:
            work = attention_work(
                batch["segment_ids"], self.layout, self.shards, self.document_mask
            )
            shards = (self.rows.stop - self.rows.start) // self.shard_rows
            order = balance_permutation(work, shards, self.grad_accum)
            batch = {k: v[order] for k, v in batch.items()}
        batch = batch_to_layout(batch, self.layout, self.shards)
        self.batches += 1
        self._built += 1
        self._read_ahead()
        return {k: np.ascontiguousarray(v[:, self.seq]) for k, v in batch.items()}

    def _read_ahead(self) -> None:
        """Start reading the documents that the next batches draw, on each source's threads
        (`lclm.data.ahead`): every slot's next one first, then every slot's second, ..."""
        upcoming = [slot.upcoming(self._built) for slot in self.slots.values()]
        # by id: sources share them
        wanted: dict[int, tuple[Ahead, list[list[tuple[int, int]]]]] = {}
        for j, source in enumerate(self.sources):
            if isinstance(source.docs, Ahead):
                wanted.setdefault(id(source.docs), (source.docs, []))[1].extend(
                    u[j] for u in upcoming
                )
        for docs, lists in wanted.values():
            docs.want(d for depth in itertools.zip_longest(*lists) for d in depth if d is not None)

    def _produce(self) -> None:
        try:
            while not self._stop.is_set():
                item = (self.next_host_batch(), self._snapshot())
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # noqa: BLE001  (re-raised in the consumer)
            self._queue.put((e, None))

    # -- consumer side (training loop) --
    def __iter__(self):
        return self

    def __next__(self) -> dict[str, jax.Array]:
        if self._thread is None:
            local = self.next_host_batch()
            state = self._snapshot()
        else:
            local, state = self._queue.get()
        if isinstance(local, BaseException):
            raise local
        self._state = state
        if self.stats.skipped > self._logged_skips:
            log.warning("data: %s", self.stats.summary())
            self._logged_skips = self.stats.skipped
        return {
            k: jax.make_array_from_process_local_data(self.sharding, v, self.global_shape)
            for k, v in local.items()
        }

    def state(self) -> dict:
        """JSON state after the last batch returned by `next` (restore it to continue)."""
        return self._state

    def statistics(self, sample: int = 200) -> dict:
        """What one epoch of each source holds under its options and the token share of
        each source the run will train on (JSON-ready; the first call also logs it as a
        table): `{"mixture_unit", "sources": [{"kind", "path", "weight", "share",
        "documents", "tokens", "buckets": {label: {"documents", "tokens"}}, ...}]}` (see
        `lclm.data.filters.statistics`). Sources that are not pre-tokenised are measured on
        up to `sample` documents and marked `estimated`."""
        if self._statistics is None:
            found = [
                dict(
                    kind=s.entry.kind,
                    path=s.entry.path,
                    weight=s.entry.weight,
                    **statistics(s.filter, sample),
                )
                for s in self.sources
            ]
            for f, share in zip(found, _shares(found, self.unit)):
                f["share"] = share
            self._statistics = dict(mixture_unit=self.unit, sources=found)
            log.info("data: %s", _table(found))
        return self._statistics

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for source in self.sources:  # a shared one twice: closing is idempotent
            if isinstance(source.docs, Ahead):
                source.docs.close()

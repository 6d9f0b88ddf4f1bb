"""Deterministic, shardable, resumable document order over one or several sources."""

from __future__ import annotations

import functools

import numpy as np

from lclm.data.documents import Partial, document_length, read_partly
from lclm.data.filters import LengthFilter
from lclm.data.records import DataError


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The document order `[n]` of one epoch: a pure function of (n, seed, epoch)."""
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([seed, epoch]).permutation(n)


class EpochOrders:
    """The epoch orders of one source, shared by all its readers.

    An order is recomputed whenever it is not cached, so readers may be any number of epochs
    apart (documents of very different lengths drive them apart): the cache only saves work
    while readers move through an epoch together, and holds at most `keep` orders.
    """

    def __init__(self, n: int, seed: int, shuffle: bool = True, keep: int = 2):
        self.n, self.seed, self.shuffle, self.keep = n, seed, shuffle, keep
        self._cache: dict[int, np.ndarray] = {}  # least recently used first

    def get(self, epoch: int) -> np.ndarray:
        order = self._cache.pop(epoch, None)
        if order is None:
            order = epoch_order(self.n, self.seed, epoch, self.shuffle)
        self._cache[epoch] = order
        while len(self._cache) > self.keep:
            del self._cache[next(iter(self._cache))]
        return order


class DocumentStream:
    """Endless epochs over a random-access document set, shuffled per epoch; this reader
    takes every `num_shards`-th document of each epoch's order, starting at `shard`.

    State: `{"epoch", "index"}` (JSON). Malformed documents (None) are skipped (a document
    set that holds only malformed ones raises instead of answering None). The reader keeps
    its own share (`[~n / num_shards]`) of its current epoch's order, so the shares of all
    readers together hold about one order, wherever each reader is.

    With a source's options (`rules`, see lclm.data.filters), an epoch is `copies` draws per
    position of the share: the document there, then copy c of the document c * shift
    positions further on (shift = share / copies), so the copies of a long document lie
    spread over the epoch. Draws that the options leave out are skipped, as is a draw of the
    document drawn just before (never twice in a row), unless a whole epoch's draws were
    skipped since: then it is the only one left. Where documents repeat, the state holds
    `"last"` and `"skipped"` (draws skipped since) too.
    """

    def __init__(
        self,
        docs,
        orders: EpochOrders,
        shard: int = 0,
        num_shards: int = 1,
        rules: LengthFilter | None = None,
        name: str = "data",
    ):
        if len(docs) < num_shards:
            raise ValueError(
                f"{len(docs)} documents cannot be shared by {num_shards} readers; "
                "use more data or a smaller data.batch_size"
            )
        self.docs, self.orders, self.rules, self.name = docs, orders, rules, name
        self.copies = 1 if rules is None else rules.copies
        self.shard, self.num_shards = shard, num_shards
        self.epoch, self.index = 0, 0
        self.last: int | None = None  # the document drawn last, where copies may follow it
        self.skipped = 0  # draws left out in a row
        self.drawn = 0  # documents handed out by this object (not state: for reading ahead)
        self._share_epoch: int | None = None
        self._share: np.ndarray | None = None

    def __iter__(self):
        return self

    def _my_share(self) -> np.ndarray:
        """This reader's documents `[~n / num_shards]` of the current epoch, in order."""
        if self._share_epoch != self.epoch:
            self._share = self.orders.get(self.epoch)[self.shard :: self.num_shards].copy()
            self._share_epoch = self.epoch
        assert self._share is not None  # made above for the current epoch
        return self._share

    def _document(self, share: np.ndarray, index: int) -> tuple[int, int]:
        """(document, copy) of draw `index` of the epoch of `share`."""
        position, copy = divmod(index, self.copies)
        shift = max(1, len(share) // self.copies)
        return int(share[(position + copy * shift) % len(share)]), copy

    def _read(self, i: int, copy: int):
        if self.rules is None:
            return read_partly(self.docs, i)
        if self.copies > 1 and i == self.last:
            return None
        return self.rules.read(i, self.epoch, copy)

    def _left_out(self, share: np.ndarray) -> None:
        """Count a draw left out; after a whole epoch of them, fail if no document of the
        share can ever be drawn (else it was chance, or `last` is all that is left: go on)."""
        self.skipped += 1
        if self.rules is not None and self.skipped >= len(share) * self.copies:
            self.rules.check_keepable(share, self.name)
            self.skipped, self.last = 0, None

    def __next__(self):
        while True:
            share = self._my_share()
            if self.index >= len(share) * self.copies:
                self.epoch, self.index = self.epoch + 1, 0
                continue
            i, copy = self._document(share, self.index)
            doc = self._read(i, copy)
            self.index += 1
            if doc is None:
                self._left_out(share)
                continue
            self.skipped = 0
            self.drawn += 1
            if self.copies > 1:
                self.last = i
            return doc

    def upcoming(self, k: int) -> list[tuple[int, int]]:
        """The documents of this reader's next `k` draws, in order, less those that its
        options already leave out (what is known of their length decides it): what to read
        ahead, as `lclm.data.ahead.Ahead.want` takes it. A draw listed may still be left
        out."""
        epoch, index, share = self.epoch, self.index, self._my_share()
        found: list[tuple[int, int]] = []
        for _ in range(k):
            if index >= len(share) * self.copies:
                epoch, index = epoch + 1, 0
                share = self.orders.get(epoch)[self.shard :: self.num_shards]
            i, copy = self._document(share, index)
            index += 1
            if self.rules is None:
                found.append((i, 0))
            elif self.rules.may_keep(i, epoch, copy):
                found.append(self.rules.ahead(i, copy))
        return found

    def state(self) -> dict:
        state: dict = dict(epoch=self.epoch, index=self.index)
        if self.copies > 1:
            state.update(last=self.last, skipped=self.skipped)
        return state

    def restore(self, state: dict) -> None:
        self.epoch, self.index = state["epoch"], state["index"]
        self.last, self.skipped = state.get("last"), state.get("skipped", 0)


def _deficits(weights: np.ndarray, tokens: list[int]) -> np.ndarray:
    """How far each source `[k]` is below its share (`weights`, summing to 1) of the tokens
    drawn so far, in tokens."""
    drawn = np.asarray(tokens, np.float64)
    return weights * drawn.sum() - drawn


class Mixture:
    """Documents drawn from several streams with the given weights.

    unit='documents': the choice for the n-th document of reader `stream_id` depends only on
    (seed, stream_id, n); state `{"count", "streams"}`. unit='tokens': each draw takes the
    source furthest below its weight's share of the tokens drawn so far (the first in order
    on a tie), so token shares track the weights whatever the documents' lengths; state
    `{"count", "tokens": per source, "streams"}`. A document drawn as a `Partial` counts its
    tokens as they are read; its reader draws again only once it has read all of them, so
    every choice sees the same counts as if each document were read whole. A single source
    needs no choice, and its state is the same under both units.
    """

    def __init__(
        self,
        streams: list[DocumentStream],
        weights: list[float],
        seed: int,
        stream_id: int = 0,
        unit: str = "documents",
    ):
        w = np.asarray(weights, np.float64)
        if len(streams) != len(w) or (w <= 0).any():
            raise ValueError("every data source needs a positive weight")
        self.streams, self.weights, self.cdf = streams, w / w.sum(), np.cumsum(w / w.sum())
        self.seed, self.stream_id, self.count = seed, stream_id, 0
        self.by_tokens = unit == "tokens" and len(streams) > 1
        self.tokens = [0] * len(streams)

    def __iter__(self):
        return self

    def _choose(self) -> int:
        if len(self.streams) == 1:
            return 0
        if self.by_tokens:
            return int(np.argmax(_deficits(self.weights, self.tokens)))
        u = np.random.default_rng([self.seed, self.stream_id, self.count]).random()
        return min(int(np.searchsorted(self.cdf, u, side="right")), len(self.cdf) - 1)

    def __next__(self):
        choice = self._choose()
        self.count += 1
        doc = next(self.streams[choice])
        self.tokens[choice] += document_length(doc)
        if isinstance(doc, Partial):  # its later parts count as they are read
            doc.on_encoded = functools.partial(self._count, choice)
        return doc

    def _count(self, choice: int, tokens: int) -> None:
        self.tokens[choice] += tokens

    def state(self) -> dict:
        state: dict = dict(count=self.count, streams=[s.state() for s in self.streams])
        if self.by_tokens:
            state["tokens"] = list(self.tokens)
        return state

    def restore(self, state: dict) -> None:
        if self.by_tokens != ("tokens" in state):
            saved = "tokens" if "tokens" in state else "documents"
            raise DataError(
                f"the saved data state shares its mixture by {saved} but this run "
                f"by {'tokens' if self.by_tokens else 'documents'}; set "
                f"data.mixture_unit={saved} to resume it"
            )
        self.count = state["count"]
        self.tokens = list(state.get("tokens", [0] * len(self.streams)))
        for s, st in zip(self.streams, state["streams"]):
            s.restore(st)

"""Deterministic, shardable, resumable document order over one or several sources."""

from __future__ import annotations

import numpy as np


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
        self._cache: dict[int, np.ndarray] = {}   # least recently used first

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
    set that holds only malformed ones raises instead of answering None). The reader
    keeps its own share (`[~n / num_shards]`) of its current epoch's order, so the shares of
    all readers together hold about one order, wherever each reader is.
    """

    def __init__(self, docs, orders: EpochOrders, shard: int = 0, num_shards: int = 1):
        if len(docs) < num_shards:
            raise ValueError(f"{len(docs)} documents cannot be shared by {num_shards} readers; "
                             "use more data or a smaller data.batch_size")
        self.docs, self.orders = docs, orders
        self.shard, self.num_shards = shard, num_shards
        self.epoch, self.index = 0, 0
        self._share_epoch: int | None = None
        self._share: np.ndarray | None = None

    def __iter__(self):
        return self

    def _my_share(self) -> np.ndarray:
        """This reader's documents `[~n / num_shards]` of the current epoch, in order."""
        if self._share_epoch != self.epoch:
            self._share = self.orders.get(self.epoch)[self.shard::self.num_shards].copy()
            self._share_epoch = self.epoch
        assert self._share is not None  # made above for the current epoch
        return self._share

    def __next__(self):
        while True:
            share = self._my_share()
            if self.index >= len(share):
                self.epoch, self.index = self.epoch + 1, 0
                continue
            doc = self.docs[int(share[self.index])]
            self.index += 1
            if doc is not None:
                return doc

    def state(self) -> dict:
        return dict(epoch=self.epoch, index=self.index)

    def restore(self, state: dict) -> None:
        self.epoch, self.index = state["epoch"], state["index"]


class Mixture:
    """Documents drawn from several streams with the given weights; the choice for the n-th
    document of reader `stream_id` depends only on (seed, stream_id, n): the state is a
    counter."""

    def __init__(self, streams: list[DocumentStream], weights: list[float], seed: int,
                 stream_id: int = 0):
        w = np.asarray(weights, np.float64)
        if len(streams) != len(w) or (w <= 0).any():
            raise ValueError("every data source needs a positive weight")
        self.streams, self.cdf = streams, np.cumsum(w / w.sum())
        self.seed, self.stream_id, self.count = seed, stream_id, 0

    def __iter__(self):
        return self

    def __next__(self):
        if len(self.streams) == 1:
            choice = 0
        else:
            u = np.random.default_rng([self.seed, self.stream_id, self.count]).random()
            choice = int(min(np.searchsorted(self.cdf, u, side="right"), len(self.cdf) - 1))
        self.count += 1
        return next(self.streams[choice])

    def state(self) -> dict:
        return dict(count=self.count, streams=[s.state() for s in self.streams])

    def restore(self, state: dict) -> None:
        self.count = state["count"]
        for s, st in zip(self.streams, state["streams"]):
            s.restore(st)

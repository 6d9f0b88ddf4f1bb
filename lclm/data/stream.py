"""Deterministic, shardable, resumable document order over one or several sources."""

from __future__ import annotations

import numpy as np


class EpochOrders:
    """The shuffled document order of each epoch of one source, shared by all its readers
    (computed once per epoch; the two most recent epochs are kept)."""

    def __init__(self, n: int, seed: int, shuffle: bool = True):
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self._cache: dict[int, np.ndarray] = {}

    def get(self, epoch: int) -> np.ndarray:
        if epoch not in self._cache:
            self._cache[epoch] = (np.random.default_rng([self.seed, epoch]).permutation(self.n)
                                  if self.shuffle else np.arange(self.n))
            for old in sorted(self._cache)[:-2]:
                del self._cache[old]
        return self._cache[epoch]


class DocumentStream:
    """Endless epochs over a random-access document set, shuffled per epoch; this reader
    takes every `num_shards`-th document of each epoch's order, starting at `shard`.

    State: `{"epoch", "index"}` (JSON). Malformed documents (None) are skipped.
    """

    def __init__(self, docs, orders: EpochOrders, shard: int = 0, num_shards: int = 1):
        if len(docs) < num_shards:
            raise ValueError(f"{len(docs)} documents cannot be shared by {num_shards} readers; "
                             "use more data or a smaller data.batch_size")
        self.docs, self.orders = docs, orders
        self.shard, self.num_shards = shard, num_shards
        self.epoch, self.index = 0, 0

    def __iter__(self):
        return self

    def __next__(self):
        misses = 0
        while True:
            order = self.orders.get(self.epoch)
            position = self.shard + self.index * self.num_shards
            if position >= len(order):
                self.epoch, self.index = self.epoch + 1, 0
                continue
            self.index += 1
            doc = self.docs[int(order[position])]
            if doc is not None:
                return doc
            misses += 1
            if misses > len(self.docs):
                raise ValueError("every document of this source is malformed")

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

"""Deterministic, shardable, resumable document order over one or several sources."""

from __future__ import annotations

import numpy as np


class DocumentStream:
    """Endless epochs over a random-access document set, shuffled per epoch from `seed`;
    this reader takes every `num_shards`-th document of each epoch's order from `shard` on.

    State: `{"epoch", "index"}` (JSON). Malformed documents (None) are skipped.
    """

    def __init__(self, docs, seed: int, shard: int = 0, num_shards: int = 1,
                 shuffle: bool = True):
        if len(docs) < num_shards:
            raise ValueError(f"{len(docs)} documents cannot be shared by {num_shards} readers")
        self.docs, self.seed, self.shuffle = docs, seed, shuffle
        self.shard, self.num_shards = shard, num_shards
        self.epoch, self.index = 0, 0
        self._order = None

    def _epoch_order(self) -> np.ndarray:
        n = len(self.docs)
        order = (np.random.default_rng([self.seed, self.epoch]).permutation(n) if self.shuffle
                 else np.arange(n))
        return order[self.shard::self.num_shards]

    def __iter__(self):
        return self

    def __next__(self):
        misses = 0
        while True:
            if self._order is None:
                self._order = self._epoch_order()
            if self.index >= len(self._order):
                self.epoch, self.index, self._order = self.epoch + 1, 0, None
                continue
            doc = self.docs[int(self._order[self.index])]
            self.index += 1
            if doc is not None:
                return doc
            misses += 1
            if misses > len(self.docs):
                raise ValueError("every document of this source is malformed")

    def state(self) -> dict:
        return dict(epoch=self.epoch, index=self.index)

    def restore(self, state: dict) -> None:
        self.epoch, self.index, self._order = state["epoch"], state["index"], None


class Mixture:
    """Documents drawn from several streams with the given weights; the choice for the n-th
    document depends only on (seed, n), so the state is a counter."""

    def __init__(self, streams: list[DocumentStream], weights: list[float], seed: int):
        w = np.asarray(weights, np.float64)
        if len(streams) != len(w) or (w <= 0).any():
            raise ValueError("every data source needs a positive weight")
        self.streams, self.cdf, self.seed, self.count = streams, np.cumsum(w / w.sum()), seed, 0

    def __iter__(self):
        return self

    def __next__(self):
        if len(self.streams) == 1:
            choice = 0
        else:
            u = np.random.default_rng([self.seed, 1, self.count]).random()
            choice = int(min(np.searchsorted(self.cdf, u, side="right"), len(self.cdf) - 1))
        self.count += 1
        return next(self.streams[choice])

    def state(self) -> dict:
        return dict(count=self.count, streams=[s.state() for s in self.streams])

    def restore(self, state: dict) -> None:
        self.count = state["count"]
        for s, st in zip(self.streams, state["streams"]):
            s.restore(st)

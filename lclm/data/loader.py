"""The trainer's data feed: sources -> documents -> packed rows -> layout -> global batch.

Each process builds only the block of the global `[batch, seq]` arrays that its devices
hold, and reads only its share of the data: processes whose devices hold the same batch rows
(e.g. `sp` spanning hosts) read the same share; different rows, disjoint shares. Striping
happens here, on the host, once, for all per-token arrays together. A background thread
prefetches host batches; `state()` is the JSON state after the last batch handed out.
"""

from __future__ import annotations

import logging
import queue
import threading

import jax
import numpy as np
from jax.sharding import NamedSharding

from lclm.data.packing import ROW_KEYS, Packer
from lclm.data.sources import SourceStats, open_documents
from lclm.data.stream import DocumentStream, Mixture
from lclm.ops.layout import batch_to_layout
from lclm.parallel.mesh import logical_spec

log = logging.getLogger(__name__)
SOURCE_KINDS = ("text", "sharegpt", "tokenized")


def batch_sharding(mesh) -> NamedSharding:
    """Per-token arrays `[batch, seq]`: batch over (dp, fsdp), sequence over sp."""
    return NamedSharding(mesh, logical_spec(("batch", "seq")))


def parse_sources(path: str, default_kind: str) -> list[tuple[str, str, float]]:
    """`config.data.path` as (kind, path, weight): comma-separated `[kind:]path[@weight]`."""
    out = []
    for entry in (e.strip() for e in path.split(",")):
        if not entry:
            continue
        kind, rest = default_kind, entry
        head, sep, tail = entry.partition(":")
        if sep and head in SOURCE_KINDS:
            kind, rest = head, tail
        weight = 1.0
        if "@" in rest:
            rest, w = rest.rsplit("@", 1)
            weight = float(w)
        out.append((kind, rest, weight))
    if not out:
        raise ValueError("config.data.path is empty; set it to a data file, directory or glob")
    return out


def host_block(sharding: NamedSharding, global_shape) -> tuple[slice, slice, int, int]:
    """This process's (rows, seq) block of the global batch, its data shard and the shard
    count (one shard per distinct row block across processes)."""
    def box(indices):
        rows = {(s[0].start or 0, s[0].stop or global_shape[0]) for s in indices}
        seqs = {(s[1].start or 0, s[1].stop or global_shape[1]) for s in indices}
        r = (min(a for a, _ in rows), max(b for _, b in rows))
        q = (min(a for a, _ in seqs), max(b for _, b in seqs))
        return r, q

    by_process: dict[int, list] = {}
    for device, idx in sharding.devices_indices_map(tuple(global_shape)).items():
        by_process.setdefault(device.process_index, []).append(idx)
    blocks = {p: box(idx) for p, idx in by_process.items()}
    row_blocks = sorted({b[0] for b in blocks.values()})
    (r0, r1), (s0, s1) = blocks[jax.process_index()]
    return slice(r0, r1), slice(s0, s1), row_blocks.index((r0, r1)), len(row_blocks)


class HostBatches:
    """Endless global batches `{key: jax.Array [batch, seq]}` for `config` on `mesh`."""

    def __init__(self, config, mesh, tokenizer, state: dict | None = None, prefetch: int = 2):
        d = config.data
        self.layout, self.sp = config.attention.layout, mesh.shape["sp"]
        self.sharding = batch_sharding(mesh)
        self.global_shape = (d.batch_size, d.seq_len)
        self.rows, self.seq, shard, num_shards = host_block(self.sharding, self.global_shape)
        self.stats = SourceStats()
        streams, weights = [], []
        for kind, path, weight in parse_sources(d.path, d.source):
            docs = open_documents(kind, path, tokenizer, text_field=d.text_field,
                                  chat_template=d.chat_template, stats=self.stats)
            streams.append(DocumentStream(docs, config.seed, shard, num_shards))
            weights.append(weight)
        self.mixture = Mixture(streams, weights, config.seed)
        self.packer = Packer(d.seq_len, d.reset_positions)
        self.batches = 0
        if state is not None:
            self.restore(state)
        self._state = self._snapshot()
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, prefetch))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, daemon=True)
        self._thread.start()
        self._logged_skips = 0

    # -- producer side (background thread) --
    def _snapshot(self) -> dict:
        return dict(mixture=self.mixture.state(), packer=self.packer.state(),
                    batches=self.batches)

    def restore(self, state: dict) -> None:
        self.mixture.restore(state["mixture"])
        self.packer.restore(state["packer"])
        self.batches = state["batches"]

    def next_host_batch(self) -> dict[str, np.ndarray]:
        """The next block of this process, in layout order (synchronous; no device arrays)."""
        n_rows = self.rows.stop - self.rows.start
        rows = []
        while len(rows) < n_rows:
            for row in self.packer.rows():
                rows.append(row)
                if len(rows) == n_rows:
                    break
            else:
                self.packer.add(*next(self.mixture))
        batch = {k: np.stack([r[k] for r in rows]) for k in ROW_KEYS}
        batch = batch_to_layout(batch, self.layout, self.sp)
        self.batches += 1
        return {k: np.ascontiguousarray(v[:, self.seq]) for k, v in batch.items()}

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
        local, state = self._queue.get()
        if isinstance(local, BaseException):
            raise local
        self._state = state
        if self.stats.skipped > self._logged_skips:
            log.warning("data: %s", self.stats.summary())
            self._logged_skips = self.stats.skipped
        return {k: jax.make_array_from_process_local_data(self.sharding, v, self.global_shape)
                for k, v in local.items()}

    def state(self) -> dict:
        """JSON state after the last batch returned by `next` (restore it to continue)."""
        return self._state

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

"""Packing documents into rows of exactly `seq_len` tokens, with resumable state.

Each row carries (all `[seq_len]`): `tokens`, `targets` (the next token), `loss_mask`
(1 where the target is a training target of the same document), `positions` (from the
document's start, or from the row's start without `reset_positions`), `segment_ids`
(documents numbered from 1 within the row). A document longer than the rest of a row
continues in the next row, positions continuing. All in original token order.
"""

from __future__ import annotations

import numpy as np

ROW_KEYS = ("tokens", "targets", "loss_mask", "positions", "segment_ids")


class Packer:
    """Accumulates documents and hands out complete rows (`pop_row`). Its state (the
    pending, partially consumed tokens in original order) is JSON-serialisable."""

    _FIELDS = ("tokens", "loss", "doc", "pos")

    def __init__(self, seq_len: int, reset_positions: bool = True):
        self.seq_len = seq_len
        self.reset_positions = reset_positions
        self._parts: list[dict[str, np.ndarray]] = []   # pending segments, in order
        self._pending = 0
        self._next_doc = 0   # document number (increasing) of the next added document

    def add(self, tokens: np.ndarray, loss: np.ndarray) -> None:
        n = len(tokens)
        self._parts.append(dict(tokens=np.asarray(tokens, np.int32),
                                loss=np.asarray(loss, np.int8),
                                doc=np.full(n, self._next_doc, np.int64),
                                pos=np.arange(n, dtype=np.int32)))
        self._pending += n
        self._next_doc += 1

    def _merged(self) -> dict[str, np.ndarray]:
        """The pending segments as one set of arrays (needs at least one segment)."""
        if len(self._parts) > 1:
            self._parts = [{k: np.concatenate([p[k] for p in self._parts]) for k in self._FIELDS}]
        return self._parts[0]

    def pop_row(self) -> dict[str, np.ndarray] | None:
        """The next complete row, or None until more documents are added. The last input
        token of a row is also the first of the next row's window (its target needs the
        following token)."""
        t = self.seq_len
        if self._pending < t + 1:
            return None
        buf = self._merged()
        w = slice(0, t + 1)
        tokens, doc = buf["tokens"][w], buf["doc"][w]
        same = doc[1:] == doc[:-1]
        row = dict(
            tokens=tokens[:-1].copy(), targets=tokens[1:].copy(),
            loss_mask=(buf["loss"][w][1:] * same).astype(np.float32),
            positions=(buf["pos"][:t].copy() if self.reset_positions
                       else np.arange(t, dtype=np.int32)),
            segment_ids=(doc[:-1] - doc[0] + 1).astype(np.int32))
        self._parts = [{k: v[t:] for k, v in buf.items()}]
        self._pending -= t
        return row

    def state(self) -> dict:
        buf = self._merged() if self._parts else {k: np.zeros(0, np.int64) for k in self._FIELDS}
        first = int(buf["doc"][0]) if len(buf["doc"]) else self._next_doc
        return dict(tokens=buf["tokens"].tolist(), loss=buf["loss"].tolist(),
                    doc=(buf["doc"] - first).tolist(), pos=buf["pos"].tolist(),
                    next_doc=self._next_doc - first)

    def restore(self, state: dict) -> None:
        self._parts = [dict(tokens=np.asarray(state["tokens"], np.int32),
                            loss=np.asarray(state["loss"], np.int8),
                            doc=np.asarray(state["doc"], np.int64),
                            pos=np.asarray(state["pos"], np.int32))]
        self._pending = len(state["tokens"])
        self._next_doc = state["next_doc"]


def pack_documents(docs, seq_len: int, reset_positions: bool = True):
    """Rows from an iterable of `(tokens, loss)` documents (see `Packer`)."""
    packer = Packer(seq_len, reset_positions)
    for tokens, loss in docs:
        packer.add(tokens, loss)
        while (row := packer.pop_row()) is not None:
            yield row

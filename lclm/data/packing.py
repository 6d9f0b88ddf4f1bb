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
    """Accumulates documents; `rows()` yields every complete row. Its state (the pending,
    partially consumed tokens in original order) is JSON-serialisable."""

    def __init__(self, seq_len: int, reset_positions: bool = True):
        self.seq_len = seq_len
        self.reset_positions = reset_positions
        self._tokens: list[int] = []
        self._loss: list[int] = []
        self._doc: list[int] = []     # document number (increasing) per pending token
        self._pos: list[int] = []     # position within its document
        self._next_doc = 0

    def add(self, tokens: np.ndarray, loss: np.ndarray) -> None:
        n = len(tokens)
        self._tokens.extend(int(t) for t in tokens)
        self._loss.extend(int(x) for x in loss)
        self._doc.extend([self._next_doc] * n)
        self._pos.extend(range(n))
        self._next_doc += 1

    def rows(self):
        """Complete rows now available. The last input token of a row is also the first of
        the next row's window (its target needs the following token)."""
        t = self.seq_len
        while len(self._tokens) >= t + 1:
            tokens = np.asarray(self._tokens[:t + 1], np.int32)
            doc = np.asarray(self._doc[:t + 1])
            loss = np.asarray(self._loss[1:t + 1], np.float32)
            same = doc[1:] == doc[:-1]
            yield dict(
                tokens=tokens[:-1], targets=tokens[1:],
                loss_mask=(loss * same).astype(np.float32),
                positions=(np.asarray(self._pos[:t], np.int32) if self.reset_positions
                           else np.arange(t, dtype=np.int32)),
                segment_ids=(doc[:-1] - doc[0] + 1).astype(np.int32))
            del self._tokens[:t], self._loss[:t], self._doc[:t], self._pos[:t]

    def state(self) -> dict:
        first = self._doc[0] if self._doc else self._next_doc
        return dict(tokens=list(self._tokens), loss=list(self._loss),
                    doc=[d - first for d in self._doc], pos=list(self._pos),
                    next_doc=self._next_doc - first)

    def restore(self, state: dict) -> None:
        self._tokens, self._loss = list(state["tokens"]), list(state["loss"])
        self._doc, self._pos = list(state["doc"]), list(state["pos"])
        self._next_doc = state["next_doc"]


def pack_documents(docs, seq_len: int, reset_positions: bool = True):
    """Rows from an iterable of `(tokens, loss)` documents (see `Packer`)."""
    packer = Packer(seq_len, reset_positions)
    for tokens, loss in docs:
        packer.add(tokens, loss)
        yield from packer.rows()

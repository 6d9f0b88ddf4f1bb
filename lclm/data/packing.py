"""Packing documents into rows of exactly `seq_len` tokens, with resumable state.

Each row carries (all `[seq_len]`): `tokens`, `targets` (the next token), `loss_mask`
(1 where the target is a training target of the same document), `positions` (from the
document's start, or from the row's start without `reset_positions`), `segment_ids`
(documents numbered from 1 within the row). A document longer than the rest of a row
continues in the next row, positions continuing. All in original token order.

A window whose every target is masked (a chat's long prompt, documents of one token) is
skipped, not emitted: such a row would cost a step and teach nothing. Which windows are
skipped follows from the documents alone, so a resumed stream skips the same ones.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import numpy as np

from lclm.data.records import DataError

ROW_KEYS = ("tokens", "targets", "loss_mask", "positions", "segment_ids")
# windows without a trained target in a row after which the data is taken to have none
MAX_EMPTY_WINDOWS = 1000


class Packer:
    """Accumulates documents and hands out complete rows (`pop_row`).

    Its state is positions, not tokens, so it stays small whatever the documents' lengths:
    `{"documents": k, "consumed": c}` says that the pending tokens are those of the last k
    documents added, less the first c tokens of the first of them. Whoever feeds the packer
    draws those k documents again to restore it (documents are deterministic).
    """

    _FIELDS = ("tokens", "loss", "doc", "pos")

    def __init__(self, seq_len: int, reset_positions: bool = True):
        self.seq_len = seq_len
        self.reset_positions = reset_positions
        self._parts: list[dict[str, np.ndarray]] = []  # pending segments, in order
        self._pending = 0
        self._next_doc = 0  # document number (increasing) of the next added document
        self._lengths: collections.deque[int] = collections.deque()  # of pending documents
        self._consumed = 0  # tokens of the first pending document already dropped
        # windows skipped since the last row: not in the state, it only bounds the search
        # (and the loader saves a state just after a row, where it is 0)
        self._empty = 0

    def add(self, tokens: np.ndarray, loss: np.ndarray) -> None:
        """A new document, its tokens (or its first part's: see `extend`)."""
        self._next_doc += 1
        self._lengths.append(0)
        self.extend(tokens, loss)

    def extend(self, tokens: np.ndarray, loss: np.ndarray) -> None:
        """More tokens of the document added last (its next part: positions go on)."""
        n, start = len(tokens), self._lengths[-1]
        self._parts.append(
            dict(
                tokens=np.asarray(tokens, np.int32),
                loss=np.asarray(loss, np.int8),
                doc=np.full(n, self._next_doc - 1, np.int64),
                pos=np.arange(start, start + n, dtype=np.int32),
            )
        )
        self._pending += n
        self._lengths[-1] += n

    def _merged(self) -> dict[str, np.ndarray]:
        """The pending segments as one set of arrays (needs at least one segment)."""
        if len(self._parts) > 1:
            self._parts = [{k: np.concatenate([p[k] for p in self._parts]) for k in self._FIELDS}]
        return self._parts[0]

    def _drop(self, n: int) -> None:
        """Forget the first `n` pending tokens."""
        self._parts = [{k: v[n:] for k, v in self._merged().items()}]
        self._pending -= n
        self._consumed += n

    def pop_row(self) -> dict[str, np.ndarray] | None:
        """The next complete row with at least one trained target, or None until more
        documents are added. The last input token of a row is also the first of the next
        row's window (its target needs the following token)."""
        while self._pending >= self.seq_len + 1:
            row = self._window()
            self._advance()
            if row["loss_mask"].any():
                self._empty = 0
                return row
            self._empty += 1
            if self._empty >= MAX_EMPTY_WINDOWS:
                raise DataError(
                    f"{self._empty} windows of {self.seq_len} tokens in a row have no trained "
                    "target (every target masked): the data has nothing to learn; check "
                    "data.path and data.chat_template: records need trained text (a chat's "
                    "answers, documents of more than one token)"
                )
        return None

    def _window(self) -> dict[str, np.ndarray]:
        """The row of the first `seq_len + 1` pending tokens (there are that many)."""
        t = self.seq_len
        buf = self._merged()
        w = slice(0, t + 1)
        tokens, doc = buf["tokens"][w], buf["doc"][w]
        same = doc[1:] == doc[:-1]
        return dict(
            tokens=tokens[:-1].copy(),
            targets=tokens[1:].copy(),
            loss_mask=(buf["loss"][w][1:] * same).astype(np.float32),
            positions=(
                buf["pos"][:t].copy() if self.reset_positions else np.arange(t, dtype=np.int32)
            ),
            segment_ids=(doc[:-1] - doc[0] + 1).astype(np.int32),
        )

    def _advance(self) -> None:
        """Move past one row's tokens, forgetting the documents it finished."""
        self._drop(self.seq_len)
        while self._lengths and self._consumed >= self._lengths[0]:
            self._consumed -= self._lengths.popleft()

    @property
    def documents(self) -> int:
        """How many of the documents added last still have pending tokens."""
        return len(self._lengths)

    def state(self) -> dict:
        return dict(documents=len(self._lengths), consumed=self._consumed)

    def restore(self, state: dict, draw: Callable[[], tuple[np.ndarray, np.ndarray]]) -> None:
        """Continue from `state` (on a new packer); `draw()` gives its pending documents
        again, in order."""
        if "tokens" in state:
            raise DataError(
                "this data state was saved by an older lclm (it holds pending "
                "tokens, not positions); resume it with that version, or start a "
                "new run from its weights with model.init_from_checkpoint"
            )
        for _ in range(state["documents"]):
            self.add(*draw())
        consumed = state["consumed"]
        if consumed:
            if consumed >= self._lengths[0]:  # the one mismatch that is cheap to see
                raise DataError(
                    f"the saved data state has consumed {consumed} tokens of a "
                    f"document that now has {self._lengths[0]}; did the data "
                    "(data.path, its files or the tokenizer) change?"
                )
            self._drop(consumed)

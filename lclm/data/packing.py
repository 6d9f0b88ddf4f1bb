"""Packing documents into fixed-length rows with segment ids, positions and loss masks."""

from __future__ import annotations

from typing import Iterable, Iterator

import numpy as np

ROW_KEYS = ("tokens", "targets", "loss_mask", "positions", "segment_ids")


def pack_documents(docs: Iterable[list[int]], seq_len: int, reset_positions: bool = True
                   ) -> Iterator[dict[str, np.ndarray]]:
    """Concatenate tokenised documents (each already wrapped in BOS ... EOS) into rows.

    Every row holds `seq_len` input tokens and their next-token targets; a document longer
    than the rest of a row continues in the next one (positions continue too). Per token:
    `segment_ids` number the documents within the row (from 1), `positions` count from the
    document's start (or from the row's start without `reset_positions`), and `loss_mask` is
    0 where the target belongs to another document.
    """
    tokens: list[int] = []
    doc_ids: list[int] = []
    doc_pos: list[int] = []
    for doc_index, doc in enumerate(docs):
        tokens.extend(doc)
        doc_ids.extend([doc_index] * len(doc))
        doc_pos.extend(range(len(doc)))
        while len(tokens) >= seq_len + 1:
            ids = np.asarray(doc_ids[:seq_len + 1])
            window = np.asarray(tokens[:seq_len + 1], np.int32)
            seg = (ids[:-1] - ids[0] + 1).astype(np.int32)
            pos = np.asarray(doc_pos[:seq_len], np.int32)
            yield dict(
                tokens=window[:-1], targets=window[1:],
                loss_mask=(ids[1:] == ids[:-1]).astype(np.float32),
                positions=pos if reset_positions else np.arange(seq_len, dtype=np.int32),
                segment_ids=seg)
            del tokens[:seq_len], doc_ids[:seq_len], doc_pos[:seq_len]

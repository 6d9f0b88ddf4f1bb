"""Packing: every token once and in order, document segments, positions and loss masks."""

import json

import numpy as np
import pytest
from support import pack_documents

from lclm.data.packing import Packer
from lclm.data.sources import DataError


def _docs(seed, n=20, max_len=30):
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n):
        body = rng.integers(3, 50, rng.integers(1, max_len))
        tokens = np.concatenate([[1], body, [2]]).astype(np.int32)
        loss = np.ones(len(tokens), np.int8)
        loss[0] = 0
        docs.append((tokens, loss))
    return docs


def test_rows_keep_every_token_once_in_order_with_document_boundaries():
    docs = _docs(0)
    stream = np.concatenate([t for t, _ in docs])
    seq = 16
    rows = list(pack_documents(iter(docs), seq))
    assert len(rows) == (len(stream) - 1) // seq
    np.testing.assert_array_equal(np.concatenate([r["tokens"] for r in rows]),
                                  stream[:len(rows) * seq])
    for i, r in enumerate(rows):
        assert all(r[k].shape == (seq,) for k in r)
        np.testing.assert_array_equal(r["targets"], stream[i * seq + 1:(i + 1) * seq + 1])
        starts = np.flatnonzero(np.diff(r["segment_ids"]) != 0) + 1
        assert all(r["tokens"][s] == 1 for s in starts)        # a new segment starts at BOS
        assert all(r["positions"][s] == 0 for s in starts)     # and positions restart
        assert r["segment_ids"][0] == 1
        np.testing.assert_array_equal(r["loss_mask"] == 0, r["targets"] == 1)  # EOS -> BOS
    doc_pos = np.concatenate([np.arange(len(t)) for t, _ in docs])
    np.testing.assert_array_equal(np.concatenate([r["positions"] for r in rows]),
                                  doc_pos[:len(rows) * seq])  # continued documents continue


def _pack(packer, docs, rows):
    for tokens, loss in docs:
        packer.add(tokens, loss)
        while (row := packer.pop_row()) is not None:
            rows.append(row)


@pytest.mark.parametrize("max_len", [30, 200])  # documents shorter or longer than rows
def test_packer_state_is_positions_and_resumes_the_partial_row_exactly(max_len):
    docs = _docs(1, n=30, max_len=max_len)
    whole = list(pack_documents(iter(docs), 24))
    for cut in (1, 11, 17):
        packer, got = Packer(24), []
        _pack(packer, docs[:cut], got)
        state = json.loads(json.dumps(packer.state()))
        assert set(state) == {"documents", "consumed"}
        # the feeder draws the pending documents again, from the first still pending
        redraw = iter(docs[cut - state["documents"]:])
        resumed = Packer(24)
        resumed.restore(state, lambda redraw=redraw: next(redraw))
        _pack(resumed, redraw, got)
        assert len(got) == len(whole)
        for a, b in zip(got, whole):
            for k in a:
                np.testing.assert_array_equal(a[k], b[k])


def test_packer_restore_fails_clearly_on_old_states_and_changed_data():
    with pytest.raises(DataError, match="saved by an older lclm"):
        Packer(8).restore({"tokens": [1, 2], "loss": [0, 1], "doc": [0, 0], "pos": [0, 1],
                           "next_doc": 1}, lambda: None)
    short = (np.arange(5, dtype=np.int32), np.ones(5, np.int8))
    with pytest.raises(DataError, match="consumed 9 tokens of a document that now has 5"):
        Packer(8).restore({"documents": 1, "consumed": 9}, lambda: short)

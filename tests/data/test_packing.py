"""Packing: every token once and in order, document segments, positions and loss masks; a
window with no trained target is skipped, the same ones on resume."""

import json
import os

import numpy as np
import pytest
from support import DEMO_CONFIG, ROOT, pack_documents

from lclm.config import load_config
from lclm.config.run_config import run_config
from lclm.data.loader import HostBatches
from lclm.data.packing import MAX_EMPTY_WINDOWS, Packer
from lclm.data.sources import DataError
from lclm.data.tokenizer import Tokenizer
from lclm.parallel import make_mesh

DEMO_CHATS = os.path.join(ROOT, "data", "demo", "sharegpt.jsonl")


def _docs(seed, n=20, max_len=30, prompt=0):
    """`n` documents of BOS, up to `max_len` tokens and EOS; the first `prompt` tokens of
    each (at most all of it) are not trained, as a chat's prompt is not."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n):
        body = rng.integers(3, 50, rng.integers(1, max_len))
        tokens = np.concatenate([[1], body, [2]]).astype(np.int32)
        loss = np.ones(len(tokens), np.int8)
        loss[: max(prompt, 1)] = 0
        docs.append((tokens, loss))
    return docs


def test_rows_keep_every_token_once_in_order_with_document_boundaries():
    docs = _docs(0)
    stream = np.concatenate([t for t, _ in docs])
    seq = 16
    rows = list(pack_documents(iter(docs), seq))
    assert len(rows) == (len(stream) - 1) // seq
    np.testing.assert_array_equal(
        np.concatenate([r["tokens"] for r in rows]), stream[: len(rows) * seq]
    )
    for i, r in enumerate(rows):
        assert all(r[k].shape == (seq,) for k in r)
        np.testing.assert_array_equal(r["targets"], stream[i * seq + 1 : (i + 1) * seq + 1])
        starts = np.flatnonzero(np.diff(r["segment_ids"]) != 0) + 1
        assert all(r["tokens"][s] == 1 for s in starts)  # a new segment starts at BOS
        assert all(r["positions"][s] == 0 for s in starts)  # and positions restart
        assert r["segment_ids"][0] == 1
        np.testing.assert_array_equal(r["loss_mask"] == 0, r["targets"] == 1)  # EOS -> BOS
    doc_pos = np.concatenate([np.arange(len(t)) for t, _ in docs])
    np.testing.assert_array_equal(
        np.concatenate([r["positions"] for r in rows]), doc_pos[: len(rows) * seq]
    )  # continued documents continue


def _pack(packer, docs, rows):
    for tokens, loss in docs:
        packer.add(tokens, loss)
        while (row := packer.pop_row()) is not None:
            rows.append(row)


def test_windows_with_no_trained_target_are_skipped():
    """Long prompts: some windows of the stream have every target masked. The rows are the
    stream's windows less exactly those."""
    docs = _docs(2, n=40, max_len=80, prompt=60)
    seq = 16
    stream = np.concatenate([t for t, _ in docs])
    trained = np.concatenate([np.r_[loss[1:], 0] for _, loss in docs])  # target's mask, by input
    windows = [i * seq for i in range((len(stream) - 1) // seq)]
    kept = [w for w in windows if trained[w : w + seq].any()]
    assert 0 < len(kept) < len(windows)  # the docs do give windows with nothing to learn
    rows = list(pack_documents(iter(docs), seq))
    assert [r["loss_mask"].any() for r in rows] == [True] * len(kept)
    for w, r in zip(kept, rows, strict=True):
        np.testing.assert_array_equal(r["tokens"], stream[w : w + seq])
        np.testing.assert_array_equal(r["loss_mask"] > 0, trained[w : w + seq] > 0)


def test_data_with_nothing_to_learn_fails_in_one_line_not_forever():
    packer = Packer(8)
    nothing = (np.arange(50, dtype=np.int32), np.zeros(50, np.int8))
    with pytest.raises(
        DataError, match=f"{MAX_EMPTY_WINDOWS} windows of 8 tokens in a row have no trained target"
    ):
        for _ in range(MAX_EMPTY_WINDOWS):
            packer.add(*nothing)
            assert packer.pop_row() is None


# documents shorter or longer than rows; with long prompts some windows are skipped
@pytest.mark.parametrize("max_len,prompt", [(30, 0), (200, 0), (200, 150)])
def test_packer_state_is_positions_and_resumes_the_partial_row_exactly(max_len, prompt):
    docs = _docs(1, n=30, max_len=max_len, prompt=prompt)
    whole = list(pack_documents(iter(docs), 24))
    windows = (sum(len(t) for t, _ in docs) - 1) // 24
    assert (len(whole) < windows) == (prompt > 0)  # long prompts: some windows skipped
    for cut in (1, 11, 17):
        packer, got = Packer(24), []
        _pack(packer, docs[:cut], got)
        state = json.loads(json.dumps(packer.state()))
        assert set(state) == {"documents", "consumed"}
        # the feeder draws the pending documents again, from the first still pending
        redraw = iter(docs[cut - state["documents"] :])
        resumed = Packer(24)
        resumed.restore(state, lambda redraw=redraw: next(redraw))
        _pack(resumed, redraw, got)
        assert len(got) == len(whole)
        for a, b in zip(got, whole):
            for k in a:
                np.testing.assert_array_equal(a[k], b[k])


def test_packer_restore_fails_clearly_on_old_states_and_changed_data():
    with pytest.raises(DataError, match="saved by an older lclm"):
        Packer(8).restore(
            {"tokens": [1, 2], "loss": [0, 1], "doc": [0, 0], "pos": [0, 1], "next_doc": 1},
            lambda: None,
        )
    short = (np.arange(5, dtype=np.int32), np.ones(5, np.int8))
    with pytest.raises(DataError, match="consumed 9 tokens of a document that now has 5"):
        Packer(8).restore({"documents": 1, "consumed": 9}, lambda: short)


def test_the_demo_chats_at_64_tokens_give_no_row_without_a_trained_target_and_resume_exactly():
    """The bundled ShareGPT conversations at 64 tokens: their first two windows in each of
    two rows are prompt only (every target masked), so they once made whole batches of loss
    0. Every row now has a trained target, and a loader resumed after two batches reads the
    rest of an uninterrupted one's batches."""
    config = load_config(
        DEMO_CONFIG,
        {
            "data.source": "sharegpt",
            "data.path": DEMO_CHATS,
            "data.seq_len": 64,
            "data.batch_size": 2,
        },
    )
    mesh, tokenizer = make_mesh(fsdp=1, sp=1), Tokenizer(config.data.tokenizer)

    def loader(state=None):
        return HostBatches(run_config(config), mesh, tokenizer, state=state, prefetch=0)

    def batch(reader):  # one device: the layout is the original order
        return {k: np.asarray(v) for k, v in next(reader).items()}

    whole = loader()
    batches = [batch(whole) for _ in range(6)]
    whole.close()
    assert all((b["loss_mask"].sum(axis=1) > 0).all() for b in batches)
    first = loader()
    for _ in range(2):
        next(first)
    state = json.loads(json.dumps(first.state()))
    first.close()
    assert state["slots"]["0"]["packer"]["consumed"] == 4 * 64  # two windows skipped
    resumed = loader(state)
    for want in batches[2:]:
        got = batch(resumed)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])
    resumed.close()

"""Preparing into a directory that a run reads: the run keeps its documents, a failed prepare
leaves the previous data, and a reader never takes a mix of two prepares for one."""

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support import DEMO_TOKENIZER

from lclm.data import prepare as prepare_module
from lclm.data.prepare import OUTPUTS, prepare
from lclm.data.prepared import TOKENIZED_META
from lclm.data.sources import DataError, open_documents
from lclm.data.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(DEMO_TOKENIZER)


def write_corpus(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


def all_documents(docs):
    return [(t.tolist(), l.tolist()) for t, l in (docs[i] for i in range(len(docs)))]


@pytest.fixture
def prepared(tmp_path, tok):
    """A directory prepared from 3000 documents (tokens.bin spans many pages: reading past
    the end of a file truncated under a map is a SIGBUS), and its documents."""
    texts = [f"Ada counted {i} plus {i % 7} and wrote it down." for i in range(3000)]
    out = tmp_path / "out"
    prepare("text", write_corpus(tmp_path / "a.jsonl", texts), DEMO_TOKENIZER, str(out))
    return out, all_documents(open_documents("tokenized", str(out), tok))


def only_outputs(out):
    return sorted(os.listdir(out)) == sorted(OUTPUTS)


def test_a_reader_keeps_its_documents_when_the_directory_is_prepared_again(tmp_path, tok, prepared):
    out, before = prepared
    reading = open_documents("tokenized", str(out), tok)
    meta = prepare(
        "text",
        write_corpus(tmp_path / "b.jsonl", ["Bruno wrote 4.", "Yes."]),
        DEMO_TOKENIZER,
        str(out),
    )
    assert meta["documents"] == 2 and only_outputs(out)
    assert all_documents(reading) == before
    again = open_documents("tokenized", str(out), tok)
    assert [tok.decode(t[1:-1]) for t, _ in all_documents(again)] == ["Bruno wrote 4.", "Yes."]


def test_a_failed_prepare_leaves_the_previous_data(tmp_path, tok, prepared, monkeypatch):
    out, before = prepared
    pq.write_table(pa.table({"text": ["", " "]}), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match="every one of its 2 records is malformed"):
        prepare("text", str(tmp_path / "bad.parquet"), DEMO_TOKENIZER, str(out))

    def failing_midway(*args, **kwargs):
        docs = open_documents(*args, **kwargs)

        class Failing:
            def __len__(self):
                return len(docs)

            def __getitem__(self, i):
                if i == 2000:
                    raise OSError("input unreadable")
                return docs[i]

        return Failing()

    monkeypatch.setattr(prepare_module, "open_documents", failing_midway)
    with pytest.raises(OSError, match="input unreadable"):
        prepare("text", str(tmp_path / "a.jsonl"), DEMO_TOKENIZER, str(out))
    assert only_outputs(out)
    assert all_documents(open_documents("tokenized", str(out), tok)) == before


def test_the_leftovers_of_a_killed_prepare_are_removed(tmp_path, prepared):
    out, _ = prepared
    for name in OUTPUTS:
        (out / f".{name}.x1y2z3.tmp").write_bytes(b"half-written")
    prepare("text", str(tmp_path / "a.jsonl"), DEMO_TOKENIZER, str(out))
    assert only_outputs(out)


def test_a_reader_refuses_the_files_of_two_prepares(tmp_path, tok):
    """Old metadata over new offsets (a reader opening the directory while it is prepared
    again, or a prepare killed between its renames) fails in one line, even where every
    size agrees."""
    word = "apple"
    one = len(tok.encode(word))
    assert len(tok.encode(" ".join([word] * 4))) == 4 * one  # each word: the same tokens
    out = tmp_path / "out"
    texts = {
        "a": [" ".join([word] * n) for n in (2, 6)],
        "b": [" ".join([word] * n) for n in (4, 4)],
    }
    prepare("text", write_corpus(tmp_path / "a.jsonl", texts["a"]), DEMO_TOKENIZER, str(out))
    old_meta = (out / TOKENIZED_META).read_text()
    prepare("text", write_corpus(tmp_path / "b.jsonl", texts["b"]), DEMO_TOKENIZER, str(out))
    (out / TOKENIZED_META).write_text(old_meta)
    with pytest.raises(
        DataError, match="offsets.bin is not the one its lclm_tokens.json describes"
    ) as e:
        open_documents("tokenized", str(out), tok)
    assert "\n" not in str(e.value)


def test_directories_prepared_before_the_offsets_fingerprint_still_open(tmp_path, tok):
    out = tmp_path / "out"
    prepare("text", write_corpus(tmp_path / "a.jsonl", ["one", "two"]), DEMO_TOKENIZER, str(out))
    meta = json.loads((out / TOKENIZED_META).read_text())
    del meta["offsets_sha256"]
    (out / TOKENIZED_META).write_text(json.dumps(meta))
    docs = open_documents("tokenized", str(out), tok)
    np.testing.assert_array_equal(docs[1][0], [tok.bos_id, *tok.encode("two"), tok.eos_id])

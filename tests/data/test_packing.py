"""Packing: rows of exactly seq_len, document segments, positions and loss masks."""

import os

import numpy as np

from lclm.data.packing import pack_documents
from lclm.data.sources import SourceStats, read_documents
from lclm.data.tokenizer import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_pack_documents_keeps_every_token_and_marks_documents():
    rng = np.random.default_rng(0)
    docs = [[1] + list(rng.integers(3, 50, rng.integers(1, 30))) + [2] for _ in range(20)]
    stream = [t for d in docs for t in d]
    seq = 16
    rows = list(pack_documents(iter(docs), seq))
    assert len(rows) == (len(stream) - 1) // seq
    for i, r in enumerate(rows):
        assert all(r[k].shape == (seq,) for k in r)
        np.testing.assert_array_equal(r["tokens"], stream[i * seq:(i + 1) * seq])
        np.testing.assert_array_equal(r["targets"], stream[i * seq + 1:(i + 1) * seq + 1])
        # a new segment starts exactly at a BOS (except a continued document at row start)
        starts = np.flatnonzero(np.diff(r["segment_ids"]) != 0) + 1
        assert all(r["tokens"][s] == 1 for s in starts)
        assert all(r["positions"][s] == 0 for s in starts)
        # EOS -> next BOS is not a target to learn
        np.testing.assert_array_equal(r["loss_mask"] == 0, (r["targets"] == 1))
    # positions continue across rows for a document that spills over
    doc_pos = [p for d in docs for p in range(len(d))]
    np.testing.assert_array_equal(np.concatenate([r["positions"] for r in rows]),
                                  doc_pos[:len(rows) * seq])


def test_malformed_records_are_skipped_and_counted(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_bytes(b'{"text": "good one"}\n{bad json\n{"other": 1}\n{"text": ""}\n'
                     b'{"text": "caf\xff bad utf8"}\n{"text": 5}\n{"text": "good two"}\n')
    stats = SourceStats()
    docs = list(read_documents(str(path), "text", stats))
    assert docs[0] == "good one" and docs[-1] == "good two" and len(docs) == 3
    assert stats.skipped == 4 and len(stats.examples) == 4


def test_bundled_tokenizer_is_llama_style():
    tok = Tokenizer(os.path.join(ROOT, "data", "demo", "tokenizer.model"))
    assert (tok.bos_id, tok.eos_id) == (1, 2) and tok.vocab_size == 512
    text = "Ada counted 12 plus 7 and wrote 19."
    assert tok.decode(tok.encode(text)) == text

"""Sources: tolerant reading, ShareGPT rendering with assistant-only loss, pre-tokenised files."""

import json
import os

import numpy as np
import pytest

from lclm.data.chat import TEMPLATES, conversation_turns, render
from lclm.data.prepare import prepare
from lclm.data.sources import SourceStats, open_documents
from lclm.data.synthetic import conversations
from lclm.data.tokenizer import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER = os.path.join(ROOT, "data", "demo", "tokenizer.model")


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(TOKENIZER)


def test_bundled_tokenizer_is_llama_style(tok):
    assert (tok.bos_id, tok.eos_id) == (1, 2) and tok.vocab_size == 512
    text = "Ada counted 12 plus 7 and wrote 19."
    assert tok.decode(tok.encode(text)) == text
    with pytest.raises(ValueError, match="model.vocab_size=256"):
        tok.check_fits(256)


def test_malformed_records_are_skipped_and_counted(tmp_path, tok):
    path = tmp_path / "docs.jsonl"
    path.write_bytes(b'{"text": "good one"}\n{bad json\n{"other": 1}\n{"text": ""}\n'
                     b'{"text": "caf\xff bad utf8"}\n{"text": 5}\n[1, 2]\n{"text": "good two"}\n')
    stats = SourceStats()
    docs = open_documents("text", str(path), tok, stats=stats)
    got = [docs[i] for i in range(len(docs))]
    kept = [tok.decode(d[0][1:-1]) for d in got if d is not None]
    assert kept[0] == "good one" and kept[-1] == "good two" and len(kept) == 3
    # bad UTF-8 (file-level, replaced), bad JSON line, 4 records without usable text
    assert stats.skipped == 6 and len(stats.examples) == 5


def test_missing_and_empty_sources_fail_clearly(tmp_path, tok):
    with pytest.raises(FileNotFoundError, match="no data files"):
        open_documents("text", str(tmp_path / "nope.jsonl"), tok)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="holds no records"):
        open_documents("text", str(tmp_path / "empty.jsonl"), tok)


def test_sharegpt_loss_covers_exactly_the_assistant_turns(tok):
    record = {"conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Ada has 3 apples."},
        {"from": "gpt", "value": "Ada has 3 apples."},
        {"from": "user", "value": "And Bruno?"},
        {"from": "assistant", "value": "Bruno counted 4."}]}
    turns = conversation_turns(record)
    tokens, flags = render(turns, tok, TEMPLATES["vicuna"])
    assert tokens[0] == tok.bos_id and flags[0] == 0
    # the trained spans decode to the replies, each followed by EOS
    spans, cur = [], []
    for t, f in zip(tokens, flags):
        if f:
            cur.append(t)
        elif cur:
            spans.append(cur)
            cur = []
    spans.append(cur)
    assert [s[-1] for s in spans] == [tok.eos_id, tok.eos_id]
    assert [tok.decode(s[:-1]).strip() for s in spans] == ["Ada has 3 apples.", "Bruno counted 4."]
    assert int((tokens == tok.eos_id).sum()) == 2
    text = tok.decode(tokens)
    assert "Be brief. USER: Ada has 3 apples. ASSISTANT: Ada has 3 apples." in text
    # roles spelled differently and malformed conversations
    assert conversation_turns({"messages": [{"role": "user", "content": "hi"},
                                            {"role": "assistant", "content": "yo"}]})
    assert conversation_turns({"conversations": [{"from": "human", "value": "only a question"}]}) is None
    assert conversation_turns({"conversations": [{"from": "alien", "value": "x"}]}) is None


def test_prepare_writes_memmap_documents_equal_to_on_the_fly(tmp_path, tok):
    path = tmp_path / "chats.json"
    records = conversations(40, seed=3)
    records.insert(5, {"conversations": "broken"})
    path.write_text(json.dumps(records))
    meta = prepare("sharegpt", str(path), TOKENIZER, str(tmp_path / "out"))
    assert meta["documents"] == 40 and meta["skipped"] == 1
    stored = open_documents("tokenized", str(tmp_path / "out"), tok)
    live = open_documents("sharegpt", str(path), tok)
    live_docs = [live[i] for i in range(len(live)) if live[i] is not None]
    assert len(stored) == len(live_docs) == 40
    for i, (t, l) in enumerate(live_docs):
        np.testing.assert_array_equal(stored[i][0], t)
        np.testing.assert_array_equal(stored[i][1], l)


def test_parquet_arrow_and_saved_datasets_directories(tmp_path, tok):
    import datasets
    texts = [f"Ada counted {i} plus {i} and wrote {2 * i}." for i in range(12)]
    ds = datasets.Dataset.from_dict({"body": texts})
    ds.to_parquet(str(tmp_path / "part.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    arrow = sorted((tmp_path / "saved").glob("*.arrow"))[0]
    for path in (tmp_path / "part.parquet", tmp_path / "saved", arrow):
        docs = open_documents("text", str(path), tok, text_field="body")
        assert len(docs) == 12
        assert tok.decode(docs[3][0][1:-1]) == texts[3]

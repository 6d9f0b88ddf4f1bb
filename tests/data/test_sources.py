"""Sources: tolerant reading, ShareGPT rendering with assistant-only loss, pre-tokenised files."""

import json

import numpy as np
import pytest
from support import DEMO_TOKENIZER

from lclm.data.chat import TEMPLATES, conversation_turns, render
from lclm.data.prepare import prepare
from lclm.data.sources import DataError, open_documents
from lclm.data.stats import SourceStats
from lclm.data.synthetic import conversations
from lclm.data.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(DEMO_TOKENIZER)


def test_bundled_tokenizer_is_llama_style(tok):
    assert (tok.bos_id, tok.eos_id) == (1, 2) and tok.vocab_size == 512
    text = "Ada counted 12 plus 7 and wrote 19."
    assert tok.decode(tok.encode(text)) == text
    with pytest.raises(ValueError, match="model.vocab_size=256"):
        tok.check_fits(256)


def test_malformed_records_are_skipped_and_counted(tmp_path, tok):
    path = tmp_path / "docs.jsonl"
    path.write_bytes(
        b'{"text": "good one"}\n{bad json\n{"other": 1}\n{"text": ""}\n'
        b'{"text": "caf\xff bad utf8"}\n{"text": 5}\n[1, 2]\n{"text": "good two"}\n'
        b'{"text": "lone \\ud800 surrogate"}\n'
    )
    stats = SourceStats()
    docs = open_documents("text", str(path), tok, stats=stats)
    for _ in range(3):  # every epoch reads every document again: nothing is counted again
        kept = [tok.decode(docs[i][0][1:-1]) for i in range(len(docs))]
    assert kept == ["good one", "good two"]
    # bad JSON, 4 records without usable text, the line with a bad byte (not the whole
    # file), and an escaped lone surrogate (no tokenizer can encode it)
    assert stats.skipped == 7 and len(stats.examples) == 5
    assert f"{path}:5: invalid UTF-8" in stats.examples
    assert stats.examples[0].startswith(f"{path}:2: bad JSON (Expecting property name")


def test_bad_bytes_cost_one_record_in_txt_and_json_files(tmp_path, tok):
    (tmp_path / "a.txt").write_bytes(b"first doc\n\nsecond \xfe doc\n\n\n\nthird doc\n")
    (tmp_path / "b.json").write_bytes(b'[{"text": "kept"}, {"text": "bad \xc3"}]')
    stats = SourceStats()
    docs = open_documents("text", str(tmp_path), tok, stats=stats)
    assert [tok.decode(docs[i][0][1:-1]) for i in range(len(docs))] == [
        "first doc",
        "third doc",
        "kept",
    ]
    assert stats.examples == [
        f"{tmp_path}/a.txt:3: invalid UTF-8",
        f"{tmp_path}/b.json[1]: invalid UTF-8",
    ]


def test_arrow_records_are_checked_as_read_and_counted_once(tmp_path, tok):
    import datasets

    datasets.Dataset.from_dict({"text": ["one", "", "three"]}).to_parquet(
        str(tmp_path / "p.parquet")
    )
    stats = SourceStats()
    docs = open_documents("text", str(tmp_path / "p.parquet"), tok, stats=stats)
    for _ in range(3):
        assert [docs[i] is None for i in range(len(docs))] == [False, True, False]
    assert stats.skipped == 1
    datasets.Dataset.from_dict({"text": [" ", ""]}).to_parquet(str(tmp_path / "bad.parquet"))
    docs = open_documents("text", str(tmp_path / "bad.parquet"), tok)
    docs[0]
    with pytest.raises(DataError, match=r"bad.parquet: every one of its 2 records is malformed"):
        docs[1]


def _binary(seed):
    return np.random.default_rng(seed).integers(0, 256, 3000, dtype=np.uint8).tobytes()


@pytest.mark.parametrize(
    "name,content,message",
    [
        ("empty.jsonl", b"\n \n", "is empty"),
        ("empty.txt", b"", "is empty"),
        ("binary.jsonl", _binary(0), "holds no usable record"),
        ("binary.txt", _binary(1), "holds no usable record"),
        ("binary.json", _binary(2), "holds no usable record"),
        ("dict.json", b'{"text": "a"}', "holds no usable record .* must hold a list"),
        (
            "field.jsonl",
            b'{"body": "a"}\n{"body": "b"}\n',
            "2 malformed, the first .*:1: no non-empty",
        ),
    ],
)
def test_unusable_files_fail_when_opened_naming_the_file(tmp_path, tok, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    (tmp_path / "fine.jsonl").write_text('{"text": "a fine document"}\n')
    for source in (str(path), str(tmp_path)):  # alone, or beside a usable file
        with pytest.raises(DataError, match=message) as e:
            open_documents("text", source, tok)
        assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_unusable_datasets_and_tokenized_dirs_fail_when_opened(tmp_path, tok):
    import datasets

    datasets.Dataset.from_dict({"body": ["a", "b"]}).to_parquet(str(tmp_path / "p.parquet"))
    with pytest.raises(DataError, match=r"p.parquet.* has no column 'text' \(its columns: body\)"):
        open_documents("text", str(tmp_path / "p.parquet"), tok)
    with pytest.raises(DataError, match="no column 'conversations' or 'messages'"):
        open_documents("sharegpt", str(tmp_path / "p.parquet"), tok)
    (tmp_path / "c.jsonl").write_text("\n".join(f'{{"text": "doc {i}"}}' for i in range(6)))
    out = tmp_path / "out"
    prepare("text", str(tmp_path / "c.jsonl"), DEMO_TOKENIZER, str(out))
    with open(out / "tokens.bin", "r+b") as f:
        f.truncate(8)
    with pytest.raises(DataError, match=r"tokens.bin has 8 bytes where .* \(6 documents"):
        open_documents("tokenized", str(out), tok)


def test_missing_sources_fail_clearly(tmp_path, tok):
    with pytest.raises(FileNotFoundError, match="no data files"):
        open_documents("text", str(tmp_path / "nope.jsonl"), tok)
    with pytest.raises(FileNotFoundError, match="not a pre-tokenised directory"):
        open_documents("tokenized", str(tmp_path), tok)


def test_sharegpt_loss_covers_exactly_the_assistant_turns(tok):
    record = {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Ada has 3 apples."},
            {"from": "gpt", "value": "Ada has 3 apples."},
            {"from": "user", "value": "And Bruno?"},
            {"from": "assistant", "value": "Bruno counted 4."},
        ]
    }
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
    assert conversation_turns(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    )
    question_only = {"conversations": [{"from": "human", "value": "only a question"}]}
    assert conversation_turns(question_only) is None
    assert conversation_turns({"conversations": [{"from": "alien", "value": "x"}]}) is None


def test_prepare_writes_memmap_documents_equal_to_on_the_fly(tmp_path, tok):
    path = tmp_path / "chats.json"
    records = conversations(40, seed=3)
    records.insert(5, {"conversations": "broken"})
    path.write_text(json.dumps(records))
    meta = prepare("sharegpt", str(path), DEMO_TOKENIZER, str(tmp_path / "out"))
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

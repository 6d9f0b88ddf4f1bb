"""Tokenising off the step's path (issue 77 item 1): long texts in pieces that give the ids
of the whole, documents read ahead on threads without changing a batch, shared sources
measured once, and `code:` sources pre-tokenised by prepare."""

import glob
import json
import os
import re
import sysconfig

import numpy as np
import pytest
from support import DEMO_CONFIG, DEMO_TOKENIZER, ROOT, real_model_dir

from lclm.config import load_config
from lclm.config.run_config import run_config
from lclm.data import code, tokenizer
from lclm.data.ahead import Ahead
from lclm.data.documents import Partial
from lclm.data.filters import LengthFilter, parse_options
from lclm.data.loader import HostBatches
from lclm.data.prepare import prepare
from lclm.data.sources import open_documents
from lclm.data.stats import SourceStats
from lclm.data.stream import DocumentStream, EpochOrders
from lclm.data.tokenizer import Tokenizer, pieces
from lclm.parallel import make_mesh

STDLIB = sysconfig.get_paths()["stdlib"]


def _stdlib_texts(chars: int) -> list[str]:
    """Whole stdlib code documents, about `chars` characters of them (the largest first)."""
    records = code.CodeRecords(STDLIB, False, SourceStats())
    texts = sorted((r["text"] for r in map(records.__getitem__, range(len(records))) if r), key=len)
    chosen = [t for t in texts if len(t) < chars // 2][-4:]
    return chosen + [t for t in texts if len(t) < 40_000][-8:]


def test_pieces_join_to_the_text_and_are_cut_between_lines():
    text = "a = 1\n    b\nc)\n\n# x\n" * 2000 + "tail without a cut" * 300
    found = pieces(text, 1000)
    assert "".join(found) == text and len(found) > 20
    for piece in found[1:]:
        assert re.match(r"\S", piece)  # starts on a non-blank character after "\S\n"
    for before, after in zip(found, found[1:]):
        assert re.search(r"\S\n$", before) and len(before) >= 1000, (before[-5:], after[:5])
    assert pieces("x" * 5000, 1000) == ["x" * 5000]  # no cut point: whole


def test_smollm2_encodes_code_in_pieces_to_the_ids_of_the_whole(monkeypatch):
    tok = Tokenizer(real_model_dir())
    assert tok._cuttable
    monkeypatch.setattr(tokenizer, "PIECE_CHARS", 2048)  # many cuts in a few documents
    for text in _stdlib_texts(600_000):
        assert tok.encode_long(text) == tok.encode(text)


def test_a_llama3_style_split_encodes_in_pieces_to_the_ids_of_the_whole(hf_dir, monkeypatch):
    tok = Tokenizer(str(hf_dir))
    assert tok._cuttable
    monkeypatch.setattr(tokenizer, "PIECE_CHARS", 512)
    odd = "x = f(a)  \n\tb\n\n\n  c;\r\nd\u00e9j\u00e0 \u4e2d\n1234\n<|eot_id|>\ny " * 200
    for text in [odd, *_stdlib_texts(100_000)]:
        assert tok.encode_long(text) == tok.encode(text)


def test_tokenizers_that_a_cut_would_change_encode_whole(make_hf_tokenizer, tmp_path):
    """A prefix space (ByteLevel's, or Metaspace's '▁') would begin every piece."""
    path = make_hf_tokenizer(tmp_path / "tok") / "tokenizer.json"
    config = json.loads(path.read_text())
    assert tokenizer._cuttable(config)
    config["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = True
    assert not tokenizer._cuttable(config)
    config["pre_tokenizer"] = {
        "type": "Metaspace",
        "replacement": "\u2581",
        "prepend_scheme": "first",
        "split": False,
    }
    assert not tokenizer._cuttable(config)


def test_documents_read_ahead_are_those_read_directly():
    docs = open_documents("code", f"{STDLIB}/json", Tokenizer(DEMO_TOKENIZER))
    ahead = Ahead(docs, workers=2)
    try:
        ahead.want([(2, 0), (0, 0)])
        ahead.want([(0, 0), (1, 10)])  # 2 forgotten
        assert list(ahead._reads) == [0, 1]
        for i in (0, 2):
            assert all(np.array_equal(a, b) for a, b in zip(ahead[i], docs[i]))
        part = ahead.partial(1, 10)  # read ahead in part (whole: SentencePiece), read here
        whole = part.whole() if isinstance(part, Partial) else part
        assert all(np.array_equal(a, b) for a, b in zip(whole, docs[1]))
        assert not ahead._reads
        many = list(ahead.read_many(range(len(docs))))
        assert all(np.array_equal(m[0], docs[i][0]) for i, m in enumerate(many))
    finally:
        ahead.close()


def _code_loader(path, prefetch=0):
    config = load_config(DEMO_CONFIG)
    config.data.update(path=path, seq_len=2048, batch_size=2, balance=False)
    return HostBatches(
        run_config(config), make_mesh(fsdp=2, sp=4), Tokenizer(DEMO_TOKENIZER), prefetch=prefetch
    )


def test_reading_ahead_changes_no_batch_and_shared_sources_measure_once(monkeypatch):
    mixture = f"code:{STDLIB}/email@0.7?min_tokens=2k,code:{STDLIB}/email@0.3?max_tokens=8k"
    ahead = _code_loader(mixture, prefetch=2)
    try:
        first, second = ahead.sources
        assert first.docs is second.docs and first.filter.lengths is second.filter.lengths
        got = [{k: np.asarray(v) for k, v in next(ahead).items()} for _ in range(8)]
    finally:
        ahead.close()
    monkeypatch.setattr(Ahead, "want", lambda self, indices: None)  # every read on the spot
    direct = _code_loader(mixture)
    try:
        for batch in got:
            expected = next(direct)
            assert all(np.array_equal(batch[k], np.asarray(expected[k])) for k in batch)
    finally:
        direct.close()


def test_prepare_pre_tokenises_a_code_source_into_its_own_documents(tmp_path):
    tok = Tokenizer(DEMO_TOKENIZER)
    meta = prepare("code", f"{STDLIB}/json", DEMO_TOKENIZER, str(tmp_path / "json"))
    docs = open_documents("code", f"{STDLIB}/json", tok)
    prepared = open_documents("tokenized", str(tmp_path / "json"), tok)
    assert meta["documents"] == len(docs) == len(prepared)
    for i in range(len(docs)):
        assert all(np.array_equal(a, b) for a, b in zip(prepared[i], docs[i]))


def _counting(tok) -> list[int]:
    """`tok`'s encode_batch made to count the ids it gives: the list's one item."""
    count, encode_batch = [0], tok.encode_batch

    def counted(texts):
        ids = encode_batch(texts)
        count[0] += sum(map(len, ids))
        return ids

    tok.encode_batch = counted
    return count


def test_a_document_read_in_parts_is_the_whole_one(hf_dir, monkeypatch, tmp_path):
    """A text's bytes bound its tokens; read as a `Partial`, its parts join to the document
    read whole, reading to n tokens encodes no piece it does not need, and its counting hook
    hears of every token encoded after it was set."""
    tok = Tokenizer(str(hf_dir))
    monkeypatch.setattr(tokenizer, "PIECE_CHARS", 2048)
    texts = _stdlib_texts(200_000)
    for text in texts:
        assert len(tok.encode(text)) <= tok.most_tokens(text)
    corpus = tmp_path / "texts.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    docs = open_documents("text", str(corpus), tok)
    count = _counting(tok)
    for i in range(len(docs)):
        whole = docs[i]
        for workers in (1, 3):
            count[0] = 0
            part = docs.partial(i, 100, workers)
            assert part.encoded >= min(100, len(whole[0]))
            first = len(tok.encode(tok.long_pieces(texts[i])[0]))
            assert count[0] == first or first < 100  # the first piece only
            heard = []
            part.on_encoded = heard.append
            before = part.encoded
            taken = [part.take() for _ in range(len(whole[0]))]
            taken = [t for t in taken if t is not None]
            assert part.complete and part.take() is None
            assert part.encoded == len(whole[0]) == before + sum(heard)
            for k in (0, 1):
                assert np.array_equal(np.concatenate([t[k] for t in taken]), whole[k])


class _Plain:
    """A document set with nothing but its documents (no bounds, no reading up to a limit):
    how the loader measured lengths before."""

    def __init__(self, docs):
        self.docs = docs

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, i: int):
        return self.docs[i]


# (options, the most that they tokenise of what measuring exact lengths tokenises, beyond
# the documents drawn): a length under short_below is kept by chance, so a document that
# its bytes do not decide is measured whole as before
@pytest.mark.parametrize(
    "options, most",
    [
        ("max_tokens=2k", 0.5),
        ("min_tokens=4k", 0.8),
        ("min_tokens=1k&max_tokens=8k", 0.8),
        ("short_below=4k&short_keep=0.3", 1.0),
    ],
)
def test_length_options_decide_on_bounds_as_on_exact_lengths(
    hf_dir, monkeypatch, tmp_path, options, most
):
    """A stream over documents of 1-60K characters (this repository's docs: wrapped lines,
    so pieces can be cut often) draws what it draws over their exact lengths, having
    tokenised less than measuring every length exactly takes; read ahead, it draws the
    same."""
    monkeypatch.setattr(tokenizer, "PIECE_CHARS", 512)
    tok = Tokenizer(str(hf_dir))
    corpus = tmp_path / "docs.jsonl"
    texts = [open(f).read() for f in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
    corpus.write_text(
        "".join(
            json.dumps({"text": t[: len(t) // k]}) + "\n" for t in texts for k in (1, 3, 10, 30)
        )
    )
    docs = open_documents("text", str(corpus), tok)
    exact = [docs[i] for i in range(len(docs))]
    count = _counting(tok)
    rules = parse_options(options, "test")

    def drawn(documents, ahead: bool = False) -> list[np.ndarray]:
        stream = DocumentStream(
            documents, EpochOrders(len(documents), 5), 0, 1, LengthFilter(documents, rules, 5, 0)
        )
        got = []
        for _ in range(2 * len(documents)):
            if ahead:
                documents.want(stream.upcoming(3))
            doc = next(stream)  # a long one read as far as the options needed
            got.append((doc.whole() if isinstance(doc, Partial) else doc)[0])
        return got

    expected = drawn(exact)
    handed = sum(len(d) for d in expected)  # tokenised however the lengths are measured
    count[0] = 0
    assert all(np.array_equal(a, b) for a, b in zip(drawn(_Plain(docs)), expected))
    before = count[0] - handed  # each document left out tokenised whole once
    assert before > 0
    for ahead in (False, True):
        count[0] = 0
        documents = Ahead(docs, workers=2) if ahead else docs
        try:
            got = drawn(documents, ahead)
        finally:
            if ahead:
                documents.close()
        assert len(got) == len(expected)
        assert all(np.array_equal(a, b) for a, b in zip(got, expected))
        if not ahead:  # (reads ahead that end unused depend on the threads' timing)
            assert count[0] - handed <= most * before, options


def test_rows_that_read_long_documents_in_parts_equal_those_of_whole_ones(
    hf_dir, monkeypatch, tmp_path
):
    """Documents read a few pieces at a time as rows need them (length options decided on
    parts too, the mixture counting tokens as they are read) give the batches of the same
    documents pre-tokenised whole, and a resume in the middle of a document continues them."""
    monkeypatch.setattr(tokenizer, "PIECE_CHARS", 512)
    texts = [open(f).read() for f in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text(
        "".join(json.dumps({"text": t[: len(t) // k]}) + "\n" for t in texts for k in (1, 7))
    )
    prepare("text", str(corpus), str(hf_dir), str(tmp_path / "prepared"))
    tok = Tokenizer(str(hf_dir))

    def loader(source: str, state=None) -> HostBatches:
        config = load_config(DEMO_CONFIG)
        path = f"{source}@0.6?min_tokens=3k,{source}@0.4?max_tokens=6k"
        config.data.update(path=path, seq_len=512, batch_size=2, balance=False)
        config.data.mixture_unit = "tokens"
        return HostBatches(run_config(config), make_mesh(fsdp=2, sp=4), tok, state, prefetch=0)

    def batches(source: str, n: int, state=None) -> tuple[list[dict], list]:
        feed = loader(source, state)
        try:
            got = [{k: np.asarray(v) for k, v in next(feed).items()} for _ in range(n)]
            return got, [feed.state()]
        finally:
            feed.close()

    whole, _ = batches(f"tokenized:{tmp_path / 'prepared'}", 80)
    count = _counting(tok)
    parts, _ = batches(f"text:{corpus}", 80)
    assert all(all(np.array_equal(a[k], b[k]) for k in a) for a, b in zip(parts, whole))
    tokens_in_rows = 80 * 2 * 512
    assert count[0] < 3 * tokens_in_rows  # not every document drawn, whole
    first, state = batches(f"text:{corpus}", 9)
    later, _ = batches(f"text:{corpus}", 71, state[0])
    assert all(all(np.array_equal(a[k], b[k]) for k in a) for a, b in zip(first + later, whole))

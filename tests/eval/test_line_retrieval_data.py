"""Line-retrieval documents and prompts: exact lengths, correct answers, depth bins, loss
masks, and the data source feeding the packer one document per row."""

import re

import numpy as np
import pytest
from support import DEMO_TOKENIZER, pack_documents

from lclm.config import AttentionConfig
from lclm.config.syntax import parse_lengths, parse_tokens
from lclm.data.line_retrieval import (
    Spec,
    build_example,
    chance_accuracy,
    line_format,
    parse_answer,
    spec_of_config,
)
from lclm.data.sources import open_documents
from lclm.data.tokenizer import Tokenizer
from lclm.eval.decode import pad_front, padded_length


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(DEMO_TOKENIZER)


def _lines(text):
    """{line number: value} written in a compact document."""
    return {int(k): v for k, v in re.findall(r"line (\d+): (\d+)\.", text)}


@pytest.mark.parametrize("n_tokens", [128, 256, 1000, 2048])
def test_example_is_exact_length_with_the_right_answer(tokenizer, n_tokens):
    ex = build_example(tokenizer, np.random.default_rng(n_tokens), n_tokens)
    assert len(ex.tokens) == len(ex.loss) == n_tokens
    assert ex.tokens[0] == tokenizer.bos_id and ex.tokens[-1] == tokenizer.eos_id
    prompt = tokenizer.decode(ex.tokens[: ex.prompt_len])
    lines = _lines(prompt)
    assert sorted(lines) == list(range(1, ex.n_lines + 1))
    assert prompt.rstrip().endswith(f"Tell me line {ex.key}:")
    assert lines[ex.key] == ex.answer and len(ex.answer) == 3
    # the loss covers exactly the answer and EOS, right after the prompt
    assert ex.loss[: ex.prompt_len].sum() == 0 and ex.loss[ex.prompt_len :].all()
    assert tokenizer.decode(ex.tokens[ex.prompt_len : -1]).strip() == ex.answer
    # the filler after BOS is shorter than one line: the document is full of lines
    assert n_tokens - ex.prompt_len < 20


def test_depth_bins_place_the_asked_line(tokenizer):
    for b in range(5):
        for i in range(8):
            ex = build_example(tokenizer, np.random.default_rng([b, i]), 512, depth_bin=b)
            assert b / 5 <= ex.depth < (b + 1) / 5, (b, ex.depth)
            assert (ex.key - 1) * 5 // ex.n_lines == b


def test_examples_are_deterministic_and_formats_vary(tokenizer):
    a = build_example(tokenizer, np.random.default_rng(7), 300)
    b = build_example(tokenizer, np.random.default_rng(7), 300)
    assert np.array_equal(a.tokens, b.tokens) and a.answer == b.answer
    paper = build_example(tokenizer, np.random.default_rng(7), 400, line_format("paper", 5))
    text = tokenizer.decode(paper.tokens[: paper.prompt_len])
    assert "REGISTER_CONTENT is <" in text and len(paper.answer) == 5
    assert f"line {paper.key}: REGISTER_CONTENT is <{paper.answer}>" in text
    with pytest.raises(ValueError, match="hold only"):
        build_example(tokenizer, np.random.default_rng(0), 40, depth_bin=0)
    assert chance_accuracy(3) == pytest.approx(1 / 900)


def test_parse_answer():
    assert parse_answer(" 382") == "382"
    assert parse_answer("The value is <38291>.") == "38291"
    assert parse_answer(" 38 2") == "38" and parse_answer("none") is None
    assert parse_answer("The REGISTER_CONTENT in line 17 is <38291>.") == "38291"


def test_source_feeds_one_document_per_row(tokenizer):
    docs = open_documents("line_retrieval", "tokens=128;digits=2;seed=3;docs=50", tokenizer)
    assert len(docs) == 50
    t0, l0 = docs[4]
    assert np.array_equal(t0, docs[4][0]) and not np.array_equal(t0, docs[5][0])
    rows = list(pack_documents((docs[i] for i in range(6)), 128))
    assert len(rows) == 5
    for i, row in enumerate(rows):
        assert (row["segment_ids"] == 1).all()  # a row is one whole document
        assert np.array_equal(row["tokens"], docs[i][0])
        # targets with loss: the answer ('▁' and 2 digits) and EOS; the last token's target
        # is the next document's BOS (no loss)
        assert row["loss_mask"].sum() == 4 and row["loss_mask"][-5:-1].all()
    assert spec_of_config({"path": "a.jsonl@0.5,line_retrieval:tokens=64;digits=2@0.5"}) == Spec(
        tokens=64, digits=2
    )
    with pytest.raises(ValueError, match="bad line_retrieval option"):
        Spec.parse("tokens=64;colour=red")


def test_a_shorter_document_padded_to_the_row_keeps_its_positions_and_the_rows_aligned(tokenizer):
    """pad_to: a 64-token example filled to 128 after its answer, mixed with 128-token ones,
    leaves every row one whole document (packed unpadded, the next one would cross rows)."""
    short = open_documents("line_retrieval", "tokens=64;digits=1;seed=1;pad_to=128", tokenizer)
    plain = open_documents("line_retrieval", "tokens=64;digits=1;seed=1", tokenizer)
    long = open_documents("line_retrieval", "tokens=128;digits=1;seed=0", tokenizer)
    tokens, loss = short[3]
    assert len(tokens) == 128 and np.array_equal(tokens[:64], plain[3][0])
    assert np.array_equal(loss[:64], plain[3][1]) and not loss[64:].any()
    docs = [short[0], long[0], long[1], short[1], long[2]]
    rows = list(pack_documents(iter(docs + [long[3]]), 128))  # a row's last target: the next BOS
    for row, doc in zip(rows, docs, strict=True):
        assert (row["segment_ids"] == 1).all() and np.array_equal(row["tokens"], doc[0])
    with pytest.raises(ValueError, match="pad_to=32 is shorter than tokens=64"):
        Spec.parse("tokens=64;pad_to=32")


def test_lengths_and_padding():
    assert parse_lengths("2k, 512,1m") == [2048, 512, 1024**2]
    with pytest.raises(ValueError):
        parse_tokens("2x")
    chunks = lambda q, kv, **a: AttentionConfig(q_chunk=q, kv_chunk=kv, **a)
    assert padded_length(8187, 4, 2048, chunks(512, 512)) == 8192
    assert padded_length(2043, 4, 2048, chunks(512, 512)) == 2044  # one chunk of 511 a device
    assert padded_length(251, 4, 64, chunks(64, 64)) == 252  # block 63: chunks cap at the block
    p = padded_length(1000, 4, 64, chunks(64, 32))
    assert p >= 1000 and p % 4 == 0 and (p // 4) % 64 == 0
    # zigzag: each shard is two runs; a run of 255.5 (as 2044 gave) would not be one
    p = padded_length(2043, 4, 2048, chunks(512, 512, layout="zigzag"))
    assert p == 2048 and (p // 8) % min(512, p // 8) == 0
    # ulysses attends the whole sequence: its chunks tile P, not P / sp
    assert padded_length(500, 4, 16, chunks(64, 64, strategy="ulysses")) == 512
    # usp, ulysses 2 on sp 4: zigzag runs of a 2-member ring's shard, P / 4
    p = padded_length(1000, 4, 16, chunks(96, 96, layout="zigzag", strategy="usp", ulysses=2))
    assert (p // 4) % 96 == 0 and p % 16 == 0
    tokens, positions, segments = pad_front([np.array([5, 6, 7]), np.array([8])], 5, 0)
    assert tokens.tolist() == [[0, 0, 5, 6, 7], [0, 0, 0, 0, 8]]
    assert segments.tolist() == [[0, 0, 1, 1, 1], [0, 0, 0, 0, 1]]
    assert positions[0, 2:].tolist() == [0, 1, 2] and positions[1, 4] == 0

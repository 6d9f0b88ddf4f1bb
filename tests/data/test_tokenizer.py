"""Tokenizers: HuggingFace tokenizer.json files read with `tokenizers` (ids equal to
`transformers.AutoTokenizer`'s), special tokens from their config files, SentencePiece models
as before, character offsets, and the data sources on top of either kind."""

import json
import sys

import numpy as np
import pytest

from lclm.data.line_retrieval import build_example
from lclm.data.prepare import prepare
from lclm.data.sources import open_documents
from lclm.data.tokenizer import HFTokenizer, SentencePieceTokenizer, Tokenizer
from lclm.errors import ConfigError

TEXTS = [
    "Ada has 3 apples.",
    "  two  spaces and\n\nnew lines\t tab ",
    "é ü 中文 🙂 mixed",
    "1234567 digits",
    "specials <|eot_id|> inside<|end_of_text|>text",
    "",
    " ",
    "x",
]


def _transformers():
    if sys.version_info < (3, 12):  # CI's Python: the cross-check must run, never skip
        import transformers

        return transformers
    return pytest.importorskip(
        "transformers", reason="the cross-check against transformers needs the [test] extra"
    )


def test_hf_ids_equal_transformers_autotokenizer(hf_dir):
    auto = _transformers().AutoTokenizer.from_pretrained(str(hf_dir))
    tok = Tokenizer(str(hf_dir))
    assert isinstance(tok, HFTokenizer) and tok.add_bos
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (
        auto.bos_token_id,
        auto.eos_token_id,
        auto.pad_token_id,
    )
    for text in TEXTS:
        assert tok.encode(text) == auto(text, add_special_tokens=False)["input_ids"], text
        assert [tok.bos_id] + tok.encode(text) == auto(text)["input_ids"], text
        ids = tok.encode(text)
        assert tok.decode(ids) == auto.decode(ids, skip_special_tokens=True)
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]
    assert tok.vocab_size == len(auto)


@pytest.mark.parametrize("kind", ["sentencepiece-llama", "hf-bpe", "demo"])
def test_offsets_are_character_spans_of_the_same_ids(kind, llama_sp, hf_dir):
    tok = Tokenizer(
        {
            "sentencepiece-llama": llama_sp,
            "hf-bpe": str(hf_dir),
            "demo": "data/demo/tokenizer.model",
        }[kind]
    )
    for text in TEXTS:
        ids, offsets = tok.encode_with_offsets(text)
        assert ids == tok.encode(text) and len(offsets) == len(ids)
        assert all(0 <= a <= b <= len(text) for a, b in offsets)
        assert [a for a, _ in offsets] == sorted(a for a, _ in offsets)


def test_hf_path_forms_and_settings(hf_dir):
    by_dir, by_file = Tokenizer(str(hf_dir)), Tokenizer(str(hf_dir / "tokenizer.json"))
    assert by_dir.encode("Ada") == by_file.encode("Ada") and by_file.pad_id is not None
    assert by_dir.special_id("<|eot_id|>") == by_dir.encode("<|eot_id|>")[0]
    with pytest.raises(ConfigError, match="has no token '<s>'"):
        by_dir.special_id("<s>")
    by_dir.check_fits(by_dir.vocab_size)
    with pytest.raises(ConfigError, match=f"set model.vocab_size >= {by_dir.vocab_size}"):
        by_dir.check_fits(by_dir.vocab_size - 1)


def test_hf_special_tokens_come_from_its_config_files(make_hf_tokenizer, tmp_path):
    # add_bos_token in tokenizer_config.json decides; special_tokens_map.json wins, and a
    # token may be written as {"content": ...}
    d = make_hf_tokenizer(
        tmp_path / "a",
        config={
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|end_of_text|>",
            "add_bos_token": False,
        },
        special_map={"eos_token": {"content": "<|eot_id|>", "lstrip": False}},
    )
    tok = Tokenizer(str(d))
    assert not tok.add_bos and tok.eos_id == tok.special_id("<|eot_id|>") and tok.pad_id is None
    # without add_bos_token, the post-processor decides: none here, so no BOS
    tok = Tokenizer(
        str(
            make_hf_tokenizer(
                tmp_path / "b",
                post_processor=False,
                config={"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"},
            )
        )
    )
    assert not tok.add_bos and tok.bos_id == tok.special_id("<|begin_of_text|>")
    # no BOS at all: documents are text + EOS
    tok = Tokenizer(
        str(
            make_hf_tokenizer(
                tmp_path / "c", config={"eos_token": "<|end_of_text|>", "bos_token": None}
            )
        )
    )
    assert tok.bos_id is None and not tok.add_bos
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text(json.dumps({"text": "Ada has 3 apples."}) + "\n")
    tokens, loss = open_documents("text", str(corpus), tok)[0]
    assert tokens.tolist() == tok.encode("Ada has 3 apples.") + [tok.eos_id]
    assert loss.tolist() == [0] + [1] * (len(tokens) - 1)


@pytest.mark.parametrize(
    "config, message",
    [
        ({"bos_token": "<|begin_of_text|>"}, "names no eos_token"),
        ({"eos_token": "</s>"}, "eos_token '</s>' from its config is not in its tokenizer.json"),
    ],
)
def test_hf_config_faults_are_config_errors(make_hf_tokenizer, tmp_path, config, message):
    with pytest.raises(ConfigError, match=message):
        Tokenizer(str(make_hf_tokenizer(tmp_path / "t", config=config)))


def test_unusable_tokenizer_paths(tmp_path, hf_dir):
    with pytest.raises(FileNotFoundError, match="not found"):
        Tokenizer(str(tmp_path / "missing.model"))
    with pytest.raises(FileNotFoundError, match="holds neither tokenizer.json nor"):
        Tokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(
        ConfigError,
        match="is not a SentencePiece model or a HuggingFace tokenizer.json \\(tokenizers: ",
    ):
        Tokenizer(str(tmp_path))
    (tmp_path / "bad.model").write_bytes(b"\x0a\x03abc")
    with pytest.raises(ConfigError, match="\\(SentencePiece: "):
        Tokenizer(str(tmp_path / "bad.model"))
    (tmp_path / "x" / "y").mkdir(parents=True)
    (tmp_path / "x" / "y" / "tokenizer.json").write_text((hf_dir / "tokenizer.json").read_text())
    (tmp_path / "x" / "y" / "tokenizer_config.json").write_text("{broken")
    with pytest.raises(ConfigError, match="tokenizer_config.json is not valid JSON"):
        Tokenizer(str(tmp_path / "x" / "y"))


def test_sentencepiece_models_load_as_before(llama_sp, tmp_path):
    demo = Tokenizer("data/demo/tokenizer.model")
    assert isinstance(demo, SentencePieceTokenizer)
    assert (demo.bos_id, demo.eos_id, demo.pad_id, demo.add_bos, demo.vocab_size) == (
        1,
        2,
        None,
        True,
        512,
    )
    assert demo.special_id("</s>") == 2
    # a directory holding only tokenizer.model (as LLaMA-2 HF directories may) works too
    (tmp_path / "tokenizer.model").write_bytes(open(llama_sp, "rb").read())
    assert Tokenizer(str(tmp_path)).encode("Ada has") == Tokenizer(llama_sp).encode("Ada has")


def test_sources_and_prepare_with_a_hf_tokenizer(hf_dir, tmp_path):
    tok = Tokenizer(str(hf_dir))
    text = open_documents("text", "data/demo/corpus.jsonl", tok)
    tokens, loss = text[0]
    assert tokens[0] == tok.bos_id and tokens[-1] == tok.eos_id and loss[0] == 0
    chats = open_documents("sharegpt", "data/demo/sharegpt.jsonl", tok, chat_template="llama3")
    tokens, loss = chats[0]
    assert tokens[0] == tok.special_id("<|begin_of_text|>")
    assert tokens[np.flatnonzero(loss)[-1]] == tok.special_id("<|eot_id|>")
    meta = prepare(
        "sharegpt",
        "data/demo/sharegpt.jsonl",
        str(hf_dir),
        str(tmp_path / "out"),
        chat_template="llama3",
    )
    assert meta["vocab_size"] == tok.vocab_size
    stored = open_documents("tokenized", str(tmp_path / "out"), tok)
    np.testing.assert_array_equal(stored[0][0], chats[0][0])


def test_line_retrieval_with_a_hf_tokenizer(hf_dir):
    tok = Tokenizer(str(hf_dir))
    for n in (200, 333):
        ex = build_example(tok, np.random.default_rng(n), n)
        assert len(ex.tokens) == n and ex.tokens[0] == tok.bos_id
        assert ex.tokens[-1] == tok.eos_id
        assert tok.decode(ex.tokens[ex.prompt_len : -1]).strip() == ex.answer
        assert tok.decode(ex.tokens[: ex.prompt_len]).rstrip().endswith(f"line {ex.key}:")

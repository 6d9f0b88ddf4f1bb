"""Small tokenizers trained here (well under a second each, no downloads): a SentencePiece
model with LLaMA's normaliser settings and a LLaMA-3-style HuggingFace byte-level BPE."""

import json

import pytest

from lclm.data.synthetic import conversations, corpus

LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|pad|>",
]
# LLaMA-3's pre-tokenizer pattern: contractions, letters, 1-3 digits, punctuation, newlines
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def training_text() -> list[str]:
    """A few KB: the demo grammar and chat-like lines in each bundled template's words."""
    chats = [" ".join(t["value"] for t in c["conversations"]) for c in conversations(30, seed=5)]
    framing = [
        "A chat between a curious user and an artificial intelligence assistant. "
        "USER: hello ASSISTANT: hi",
        "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nhi [/INST] yo",
        "system\n\nuser\n\nassistant\n\n",
    ] * 5
    return corpus(40, seed=1) + chats + framing


@pytest.fixture(scope="session")
def llama_sp(tmp_path_factory):
    """Path of a SentencePiece BPE with LLaMA's settings: identity normaliser, whitespace
    kept, dummy prefix, byte fallback, split digits, unk=0/bos=1/eos=2; LLaMA-3's markers as
    control symbols (never produced from text) so that every template can be rendered."""
    import sentencepiece as spm

    prefix = str(tmp_path_factory.mktemp("sp") / "llama")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(training_text()),
        model_prefix=prefix,
        model_type="bpe",
        vocab_size=500,
        add_dummy_prefix=True,
        remove_extra_whitespaces=False,
        byte_fallback=True,
        normalization_rule_name="identity",
        split_digits=True,
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        control_symbols=[t for t in LLAMA3_SPECIALS if t not in ("<|pad|>",)],
        num_threads=1,
        minloglevel=2,
    )
    return prefix + ".model"


def write_hf_tokenizer(
    directory,
    config=None,
    post_processor=True,
    special_map=None,
    pre_tokenizer=True,
    text=None,
    vocab_size=600,
):
    """A byte-level BPE like LLaMA-3's (its split pattern, BOS added by the post-processor)
    saved as directory/tokenizer.json with a tokenizer_config.json (`config`, default: the
    LLaMA-3 special tokens) and optionally a special_tokens_map.json; returns `directory`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.pre_tokenizer = (
        pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"), byte_level]
        )
        if pre_tokenizer
        else byte_level
    )
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        text or training_text(),
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=LLAMA3_SPECIALS,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    if post_processor:
        bos = tok.token_to_id("<|begin_of_text|>")
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A",
            pair="<|begin_of_text|> $A <|begin_of_text|> $B",
            special_tokens=[("<|begin_of_text|>", bos)],
        )
    tok.save(str(directory / "tokenizer.json"))
    if config is None:
        config = {
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|end_of_text|>",
            "pad_token": "<|pad|>",
            "tokenizer_class": "PreTrainedTokenizerFast",
        }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if special_map is not None:
        (directory / "special_tokens_map.json").write_text(json.dumps(special_map))
    return directory


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory):
    """Directory of a LLaMA-3-style tokenizer.json and tokenizer_config.json."""
    return write_hf_tokenizer(tmp_path_factory.mktemp("hf") / "tok")


@pytest.fixture(scope="session")
def make_hf_tokenizer():
    """`write_hf_tokenizer`, for tests that need a variant."""
    return write_hf_tokenizer

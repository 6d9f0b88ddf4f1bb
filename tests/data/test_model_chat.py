"""A tokenizer's own chat template (`data.chat_template='tokenizer'`) against transformers'
`apply_chat_template`: the same ids for a byte-level BPE tokenizer.json (Qwen's kind) and a
ChatML template from tokenizer_config.json, the assistant-only mask transformers derives from
`{% generation %}` blocks, the same generation prompt; templates that trim replies, refuse a
conversation or ship none."""

import json
import sys

import pytest

from lclm.data.chat import get_template
from lclm.data.sources import open_documents
from lclm.data.stats import SourceStats
from lclm.data.tokenizer import Tokenizer
from lclm.errors import ConfigError

if sys.version_info < (3, 12):  # CI's Python: the cross-check must run, never skip
    import transformers
else:
    transformers = pytest.importorskip("transformers")

# ChatML as Qwen2.5 writes it (a default system turn where the chat has none), its replies
# and their <|im_end|> inside {% generation %} so that transformers can mask them
CHATML = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{%- continue %}{%- endif %}"
    "{%- if loop.index0 > 0 and message['role'] == messages[loop.index0 - 1]['role'] %}"
    "{{- raise_exception('roles must alternate') }}{%- endif %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}"
    "{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# LLaMA-3's form: replies trimmed, each closed by <|eot_id|>
TRIMMING = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['role'] == 'assistant' %}{% generation %}"
    "{{- message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{%- else %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, how are you today?",
    "I am fine, thank you! And you?",
    "def f(x):\n    return x * 2\n",
    "Ünïcödé text: 東京, москва, 123.45",
] * 20

CHATS = [
    [("user", "Hello, how are you?"), ("assistant", "I am fine, thank you!")],
    [
        ("system", "Be brief."),
        ("user", "What is 2 + 2?"),
        ("assistant", "4."),
        ("user", "And 3 + 3?"),
        ("assistant", "6, says the fox."),
    ],
    [
        ("user", "Ünïcödé? 東京"),
        ("assistant", " spaced reply\n"),
        ("user", "def f(x):"),
        ("assistant", "    return x"),
    ],
]


def _tokenizer_dir(path, template, **settings):
    """A byte-level BPE tokenizer.json (Qwen's kind) trained here, with `template` in its
    tokenizer_config.json."""
    from tokenizers import Tokenizer as Raw
    from tokenizers import decoders, models, pre_tokenizers, trainers

    raw = Raw(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=SPECIAL,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    path.mkdir(exist_ok=True)
    raw.save(str(path / "tokenizer.json"))
    config = dict(
        tokenizer_class="PreTrainedTokenizerFast",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        add_bos_token=False,
    )
    config.update(settings, **({} if template is None else {"chat_template": template}))
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(path)


def _messages(turns):
    return [{"role": r, "content": t} for r, t in turns]


@pytest.mark.parametrize(
    "template,settings",
    [(CHATML, {}), (TRIMMING, dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"))],
    ids=["chatml", "trimming"],
)
def test_ids_masks_and_prompts_equal_transformers_apply_chat_template(tmp_path, template, settings):
    path = _tokenizer_dir(tmp_path / "tok", template, **settings)
    tokenizer = Tokenizer(path)
    ours = get_template("tokenizer", tokenizer)
    theirs = transformers.AutoTokenizer.from_pretrained(path)
    for turns in CHATS:
        ids, flags = ours.render(turns, tokenizer)
        want = theirs.apply_chat_template(
            _messages(turns), tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert ids.tolist() == list(want["input_ids"])
        assert flags.tolist() == list(want["assistant_masks"]), theirs.convert_ids_to_tokens(ids)
        assert 0 < flags.sum() < len(flags)
        # the reply text and its closing special token, nothing else
        end = tokenizer.special_id(settings.get("eos_token", "<|im_end|>"))
        assert (ids[flags == 1] == end).sum() == sum(r == "assistant" for r, _ in turns)
        prompt = ours.render_prompt(turns[:-1], tokenizer)
        assert prompt.tolist() == list(
            theirs.apply_chat_template(
                _messages(turns[:-1]), tokenize=True, add_generation_prompt=True, return_dict=True
            )["input_ids"]
        )
    assert ours.reply_end_id(tokenizer) == tokenizer.special_id(
        settings.get("eos_token", "<|im_end|>")
    )


def test_sharegpt_data_renders_with_the_tokenizers_template_and_counts_refusals(tmp_path):
    path = _tokenizer_dir(tmp_path / "tok", CHATML)
    tokenizer = Tokenizer(path)
    roles = {"user": "human", "assistant": "gpt", "system": "system"}
    records = [
        {"conversations": [{"from": roles[r], "value": t} for r, t in turns]} for turns in CHATS
    ]
    # two user turns in a row: this template raises, so the record is left out and counted
    records.append(
        {
            "conversations": [
                {"from": "human", "value": "a"},
                {"from": "human", "value": "b"},
                {"from": "gpt", "value": "c"},
            ]
        }
    )
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    stats = SourceStats()
    docs = open_documents("sharegpt", str(data), tokenizer, chat_template="tokenizer", stats=stats)
    assert len(docs) == len(CHATS)
    theirs = transformers.AutoTokenizer.from_pretrained(path)
    for i, turns in enumerate(CHATS):
        tokens, flags = docs[i]
        want = theirs.apply_chat_template(
            _messages(turns), tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert tokens.tolist() == list(want["input_ids"])
        assert flags.tolist() == list(want["assistant_masks"])
    assert stats.skipped == 1 and "roles must alternate" in stats.summary()


def test_a_template_that_rewrites_replies_or_a_tokenizer_without_one_is_one_line(tmp_path):
    rewriting = CHATML.replace(
        "message['content'] + '<|im_end|>' }}{% endgeneration",
        "message['content'] | upper + '<|im_end|>' }}{% endgeneration",
    )
    tokenizer = Tokenizer(_tokenizer_dir(tmp_path / "tok", rewriting))
    with pytest.raises(ValueError, match="rewrites assistant replies") as e:
        get_template("tokenizer", tokenizer).check(tokenizer)
    assert "\n" not in str(e.value)
    sentencepiece = Tokenizer(str(__import__("support").DEMO_TOKENIZER))
    with pytest.raises(ConfigError, match="ships no chat template") as e:
        get_template("tokenizer", sentencepiece)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="unknown chat template 'chatml'"):
        get_template("chatml", sentencepiece)


def test_a_template_is_sandboxed(tmp_path):
    """A template from a downloaded tokenizer is untrusted: it reaches no Python internals."""
    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    tokenizer = Tokenizer(_tokenizer_dir(tmp_path / "tok", escape + CHATML))
    with pytest.raises(ValueError, match="refuses the conversation"):
        get_template("tokenizer", tokenizer).render(CHATS[0], tokenizer)


def test_a_template_in_chat_template_jinja_is_read_and_exported(tmp_path):
    """transformers 5 keeps the template in chat_template.jinja: lclm reads it there, and an
    export (`save_tokenizer`) carries it, so the exported tokenizer chats alike."""
    from lclm.config import ModelConfig
    from lclm.hf import save_tokenizer

    path = tmp_path / "tok"
    _tokenizer_dir(path, None)
    (path / "chat_template.jinja").write_text(CHATML)
    tokenizer = Tokenizer(str(path))
    ids, flags = get_template("tokenizer", tokenizer).render(CHATS[1], tokenizer)
    out = tmp_path / "export"
    out.mkdir()
    written, _ = save_tokenizer(str(path), str(out), ModelConfig(vocab_size=400))
    assert "chat_template.jinja" in written
    theirs = transformers.AutoTokenizer.from_pretrained(str(out))
    want = theirs.apply_chat_template(
        _messages(CHATS[1]), tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert ids.tolist() == list(want["input_ids"])
    assert flags.tolist() == list(want["assistant_masks"])

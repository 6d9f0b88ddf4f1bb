"""Chat rendering: the ids are those of tokenising the rendered conversation in one call per
stretch of text between special tokens (as inference does), and the loss flags cover exactly
the replies and the special token closing each, for every bundled template, with a
SentencePiece model using LLaMA's normaliser and with a LLaMA-3-style HuggingFace BPE."""

import hashlib
import sys

import numpy as np
import pytest

from lclm.data.chat import TEMPLATES, ChatTemplate, render, render_prompt, token_flags
from lclm.data.sources import open_documents
from lclm.data.tokenizer import Tokenizer
from lclm.errors import ConfigError

SYSTEM = "Be brief."
TURNS = [
    ("system", SYSTEM),
    ("user", "Ada has 3 apples and finds 18 more. How many apples now?"),
    ("assistant", "Ada now has 3 plus 18, which is 21 apples."),
    ("user", "And Bruno, who had 40?"),
    ("assistant", "Bruno has 40 apples."),
]
QUESTIONS = [t for r, t in TURNS if r == "user"]
REPLIES = [t for r, t in TURNS if r == "assistant"]
CLOSE = {"vicuna": "<eos>", "llama2": "<eos>", "llama3": "<|eot_id|>"}


def written_out(template: str) -> list[str]:
    """TURNS rendered by hand: stretches of text and special tokens ('<bos>', '<eos>', '<|..|>')."""
    (q1, q2), (a1, a2) = QUESTIONS, REPLIES
    if template == "vicuna":
        return [
            "<bos>",
            f"{SYSTEM} USER: {q1} ASSISTANT: {a1}",
            "<eos>",
            f"USER: {q2} ASSISTANT: {a2}",
            "<eos>",
        ]
    if template == "llama2":
        return [
            "<bos>",
            f"[INST] <<SYS>>\n{SYSTEM}\n<</SYS>>\n\n{q1} [/INST] {a1} ",
            "<eos>",
            "<bos>",
            f"[INST] {q2} [/INST] {a2} ",
            "<eos>",
        ]
    out = ["<|begin_of_text|>"]
    for role, text in TURNS:
        out += ["<|start_header_id|>", role, "<|end_header_id|>", "\n\n" + text, "<|eot_id|>"]
    return out


def ids_of(tok, segments) -> list[int]:
    """Special tokens as ids, each stretch of text tokenised in one call."""
    ids = []
    for s in segments:
        if s in ("<bos>", "<eos>"):
            ids.append(tok.bos_id if s == "<bos>" else tok.eos_id)
        elif s.startswith("<|") and s.endswith("|>"):
            ids.append(tok.special_id(s))
        else:
            ids.extend(tok.encode(s))
    return ids


def flagged_runs(tokens, flags) -> list[list[int]]:
    runs, cur = [], []
    for t, f in zip(tokens.tolist(), flags.tolist()):
        if f:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + [cur] if cur else runs


@pytest.fixture(params=["sentencepiece-llama", "hf-bpe"])
def tok(request, llama_sp, hf_dir):
    return Tokenizer(llama_sp if request.param == "sentencepiece-llama" else str(hf_dir))


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_ids_are_one_call_tokenisation_and_flags_cover_exactly_the_replies(tok, template):
    tokens, flags = render(TURNS, tok, TEMPLATES[template])
    assert tokens.tolist() == ids_of(tok, written_out(template))
    runs = flagged_runs(tokens, flags)
    close = ids_of(tok, [CLOSE[template]])[0]
    assert [r[-1] for r in runs] == [close, close]
    replies = [tok.decode(r[:-1]) for r in runs]
    if template == "llama3":  # the reply follows a special token and "\n\n": exactly it
        assert replies == REPLIES
    else:  # " reply" (vicuna) and " reply " (llama2) are flagged, the spaces included
        assert [r.strip() for r in replies] == REPLIES
    assert int(flags.sum()) == sum(map(len, runs))


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_the_tokens_before_each_reply_are_its_inference_prompt(tok, template):
    tokens, flags = render(TURNS, tok, TEMPLATES[template])
    starts = [i for i in range(len(flags)) if flags[i] and (i == 0 or not flags[i - 1])]
    users = [i for i, (role, _) in enumerate(TURNS) if role == "user"]
    assert len(starts) == len(users) == 2
    for start, user in zip(starts, users):
        prompt = render_prompt(TURNS[: user + 1], tok, TEMPLATES[template])
        assert tokens[:start].tolist() == prompt.tolist()


def test_piecewise_tokens_differ_from_inference_with_llamas_normaliser(llama_sp):
    """What rendering used to do (each piece tokenised apart) with a 2-turn Vicuna chat:
    SentencePiece with LLaMA's settings puts a '▁' of its own before every piece, ids that
    inference never produces."""
    tok = Tokenizer(llama_sp)
    turns = TURNS[1:]
    t = TEMPLATES["vicuna"]
    piecewise = [tok.bos_id] + tok.encode(t.default_system + " ")
    for role, text in turns:
        if role == "user":
            piecewise += tok.encode(f"USER: {text} ")
        else:
            piecewise += tok.encode("ASSISTANT:") + tok.encode(" " + text) + [tok.eos_id]
    tokens, _ = render(turns, tok, t)
    whole = ids_of(
        tok,
        [
            "<bos>",
            f"{t.default_system} USER: {turns[0][1]} ASSISTANT: {turns[1][1]}",
            "<eos>",
            f"USER: {turns[2][1]} ASSISTANT: {turns[3][1]}",
            "<eos>",
        ],
    )
    assert tokens.tolist() == whole
    assert len(piecewise) > len(whole)


def test_a_token_straddling_the_reply_start_is_flagged(make_hf_tokenizer, tmp_path):
    """A BPE without a pre-tokenizer, trained to merge 'Q:xyz' whole: the one token holds
    prompt and reply characters and is flagged (it carries reply text)."""
    tok = Tokenizer(
        str(
            make_hf_tokenizer(
                tmp_path / "t", pre_tokenizer=False, text=["Q:xyz"] * 50, vocab_size=300
            )
        )
    )
    template = ChatTemplate(
        begin="{bos}",
        system_format="{system}",
        user_format="{text}",
        assistant_prefix=":",
        assistant_format="{text}{eos}",
    )
    tokens, flags = render([("user", "Q"), ("assistant", "xyz")], tok, template)
    assert tokens.tolist() == [tok.bos_id, *tok.encode("Q:xyz"), tok.eos_id]
    assert len(tokens) == 3 and flags.tolist() == [0, 1, 1]


def test_token_flags_overlap_rule_and_empty_spans():
    # text "ab cd": flagged span is "cd" (3, 5)
    offsets = [(0, 0), (0, 2), (2, 3), (3, 3), (3, 5)]  # dummy '▁', 'ab', ' ', byte, 'cd'
    assert token_flags(offsets, [(3, 5)], 5).tolist() == [0, 0, 0, 1, 1]
    assert token_flags(offsets, [(1, 4)], 5).tolist() == [0, 1, 1, 1, 1]  # overlap flags
    assert token_flags([(0, 0)], [(0, 1)], 1).tolist() == [1]
    assert token_flags([(2, 2)], [(1, 2)], 2).tolist() == [1]  # empty at the end: last char
    assert token_flags([], [(0, 1)], 1).tolist() == []


def test_template_tokens_in_turn_text_stay_text(llama_sp):
    """A SentencePiece model never turns text into its control tokens: '</s>' or
    '<|eot_id|>' written in a turn are characters, not the template's special ids."""
    tok = Tokenizer(llama_sp)
    turns = [("user", "say </s> and <|eot_id|>"), ("assistant", "</s><|eot_id|>")]
    tokens, flags = render(turns, tok, TEMPLATES["llama3"])
    eot = tok.special_id("<|eot_id|>")
    assert int((tokens == eot).sum()) == 2 and int((tokens == tok.eos_id).sum()) == 0
    assert tok.decode(flagged_runs(tokens, flags)[0][:-1]) == "</s><|eot_id|>"


def test_templates_check_their_special_tokens_at_open():
    demo = Tokenizer("data/demo/tokenizer.model")
    with pytest.raises(ConfigError, match="no token '<\\|begin_of_text\\|>'"):
        open_documents("sharegpt", "data/demo/sharegpt.jsonl", demo, chat_template="llama3")


def _transformers():
    if sys.version_info < (3, 12):  # CI's Python: the cross-check must run, never skip
        import transformers

        return transformers
    return pytest.importorskip(
        "transformers", reason="the cross-check against transformers needs the [test] extra"
    )


# Jinja chat templates written for this test, in the shape of those shipped with the models
JINJA = {
    "vicuna": "{{ bos_token + messages[0]['content'] + ' ' }}{% for m in messages[1:] %}"
    "{% if m['role'] == 'user' %}{{ 'USER: ' + m['content'] + ' ' }}"
    "{% else %}{{ 'ASSISTANT: ' + m['content'] + eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}",
    "llama2": "{% for m in messages[1:] %}{% if m['role'] == 'user' %}"
    "{% set c = m['content'] %}{% if loop.first %}{% set c = '<<SYS>>\\n' + "
    "messages[0]['content'] + '\\n<</SYS>>\\n\\n' + c %}{% endif %}"
    "{{ bos_token + '[INST] ' + c.strip() + ' [/INST]' }}"
    "{% else %}{{ ' ' + m['content'].strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}",
    "llama3": "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + "
    "'<|end_header_id|>\\n\\n' + m['content'].strip() + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}",
}


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_ids_equal_transformers_apply_chat_template(hf_dir, template):
    auto = _transformers().AutoTokenizer.from_pretrained(str(hf_dir))
    tok = Tokenizer(str(hf_dir))
    messages = [{"role": r, "content": t} for r, t in TURNS]
    ref = auto.apply_chat_template(
        messages, chat_template=JINJA[template], tokenize=True, return_dict=False
    )
    assert render(TURNS, tok, TEMPLATES[template])[0].tolist() == list(ref)
    if template != "llama2":  # its jinja has no generation prompt
        ref = auto.apply_chat_template(
            messages[:-1],
            chat_template=JINJA[template],
            tokenize=True,
            return_dict=False,
            add_generation_prompt=True,
        )
        assert render_prompt(TURNS[:-1], tok, TEMPLATES[template]).tolist() == list(ref)


def test_demo_chats_render_as_before():
    """The demo tokenizer (SentencePiece's default normaliser, which collapses whitespace)
    gives the ids and flags that piece-wise rendering gave: the first 12 demo conversations,
    fingerprinted with the code before this change."""
    demo = Tokenizer("data/demo/tokenizer.model")
    docs = open_documents("sharegpt", "data/demo/sharegpt.jsonl", demo)
    h = hashlib.sha256()
    for i in range(12):
        tokens, loss = docs[i]
        h.update(np.asarray(tokens, np.int32).tobytes())
        h.update(np.asarray(loss, np.int8).tobytes())
    assert h.hexdigest()[:16] == "7a0adf8032a180b2"

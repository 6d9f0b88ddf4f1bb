"""Chat templates: ShareGPT conversations -> tokens, with the loss on the assistant replies.

The bundled templates (`TEMPLATES`) are written here; `data.chat_template='tokenizer'` takes
the jinja template a HuggingFace tokenizer ships instead (lclm.data.model_chat). Both answer
`render`, `render_prompt`, `reply_end_id` and `check`; `get_template` gives either by name.

A conversation is rendered to text once, special tokens (BOS, EOS, '<|eot_id|>', ...) apart,
and each stretch of text between two special tokens is tokenised in one call, exactly as an
inference prompt holding the same conversation would be; the loss flags come from the
tokens' character spans. So training sees the token sequences that inference produces (a
LLaMA SentencePiece model tokenises "ASSISTANT: Ada" differently from "ASSISTANT:" and
" Ada" apart), and the flagged tokens are exactly those carrying reply text, plus the special
tokens that end each reply.

A token whose span straddles the boundary between prompt and reply (it holds characters of
both) is flagged: it carries reply text, so the model has to learn to produce it. Tokenizers
that split at whitespace (SentencePiece, LLaMA-3's pre-tokenizer) make none with the bundled
templates, whose replies start after a space or a special token.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import string
from typing import cast

import numpy as np

from lclm.errors import ConfigError

ROLE_ALIASES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "model": "assistant",
}


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """How a conversation is written. Each field is a format string: `{text}` (in
    `system_format`: `{system}`) is the turn's text, `{bos}` and `{eos}` the tokenizer's BOS
    (where it adds one, `Tokenizer.add_bos`) and EOS, and any other `{name}` the special token
    `name` (say `{<|eot_id|>}`), all inserted as ids. A turn's text is tokenised as text (a
    HuggingFace tokenizer, like `transformers`, reads special-token strings in it as those
    tokens; a SentencePiece model never does)."""

    begin: str  # once, at the start (no loss)
    system_format: str  # the system text, when there is one (no loss)
    user_format: str  # a user turn (no loss)
    assistant_prefix: str  # before each reply, no loss: what an inference prompt ends with
    assistant_format: str  # the reply, with loss (with its closing EOS or <|eot_id|>)
    default_system: str = ""
    system_in_first_user: bool = False  # system_format (plain text) opens the first user text
    strip: bool = False  # strip the whitespace around every turn's text

    # what every chat template answers (lclm.data.model_chat.ModelTemplate too)
    def render(self, turns, tokenizer) -> tuple[np.ndarray, np.ndarray]:
        return render(turns, tokenizer, self)

    def render_prompt(self, turns, tokenizer) -> np.ndarray:
        return render_prompt(turns, tokenizer, self)

    def reply_end_id(self, tokenizer) -> int | None:
        return reply_end_id(self, tokenizer)

    def check(self, tokenizer) -> None:
        check_template(self, tokenizer)


TEMPLATES = {
    # Vicuna v1.1 (FastChat), as used for ShareGPT fine-tuning in the Ring Attention paper:
    # BOS system USER: q ASSISTANT: a</s>USER: q2 ASSISTANT: a2</s>
    "vicuna": ChatTemplate(
        default_system="A chat between a curious user and an artificial intelligence "
        "assistant. The assistant gives helpful, detailed, and polite answers "
        "to the user's questions.",
        begin="{bos}",
        system_format="{system} ",
        user_format="USER: {text} ",
        assistant_prefix="ASSISTANT:",
        assistant_format=" {text}{eos}",
    ),
    # LLaMA-2 chat (Meta's reference code): every exchange is BOS [INST] q [/INST] a EOS, the
    # system text inside the first [INST] between <<SYS>> markers
    "llama2": ChatTemplate(
        begin="",
        system_format="<<SYS>>\n{system}\n<</SYS>>\n\n",
        user_format="{bos}[INST] {text} [/INST]",
        assistant_prefix="",
        assistant_format=" {text} {eos}",
        system_in_first_user=True,
        strip=True,
    ),
    # LLaMA-3 instruct: <|begin_of_text|>, then per turn a role header and the text closed by
    # <|eot_id|>; an inference prompt ends with the assistant header
    "llama3": ChatTemplate(
        begin="{<|begin_of_text|>}",
        system_format="{<|start_header_id|>}system{<|end_header_id|>}\n\n{system}{<|eot_id|>}",
        user_format="{<|start_header_id|>}user{<|end_header_id|>}\n\n{text}{<|eot_id|>}",
        assistant_prefix="{<|start_header_id|>}assistant{<|end_header_id|>}\n\n",
        assistant_format="{text}{<|eot_id|>}",
        strip=True,
    ),
}


# data.chat_template's name for the template the tokenizer ships (lclm.data.model_chat)
TOKENIZER = "tokenizer"
TEMPLATE_NAMES = (*TEMPLATES, TOKENIZER)


def get_template(name: str, tokenizer):
    """The chat template `name` names: a bundled one (`TEMPLATES`), or with 'tokenizer' the
    one `tokenizer` ships (its `chat_template`, rendered as transformers does). ConfigError
    (one line) for an unknown name or a tokenizer that ships none."""
    if name == TOKENIZER:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ConfigError(
                f"data.chat_template='tokenizer', but tokenizer "
                f"{tokenizer.path!r} ships no chat template (tokenizer_config."
                f"json's chat_template or chat_template.jinja); name one of "
                f"{sorted(TEMPLATES)}"
            )
        return tokenizer.chat_template
    if name not in TEMPLATES:
        raise ConfigError(f"unknown chat template {name!r}; use one of {sorted(TEMPLATE_NAMES)}")
    return TEMPLATES[name]


@dataclasses.dataclass(frozen=True)
class Special:
    """A special token in a template: "bos", "eos" or the token itself."""

    token: str


_VALUE = object()  # where a turn's text goes


@functools.cache
def _parse(fmt: str) -> tuple[object, ...]:
    """A template string as a tuple of literal text, `_VALUE` and `Special` pieces."""
    out: list[object] = []
    for literal, field, _, _ in string.Formatter().parse(fmt):
        if literal:
            out.append(literal)
        if field is not None:
            out.append(_VALUE if field in ("text", "system") else Special(field))
    return tuple(out)


def _specials(template: ChatTemplate) -> set[str]:
    return {
        p.token
        for f in (
            template.begin,
            template.system_format,
            template.user_format,
            template.assistant_prefix,
            template.assistant_format,
        )
        for p in _parse(f)
        if isinstance(p, Special)
    }


def check_template(template: ChatTemplate, tokenizer) -> None:
    """Fail (ConfigError) when the tokenizer lacks a special token that the template needs."""
    for token in sorted(_specials(template) - {"bos", "eos"}):
        tokenizer.special_id(token)
    if template.system_in_first_user and any(
        isinstance(p, Special) for p in _parse(template.system_format)
    ):
        raise ValueError("a system_format merged into the first user turn must be plain text")


def conversation_turns(record) -> list[tuple[str, str]] | None:
    """(role, text) turns of a ShareGPT record (`conversations` with from/value, or
    `messages` with role/content); None when the record is malformed."""
    if not isinstance(record, dict):
        return None
    turns = record.get("conversations", record.get("messages"))
    if not isinstance(turns, list) or not turns:
        return None
    out = []
    for t in turns:
        if not isinstance(t, dict):
            return None
        role = ROLE_ALIASES.get(str(t.get("from", t.get("role", ""))).lower())
        text = t.get("value", t.get("content"))
        if role is None or not isinstance(text, str):
            return None
        out.append((role, text))
    if not any(r == "assistant" and t.strip() for r, t in out):
        return None
    return out


def _layout(turns, template: ChatTemplate, prompt: bool = False) -> list[tuple[object, int]]:
    """The conversation as (piece, flag) pairs: text or `Special`, flag 1 on replies.
    `prompt`: end with the assistant prefix, as an inference prompt for the next reply."""
    parts = []

    def add(fmt, value="", flag=0):
        parts.extend((value if p is _VALUE else p, flag) for p in _parse(fmt))

    strip = str.strip if template.strip else (lambda t: t)
    add(template.begin)
    system = template.default_system
    if turns and turns[0][0] == "system":
        system, turns = turns[0][1], turns[1:]
    system, pending = strip(system), ""
    if system and template.system_in_first_user:
        # plain text and _VALUE only: check_template rejects a Special there
        pending = "".join(
            system if p is _VALUE else cast(str, p) for p in _parse(template.system_format)
        )
    elif system:
        add(template.system_format, system)
    for role, text in turns:
        if role == "user":
            add(template.user_format, strip(pending + text))
            pending = ""
        elif role == "assistant":
            if pending:
                add(template.user_format, strip(pending))
                pending = ""
            add(template.assistant_prefix)
            add(template.assistant_format, strip(text), 1)
    if prompt:
        if pending:
            add(template.user_format, strip(pending))
        add(template.assistant_prefix)
    return parts


def token_flags(offsets, spans, length: int) -> np.ndarray:
    """1 for each token whose character span [start, end) overlaps one of `spans`; a token
    with an empty span (made by the tokenizer, like SentencePiece's leading '▁' or the first
    bytes of a byte-fallback character) counts as covering the character it precedes (the
    last one at the very end of the text)."""
    o = np.fromiter(itertools.chain.from_iterable(offsets), np.int64, 2 * len(offsets))
    start, end = o[0::2], o[1::2]
    empty = start == end
    start[empty] = np.minimum(start[empty], max(length - 1, 0))
    end[empty] = start[empty] + 1
    flags = np.zeros(len(start), np.uint8)
    for a, b in spans:
        flags |= (start < b) & (end > a)
    return flags


def _tokenize(parts, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """Ids and flags of (piece, flag) pairs: each run of text between special tokens is
    tokenised in one call, flags from the tokens' character spans."""
    ids: list[int] = []
    flags: list[int] = []
    segment: list[str] = []
    spans: list[tuple[int, int]] = []
    n = 0

    def flush():
        nonlocal segment, spans, n
        text = "".join(segment)
        if not spans or spans == [(0, n)]:
            piece = tokenizer.encode(text) if text else []
            ids.extend(piece)
            flags.extend([1 if spans else 0] * len(piece))
        else:
            piece, offsets = tokenizer.encode_with_offsets(text)
            ids.extend(piece)
            flags.extend(token_flags(offsets, spans, n).tolist())
        segment, spans, n = [], [], 0

    for piece, flag in parts:
        if isinstance(piece, Special):
            flush()
            i = _special_id(piece, tokenizer)
            if i is not None:
                ids.append(i)
                flags.append(flag)
        elif piece:
            if flag and spans and spans[-1][1] == n:
                spans[-1] = (spans[-1][0], n + len(piece))
            elif flag:
                spans.append((n, n + len(piece)))
            segment.append(piece)
            n += len(piece)
    flush()
    return np.asarray(ids, np.int32), np.asarray(flags, np.uint8)


def _special_id(piece: Special, tokenizer) -> int | None:
    """The id a template's special token stands for (None: a BOS the tokenizer omits)."""
    if piece.token == "bos":
        return tokenizer.bos_id if tokenizer.add_bos else None
    if piece.token == "eos":
        return tokenizer.eos_id
    return tokenizer.special_id(piece.token)


def reply_end_id(template: ChatTemplate, tokenizer) -> int | None:
    """The id that closes a reply (EOS, or LLaMA-3's <|eot_id|>): where a generated reply
    ends. None where the template closes replies with no special token."""
    ends = [p for p in _parse(template.assistant_format) if isinstance(p, Special)]
    return _special_id(ends[-1], tokenizer) if ends else None


def render(turns, tokenizer, template: ChatTemplate) -> tuple[np.ndarray, np.ndarray]:
    """Token ids `[n]` and a per-token loss flag `[n]`: 1 on the tokens carrying assistant
    reply text (`assistant_format`, including a token that straddles the reply's start) and
    on the EOS/<|eot_id|> closing each reply.

    The ids are those of tokenising the rendered text in one call per stretch between special
    tokens (see the module docstring), so they match what inference sees."""
    return _tokenize(_layout(turns, template), tokenizer)


def render_prompt(turns, tokenizer, template: ChatTemplate) -> np.ndarray:
    """Token ids of an inference prompt: the conversation so far (its last turn a user turn,
    usually) and the assistant prefix; the reply the model writes continues it. With the
    bundled templates and a tokenizer that splits at whitespace, `render`'s ids up to a
    reply's first flagged token are the ids of the prompt for that reply."""
    return _tokenize(_layout(turns, template, prompt=True), tokenizer)[0]

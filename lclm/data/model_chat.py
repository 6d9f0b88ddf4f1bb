"""A tokenizer's own chat template (`data.chat_template='tokenizer'`): the jinja template a
HuggingFace tokenizer ships (tokenizer_config.json's `chat_template`, or chat_template.jinja
beside it), rendered as transformers' `apply_chat_template` renders it.

The text comes from jinja2's immutable sandbox (a template is untrusted: it can read only
what it is given and call nothing else), set up as transformers sets it up: trim_blocks,
lstrip_blocks, loop controls, `{% generation %}` blocks rendered as their body,
`raise_exception`, `strftime_now`, a `tojson` that does not escape HTML, and the tokenizer's
special tokens (`bos_token`, `eos_token`, ...). The ids are that text tokenised in one call,
as `apply_chat_template(tokenize=True)` does.

The loss flags: each assistant reply's text, found by rendering the conversation once more
with a marker in place of each reply; the text with the markers replaced by the replies must
equal the real rendering (a template that rewrites replies, say trims them, is retried with
trimmed replies; one that still differs refuses the conversation), plus the special token
that closes the reply (ChatML's <|im_end|>, LLaMA-3's <|eot_id|>, </s>) where one follows it
directly.
"""

from __future__ import annotations

import datetime
import functools
import json
from dataclasses import dataclass

import jinja2
import numpy as np
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from lclm.data.chat import token_flags

_MARK = "\ue000{}\ue001"  # private-use characters: a reply's place in a marked rendering


@functools.cache
def _compiled(source: str) -> jinja2.Template:
    """The template `source` compiled in a sandbox set up as transformers sets it up."""

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` (transformers' marker of assistant text):
        its body as it is; lclm finds replies itself."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
                lineno
            )

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception, strftime_now=lambda f: datetime.datetime.now().strftime(f)
    )
    return env.from_string(source)


class TemplateRefused(ValueError):
    """The template raised, or rewrites replies so that they cannot be found."""


@dataclass(frozen=True)
class ModelTemplate:
    """The chat template `source` (jinja) of a tokenizer, with its special tokens' strings
    (`bos_token`, `eos_token`, ... as the template reads them)."""

    source: str
    tokens: tuple[tuple[str, str], ...] = ()

    def _render(self, messages: list[dict], prompt: bool = False) -> str:
        try:
            return _compiled(self.source).render(
                messages=messages, add_generation_prompt=prompt, **dict(self.tokens)
            )
        except jinja2.TemplateError as e:
            raise TemplateRefused(
                f"the tokenizer's chat template refuses the conversation "
                f"({' '.join(str(e).split())[:200]})"
            ) from None

    def text(self, turns, prompt: bool = False) -> str:
        """The conversation's text; `prompt`: with the generation prompt (an assistant
        header) after it."""
        return self._render([{"role": r, "content": t} for r, t in turns], prompt)

    def text_and_replies(self, turns) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text and the character span of each assistant reply in it."""
        real = self.text(turns)
        if any(_MARK[0] in t or _MARK[-1] in t for _, t in turns):
            raise TemplateRefused("a turn holds the private-use characters U+E000/U+E001")
        marked = self._render(
            [
                {"role": r, "content": _MARK.format(i) if r == "assistant" else t}
                for i, (r, t) in enumerate(turns)
            ]
        )
        for strip in (False, True):
            text, spans, at = [], [], 0
            for i, (role, reply) in enumerate(turns):
                if role != "assistant":
                    continue
                mark = _MARK.format(i)
                where = marked.find(mark, at)
                if where < 0 or marked.count(mark) != 1:
                    raise TemplateRefused(
                        "the tokenizer's chat template does not write each assistant reply once"
                    )
                text.append(marked[at:where])
                start = sum(map(len, text))
                text.append(reply.strip() if strip else reply)
                spans.append((start, start + len(text[-1])))
                at = where + len(mark)
            text.append(marked[at:])
            if "".join(text) == real:
                return real, spans
        raise TemplateRefused(
            "the tokenizer's chat template rewrites assistant replies; lclm "
            "cannot tell which tokens carry them"
        )

    def render(self, turns, tokenizer) -> tuple[np.ndarray, np.ndarray]:
        """Token ids `[n]` and loss flags `[n]` (1: a reply's tokens and the special token
        closing it)."""
        text, spans = self.text_and_replies(turns)
        ids, offsets = tokenizer.encode_with_offsets(text)
        flags = token_flags(offsets, spans, len(text))
        special, starts = tokenizer.special_ids(), np.asarray([s for s, _ in offsets])
        for _, end in spans:
            # the token right after a reply: flagged when it is a special token (its end)
            i = int(np.searchsorted(starts, end))
            if i < len(ids) and offsets[i][0] == end and ids[i] in special:
                flags[i] = 1
        return np.asarray(ids, np.int32), flags.astype(np.uint8)

    def render_prompt(self, turns, tokenizer) -> np.ndarray:
        """Token ids of an inference prompt: the conversation and the generation prompt."""
        return np.asarray(tokenizer.encode(self.text(turns, prompt=True)), np.int32)

    def reply_end_id(self, tokenizer) -> int | None:
        """The special token that closes a reply (found in a probe conversation), else EOS."""
        ids, flags = self.render([("user", "Hi"), ("assistant", "Hello")], tokenizer)
        special = tokenizer.special_ids()
        last = int(np.flatnonzero(flags)[-1])
        return int(ids[last]) if ids[last] in special else tokenizer.eos_id

    def check(self, tokenizer) -> None:
        """Fail (TemplateRefused) unless a probe conversation renders with its replies found."""
        self.render(
            [
                ("system", "S"),
                ("user", "Hi"),
                ("assistant", "Hello"),
                ("user", "Again"),
                ("assistant", "Bye"),
            ],
            tokenizer,
        )

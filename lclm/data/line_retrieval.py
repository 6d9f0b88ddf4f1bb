"""Line retrieval (Ring Attention, section 5.3): numbered lines of random numbers, one asked for.

A document is `BOS, filler, "line 1: 382. line 2: 907. ... line N: 115.", question, answer,
EOS`, e.g. the question "Tell me line 17:" and the answer "382" (the value of line 17). The
same builder makes training documents (answer included, the loss only on the answer and its
EOS) and evaluation prompts (everything before the answer), so both see one format.

Length. A document of `n_tokens` holds as many lines as fit, and the gap left (shorter than a
line) is filled with a run of one filler token right after BOS, so every document is exactly
`n_tokens` long: training documents of `data.seq_len` tokens fill packed rows one to one (no
document is split between rows, which would hide the asked line from the answer), and an
evaluation prompt of length L is the same document with its answer and EOS removed.

The text is rendered by `lclm.data.chat.render` (user turn = lines + question, assistant
turn = the answer after a space), which tokenises it in one call and flags the answer tokens
and EOS; the packer and loader then turn those flags into loss masks as for any chat data.

As a training source: `config.data.path = "line_retrieval:tokens=256;digits=3;seed=0"`
(';'-separated `key=value` options, see `Spec`); the documents are generated on the fly,
deterministically from (seed, document index).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np

from lclm.data.chat import ChatTemplate, render
from lclm.data.kind import OPTIONS, Kind

# The user turn is the document, the assistant turn the answer after a space (as in the
# lines): no system text, no role markers (the question itself says what is asked).
TEMPLATE = ChatTemplate(
    begin="{bos}",
    system_format="{system}",
    user_format="{text}",
    assistant_prefix="",
    assistant_format=" {text}{eos}",
)


@dataclasses.dataclass(frozen=True)
class LineFormat:
    """How lines and the question are written. `{key}` is the line number, `{value}` its
    number (`digits` digits, no leading zero)."""

    line: str
    question: str
    digits: int = 3


FORMATS = {
    # compact, for small vocabularies: ~12 tokens a line with the demo's 512-piece tokenizer,
    # and the question ends like a line ("line 17:") so the answer continues the pattern
    "compact": "line {key}: {value}.|Tell me line {key}:",
    # the wording of the LongChat test used by the paper (its keys are numbers here)
    "paper": "line {key}: REGISTER_CONTENT is <{value}>|"
    "Tell me what is the REGISTER_CONTENT in line {key}? I need the answer now.",
}


def line_format(name: str = "compact", digits: int = 3) -> LineFormat:
    """The named format of `FORMATS` with `digits`-digit values."""
    if name not in FORMATS:
        raise ValueError(f"unknown line-retrieval format {name!r}; use one of {sorted(FORMATS)}")
    if not 1 <= digits <= 9:
        raise ValueError(f"digits={digits}; use 1 to 9")
    line, question = FORMATS[name].split("|")
    return LineFormat(line, question, digits)


@dataclasses.dataclass
class Example:
    """One document. `tokens`/`loss` `[n_tokens]`; the prompt is `tokens[:prompt_len]`."""

    tokens: np.ndarray  # int32: BOS, filler, lines, question, answer, EOS
    loss: np.ndarray  # int8: 1 on the answer tokens and EOS
    prompt_len: int
    answer: str  # the asked line's value, as written
    key: int  # the asked line number (1-based)
    n_lines: int
    depth: float  # asked line index / n_lines: the fraction of lines before it


def _values(rng, n: int, digits: int) -> np.ndarray:
    return rng.integers(10 ** (digits - 1), 10**digits, size=n)


def _pick_line(rng, n_lines: int, depth_bin: int | None, n_bins: int) -> int:
    """Index i of the asked line: uniform over all lines, or over those whose depth i/n lies
    in bin `depth_bin`, i.e. [b/n_bins, (b+1)/n_bins) (non-empty when n >= n_bins)."""
    if depth_bin is None:
        return int(rng.integers(n_lines))
    lo = -(-depth_bin * n_lines // n_bins)
    hi = -(-(depth_bin + 1) * n_lines // n_bins)
    return int(rng.integers(lo, hi))


def _render(tokenizer, fmt: LineFormat, values, asked: int):
    """(tokens, flags) of BOS + lines + question + answer + EOS (no filler)."""
    lines = [fmt.line.format(key=i + 1, value=v) for i, v in enumerate(values)]
    text = " ".join(lines + [fmt.question.format(key=asked + 1)])
    return render([("user", text), ("assistant", str(values[asked]))], tokenizer, TEMPLATE)


def _choose_lines(tokenizer, rng, fmt: LineFormat, n_tokens: int) -> list[int]:
    """Values of as many lines as fit in `n_tokens` with BOS, question, answer and EOS.

    Lines are measured one by one (with tokenizers that split at whitespace, as SentencePiece
    does, lengths add up; `build_example` drops lines where they do not); the reserve is the
    longest question and answer that any of the lines could need."""
    answer_len = len(tokenizer.encode(str(10**fmt.digits - 1))) + 2  # + BOS, EOS
    values: list[int] = []
    used = 0
    while True:
        v = int(_values(rng, 1, fmt.digits)[0])
        key = len(values) + 1
        line_len = len(tokenizer.encode(fmt.line.format(key=key, value=v)))
        reserve = len(tokenizer.encode(fmt.question.format(key=key))) + answer_len
        if used + line_len + reserve > n_tokens:
            return values
        values.append(v)
        used += line_len


def build_example(
    tokenizer,
    rng,
    n_tokens: int,
    fmt: LineFormat = line_format(),
    depth_bin: int | None = None,
    n_bins: int = 5,
    filler: int | None = None,
) -> Example:
    """A document of exactly `n_tokens` tokens (see the module docstring).

    `rng` is a numpy Generator (all randomness comes from it); `depth_bin` in
    [0, n_bins) restricts the asked line to that fraction of the document (None: any line);
    `filler` is the id of the padding token (default: the tokenizer's '.').
    """
    filler = filler_id(tokenizer) if filler is None else filler
    values = _choose_lines(tokenizer, rng, fmt, n_tokens)
    while True:
        if len(values) < (n_bins if depth_bin is not None else 1):
            raise ValueError(
                f"{n_tokens} tokens hold only {len(values)} lines; use a longer "
                "document or fewer depth bins"
            )
        asked = _pick_line(rng, len(values), depth_bin, n_bins)
        ids, flags = _render(tokenizer, fmt, values, asked)
        if len(ids) <= n_tokens:
            break
        values.pop()  # a tokenizer that merges across pieces made it too long (rare)
    gap, lead = n_tokens - len(ids), int(tokenizer.add_bos)  # the filler goes after BOS
    tokens = np.concatenate([ids[:lead], np.full(gap, filler, np.int32), ids[lead:]]).astype(
        np.int32
    )
    loss = np.concatenate([flags[:lead], np.zeros(gap, np.uint8), flags[lead:]]).astype(np.int8)
    return Example(
        tokens=tokens,
        loss=loss,
        prompt_len=int(np.argmax(loss)),
        answer=str(values[asked]),
        key=asked + 1,
        n_lines=len(values),
        depth=asked / len(values),
    )


def filler_id(tokenizer) -> int:
    """The padding token after BOS: the tokenizer's piece for '.' (the last id it encodes)."""
    return int(tokenizer.encode(".")[-1])


def parse_answer(text: str) -> str | None:
    """What generated text answers: the first number written like the paper's values
    (`<38291>`, as instruction models tend to quote them), else its first run of digits;
    None when it holds no digits."""
    match = re.search(r"<(\d+)>", text)
    if match:
        return match.group(1)
    match = re.search(r"\d+", text)
    return match.group(0) if match else None


# -- the training data source ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Spec:
    """Options of a `line_retrieval:` source (';'-separated `key=value`).

    tokens: document length (make `data.seq_len` a multiple of it so rows hold whole
    documents); digits, format: see `line_format`; seed: the documents' seed; docs: the
    number of distinct documents (an epoch); pad_to: a longer length the document is
    filled up to at its end, with no loss (0: none), so that a shorter task fills a row
    of a longer stage alone, at the positions it was first trained at (a packed shorter
    document would push the next one across a row boundary, away from its lines).
    """

    tokens: int = 256
    digits: int = 3
    format: str = "compact"
    seed: int = 0
    docs: int = 1_000_000
    pad_to: int = 0

    @classmethod
    def parse(cls, text: str) -> Spec:
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}  # str for format, int for the others
        for item in filter(None, (s.strip() for s in text.split(";"))):
            key, sep, raw = item.partition("=")
            if not sep or key not in fields:
                raise ValueError(
                    f"bad line_retrieval option {item!r}; use ';'-separated "
                    f"key=value with keys {sorted(fields)}"
                )
            values[key] = raw if key == "format" else int(raw)
        spec = cls(**values)
        line_format(spec.format, spec.digits)  # validates both
        if spec.pad_to and spec.pad_to < spec.tokens:
            raise ValueError(
                f"line_retrieval option pad_to={spec.pad_to} is shorter than "
                f"tokens={spec.tokens}; use 0 (no padding) or at least tokens"
            )
        return spec

    @property
    def line_format(self) -> LineFormat:
        return line_format(self.format, self.digits)


class LineRetrievalDocuments:
    """Random-access training documents `(tokens int32 [tokens], loss int8 [tokens])`;
    document i depends only on (spec.seed, i)."""

    def __init__(self, spec: Spec, tokenizer):
        self.spec, self.tokenizer = spec, tokenizer
        self.fmt, self.filler = spec.line_format, filler_id(tokenizer)
        build_example(tokenizer, np.random.default_rng(0), spec.tokens, self.fmt)  # fits?

    def __len__(self) -> int:
        return self.spec.docs

    def __getitem__(self, i: int):
        if not 0 <= i < len(self):
            raise IndexError(i)
        rng = np.random.default_rng([self.spec.seed, int(i)])
        ex = build_example(self.tokenizer, rng, self.spec.tokens, self.fmt, filler=self.filler)
        pad = max(self.spec.pad_to - self.spec.tokens, 0)  # after the answer: it sees none
        return (
            np.concatenate([ex.tokens, np.full(pad, self.filler, np.int32)]),
            np.concatenate([ex.loss, np.zeros(pad, np.int8)]),
        )


def open_source(options: str, tokenizer) -> LineRetrievalDocuments:
    """The document set of a `line_retrieval:OPTIONS` entry of `config.data.path`."""
    return LineRetrievalDocuments(Spec.parse(options), tokenizer)


def spec_of_config(data_config) -> Spec | None:
    """The `Spec` of the first line_retrieval source of a (saved) `config.data`, if any."""
    for entry in str(data_config.get("path", "")).split(","):
        kind, sep, rest = entry.strip().partition(":")
        if sep and kind == KIND.name:
            return Spec.parse(rest.rsplit("@", 1)[0])
    return None


def chance_accuracy(digits: int) -> float:
    """Accuracy of guessing a uniformly random `digits`-digit value."""
    return 1.0 / (9 * 10 ** (digits - 1))


# the data source kind `line_retrieval:OPTIONS` (generated documents: records are not read)
KIND = Kind(
    "line_retrieval", lambda options, tokenizer, _: open_source(options, tokenizer), OPTIONS
)


__all__ = [
    "Example",
    "FORMATS",
    "KIND",
    "LineFormat",
    "LineRetrievalDocuments",
    "Spec",
    "build_example",
    "chance_accuracy",
    "filler_id",
    "line_format",
    "open_source",
    "parse_answer",
    "spec_of_config",
]

"""Documents made one per record: the `text` and `sharegpt` kinds.

`text`: each record's text (data.text_field) as BOS + text + EOS, every token a target.
`sharegpt`: each record's conversation (`conversations` or `messages`) rendered with a chat
template (data.chat_template), the assistant's tokens the targets. Both read their records
with `lclm.data.records` (any of its formats), and both are what `python -m
lclm.data.prepare` takes.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from lclm.data.chat import ChatTemplate, conversation_turns, get_template
from lclm.data.kind import FILES, Kind, Longer, Reading
from lclm.data.model_chat import TemplateRefused
from lclm.data.records import Records, chat_problem, read_records, text_problem


class _RecordDocuments:
    """Documents made one per record of `records` (None for a malformed one, see
    `read_records`, which stays None); subclasses say how in `document`."""

    records: Records

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray] | None:
        record = self.records[i]
        return None if record is None else self.document(record)

    def document(self, record) -> tuple[np.ndarray, np.ndarray]:
        """(tokens `[n]` int32, loss flags `[n]` int8) of one usable record."""
        raise NotImplementedError


class TextDocuments(_RecordDocuments):
    """Plain documents: BOS + text + EOS, every token a target; a long text is tokenised in
    pieces on the tokenizer's threads where that gives the same ids (`Tokenizer.encode_long`).

    The length options ask two more things, cheaper than a document: `most_tokens(i)`, an
    upper bound of document i's length read from its text's bytes (None where the tokenizer
    gives none), and `upto(i, limit)`, the document where it has at most `limit` tokens,
    else `Longer` (its text encoded only until past the limit)."""

    def __init__(self, records: Records, text_field: str, tokenizer):
        self.records, self.field, self.tokenizer = records, text_field, tokenizer

    def _ends(self) -> int:
        """The tokens a document adds to its text's: BOS (where the tokenizer adds one), EOS."""
        return int(self.tokenizer.add_bos) + 1

    def document(self, record) -> tuple[np.ndarray, np.ndarray]:
        return self._made(self.tokenizer.encode_long(record[self.field]))

    def _made(self, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        tok = self.tokenizer
        tokens = np.asarray([tok.bos_id] * tok.add_bos + ids + [tok.eos_id], np.int32)
        loss = np.ones(len(tokens), np.int8)
        loss[0] = 0  # the document's first token (BOS): nothing predicts it
        return tokens, loss

    def most_tokens(self, i: int) -> int | None:
        record = self.records[i]
        if record is None:
            return 0  # a malformed record: no tokens (as the loader counts it)
        most = self.tokenizer.most_tokens(record[self.field])
        return None if most is None else most + self._ends()

    def upto(self, i: int, limit: int) -> tuple[np.ndarray, np.ndarray] | Longer | None:
        record = self.records[i]
        if record is None:
            return None
        ids = self.tokenizer.encode_upto(record[self.field], limit - self._ends())
        return Longer(limit + 1) if ids is None else self._made(ids)


class ChatDocuments(_RecordDocuments):
    """ShareGPT conversations rendered with a chat template; loss on assistant tokens."""

    def __init__(self, records: Records, tokenizer, template):
        self.records, self.tokenizer, self.template = records, tokenizer, template

    def document(self, record) -> tuple[np.ndarray, np.ndarray]:
        tokens, flags = self.template.render(conversation_turns(record), self.tokenizer)
        return tokens, flags.astype(np.int8)


def _refused(template, record) -> str | None:
    """Why the tokenizer's own chat template cannot render `record` (None: it can)."""
    try:
        template.text_and_replies(conversation_turns(record))
    except TemplateRefused as e:
        return str(e)
    return None


def open_text(path: str, tokenizer, reading: Reading) -> TextDocuments:
    field = reading.text_field
    records = read_records(path, field, lambda r: text_problem(r, field), (field,), reading.stats)
    return TextDocuments(records, field, tokenizer)


def open_sharegpt(path: str, tokenizer, reading: Reading) -> ChatDocuments:
    template = get_template(reading.chat_template, tokenizer)
    template.check(tokenizer)  # its special tokens exist, or a ConfigError
    problem: Callable[[object], str | None] = chat_problem
    if not isinstance(template, ChatTemplate):  # the tokenizer's own may refuse some
        problem = lambda r: chat_problem(r) or _refused(template, r)
    records = read_records(
        path, reading.text_field, problem, ("conversations", "messages"), reading.stats
    )
    return ChatDocuments(records, tokenizer, template)


KINDS = (
    Kind("text", open_text, FILES, prepare=True),
    Kind("sharegpt", open_sharegpt, FILES, prepare=True),
)

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
from lclm.data.kind import FILES, Kind, Reading
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
    pieces on the tokenizer's threads where that gives the same ids (`Tokenizer.encode_long`)."""

    def __init__(self, records: Records, text_field: str, tokenizer):
        self.records, self.field, self.tokenizer = records, text_field, tokenizer

    def document(self, record) -> tuple[np.ndarray, np.ndarray]:
        tok = self.tokenizer
        ids = [tok.bos_id] * tok.add_bos + tok.encode_long(record[self.field]) + [tok.eos_id]
        tokens = np.asarray(ids, np.int32)
        loss = np.ones(len(ids), np.int8)
        loss[0] = 0  # the document's first token (BOS): nothing predicts it
        return tokens, loss


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

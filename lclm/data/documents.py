"""Documents made one per record: the `text` and `sharegpt` kinds.

`text`: each record's text (data.text_field) as BOS + text + EOS, every token a target.
`sharegpt`: each record's conversation (`conversations` or `messages`) rendered with a chat
template (data.chat_template), the assistant's tokens the targets. Both read their records
with `lclm.data.records` (any of its formats), and both are what `python -m
lclm.data.prepare` takes.
"""

from __future__ import annotations

import math
import sys
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


class Partial:
    """A document read as far as it is needed: its text's pieces (`Tokenizer.long_pieces`)
    encoded a batch at a time, the tokens handed out in parts (`take`).

    `encoded`: its tokens encoded so far (BOS and, once `complete`, EOS included): a lower
    bound of its length, which is exact once complete. `read_to(n)` encodes until at least
    n tokens are (or all); `take()` hands out what is encoded and not yet handed out,
    `(tokens int32 [k], loss int8 [k])`, encoding the next batch first where nothing is
    waiting (None once everything was handed out); the parts joined are the whole document,
    the same ids as `TextDocuments[i]`. `on_encoded(k)`, where set, is told of every k tokens
    encoded from then on (the mixture counts a source's tokens so). Not shared between
    threads: one reader uses it at a time.
    """

    def __init__(self, tokenizer, texts: list[str], most: int):
        self._tok, self._texts, self._most = tokenizer, texts, max(most, 1)
        self._next, self._step = 0, 1  # pieces per batch: 1, 2, 4 ... up to `most`
        self._held: list[np.ndarray] = []
        if tokenizer.add_bos:
            self._held.append(np.array([tokenizer.bos_id], np.int32))
        self.encoded = len(self._held)
        self._handed = False
        self.on_encoded: Callable[[int], None] | None = None

    @property
    def complete(self) -> bool:
        return self._next >= len(self._texts)

    def _encode_more(self, at_most: int | None = None) -> None:
        count = self._step if at_most is None else max(1, min(at_most, self._step))
        batch = self._texts[self._next : self._next + count]
        self._next += len(batch)
        self._step = min(2 * self._step, self._most)
        found = [np.asarray(ids, np.int32) for ids in self._tok.encode_batch(batch)]
        if self.complete:
            found.append(np.array([self._tok.eos_id], np.int32))
        n = sum(map(len, found))
        self._held += found
        self.encoded += n
        if self.on_encoded is not None:
            self.on_encoded(n)

    def read_to(self, n: int) -> None:
        while self.encoded < n and not self.complete:
            # no more pieces than the tokens still wanted take, at the rate read so far (a
            # length option's decision reads little past its threshold)
            per_piece = self.encoded / self._next if self._next else 0.0
            wanted = math.ceil((n - self.encoded) / per_piece) if per_piece else None
            self._encode_more(wanted)

    def take(self) -> tuple[np.ndarray, np.ndarray] | None:
        if not self._held:
            if self.complete:
                return None
            self._encode_more()
        tokens = np.concatenate(self._held)
        self._held = []
        loss = np.ones(len(tokens), np.int8)
        if not self._handed:
            loss[0] = 0  # the document's first token (BOS): nothing predicts it
            self._handed = True
        return tokens, loss

    def whole(self) -> tuple[np.ndarray, np.ndarray]:
        """The whole document (what is left of it, where parts were taken)."""
        self._step = max(len(self._texts) - self._next, 1)  # what is left, in one batch call
        self.read_to(sys.maxsize)
        taken = self.take()
        assert taken is not None  # a complete document ends with EOS, never taken yet
        return taken


def document_length(doc) -> int:
    """The tokens of a document, a `Partial` (as far as encoded) or None (malformed: 0)."""
    if doc is None:
        return 0
    return doc.encoded if isinstance(doc, Partial) else len(doc[0])


def read_partly(docs, i: int, n: int = 0):
    """Document i of `docs` read to at least `n` tokens, a `Partial`, where the set reads
    documents in parts (`partial(i, n)`, see `lclm.data.kind.Documents`); else whole."""
    partial = getattr(docs, "partial", None)
    return docs[i] if partial is None else partial(i, n)


class TextDocuments(_RecordDocuments):
    """Plain documents: BOS + text + EOS, every token a target; a long text is tokenised in
    pieces on the tokenizer's threads where that gives the same ids (`Tokenizer.encode_long`).

    Read for the loader, a document need not be encoded whole: `most_tokens(i)` bounds its
    length from its text's bytes (None where the tokenizer gives no bound), and
    `partial(i, n)` is a `Partial` read to at least n tokens."""

    def __init__(self, records: Records, text_field: str, tokenizer):
        self.records, self.field, self.tokenizer = records, text_field, tokenizer

    def _ends(self) -> int:
        """The tokens a document adds to its text's: BOS (where the tokenizer adds one), EOS."""
        return int(self.tokenizer.add_bos) + 1

    def document(self, record) -> tuple[np.ndarray, np.ndarray]:
        texts = self.tokenizer.long_pieces(record[self.field])
        return Partial(self.tokenizer, texts, len(texts)).whole()

    def most_tokens(self, i: int) -> int | None:
        record = self.records[i]
        if record is None:
            return 0  # a malformed record: no tokens (as the loader counts it)
        most = self.tokenizer.most_tokens(record[self.field])
        return None if most is None else most + self._ends()

    def partial(self, i: int, n: int, workers: int = 1) -> Partial | None:
        """`workers`: the most pieces its `Partial` encodes in one batch call (the
        tokenizer's threads share them out)."""
        record = self.records[i]
        if record is None:
            return None
        texts = self.tokenizer.long_pieces(record[self.field])
        found = Partial(self.tokenizer, texts, workers)
        found.read_to(n)
        return found


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

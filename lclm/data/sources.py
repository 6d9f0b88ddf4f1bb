"""Data sources: raw records from local files or `datasets`, and documents made from them.

Record formats: .jsonl / .json (read tolerantly line by line: one bad line is skipped, not
the file), .txt (documents separated by blank lines), .parquet / .arrow files and saved
`datasets` directories (through `datasets`, memory-mapped), `hub:NAME` (a named hub dataset,
only where a hub is reachable), and pre-tokenised directories written by
`python -m lclm.data.prepare`. Nothing loaded is unpickled or executed.

A document is `(tokens int32 [n], loss int8 [n])`, where `loss[i]` says whether token i is
a training target (predicting it is learned); document i of a source is always the same.
Malformed records (bad JSON, missing or non-string fields, empty text, bad UTF-8 - per line
or record, not per file -, conversations without an assistant reply) are skipped and counted
once in `SourceStats`: records of files read whole are all checked when the source is
opened, Arrow-backed ones as they are first read. A source without a single usable record
(empty, binary, another format, the wrong field) fails when it is opened (`DataError`).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from lclm.data import line_retrieval
from lclm.data.chat import TEMPLATES, check_template, conversation_turns, render
from lclm.errors import StartupError

TOKENIZED_META = "lclm_tokens.json"


class DataError(StartupError):
    """A data source that cannot be trained on (entirely malformed, empty, too small for its
    readers); the message is one line that names the file or source."""


@dataclasses.dataclass
class SourceStats:
    """Malformed records left out, each counted once (a source is read again every epoch)."""
    skipped: int = 0
    examples: list = dataclasses.field(default_factory=list)

    def skip(self, where: str, why: str) -> None:
        self.skipped += 1
        if len(self.examples) < 5:
            self.examples.append(f"{where}: {why}")

    def summary(self) -> str:
        return f"{self.skipped} records skipped (first: {'; '.join(self.examples)})"


def resolve_files(path: str) -> list[str]:
    """Files named by a path, a directory or a glob; a clear error when there are none."""
    if os.path.isfile(path):   # a name with glob characters ('[') is still itself
        return [path]
    if os.path.isdir(path):
        files = sorted(f for ext in ("jsonl", "json", "txt", "parquet", "arrow")
                       for f in glob.glob(os.path.join(glob.escape(path), f"*.{ext}")))
    else:
        files = sorted(glob.glob(path))
    if not files:
        raise FileNotFoundError(f"no data files at {path!r}; point config.data.path at a "
                                ".jsonl/.json/.txt/.parquet/.arrow file, a directory or a glob")
    return files


def is_unicode(text: str) -> bool:
    """False for text holding lone surrogates: undecodable bytes (read with
    'surrogateescape', so that a bad byte costs only its own record) or JSON escapes such as
    \\ud800. No tokenizer can encode such text."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def text_problem(record, field: str) -> str | None:
    """Why `record` is not a plain-text document (None: it is one)."""
    text = record.get(field) if isinstance(record, dict) else None
    if not isinstance(text, str) or not text.strip():
        return f"no non-empty string field {field!r}"
    return None if is_unicode(text) else "invalid UTF-8"


def chat_problem(record) -> str | None:
    """Why `record` is not a ShareGPT conversation (None: it is one)."""
    turns = conversation_turns(record)
    if turns is None:
        return "not a conversation with an assistant reply"
    return None if all(is_unicode(text) for _, text in turns) else "invalid UTF-8"


# A file's entries: (where, record, why) with `why` the reason it could not be read (None:
# `record` was read; whether it is usable is for the source kind to say).
_Entry = tuple[str, object, str | None]


def _json_entries(file: str, text: str) -> list[_Entry]:
    """Entries of a .json file (a list of records) or of JSON lines (.jsonl, or a .json
    file that is not one JSON document); a bad line costs only that line."""
    if file.endswith(".json"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            # not a JSON document: try it as JSON lines before giving up on it
            if "\n" not in text.strip():
                return [(file, None, f"bad JSON ({e.msg})")]
        else:
            if isinstance(data, list):
                return [(f"{file}[{k}]", r, None) for k, r in enumerate(data)]
            return [(file, None, "a .json file must hold a list of records")]
    entries: list[_Entry] = []
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        where = f"{file}:{n}"
        if not is_unicode(line):
            entries.append((where, None, "invalid UTF-8"))
            continue
        try:
            entries.append((where, json.loads(line), None))
        except json.JSONDecodeError as e:
            entries.append((where, None, f"bad JSON ({e.msg})"))
    return entries


def _text_entries(file: str, text: str, text_field: str) -> list[_Entry]:
    """Entries of a .txt file: documents separated by blank lines."""
    entries: list[_Entry] = []
    line = 1
    for chunk in text.split("\n\n"):
        if chunk.strip():
            entries.append((f"{file}:{line}", {text_field: chunk}, None))
        line += chunk.count("\n") + 2
    return entries


def _file_entries(file: str, text_field: str) -> list[_Entry]:
    """Entries of one file of any format that is read whole."""
    if file.endswith((".parquet", ".arrow")):
        import datasets
        kind = "parquet" if file.endswith(".parquet") else "arrow"
        table = datasets.load_dataset(kind, data_files=file, split="train")
        return [(f"{file} row {k}", r, None) for k, r in enumerate(table)]
    with open(file, "rb") as f:
        text = f.read().decode("utf-8", errors="surrogateescape")
    if file.endswith(".txt"):
        return _text_entries(file, text, text_field)
    return _json_entries(file, text)


def _usable(file: str, entries, problem, stats: SourceStats) -> list:
    """The usable records of one file; the others are counted. A file without any usable
    record (empty, binary, another format, the wrong field) is a `DataError`."""
    good, bad, first = [], 0, None
    for where, record, why in entries:
        why = why or problem(record)
        if why is None:
            good.append(record)
            continue
        stats.skip(where, why)
        bad, first = bad + 1, first or f"{where}: {why}"
    if not good:
        raise DataError(f"{file} is empty" if not bad else
                        f"{file} holds no usable record ({bad} malformed, the first {first})")
    return good


class Records(Protocol):
    """A random-access sequence of records (a list, or `CheckedAsRead`)."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int, /) -> Any: ...


class CheckedAsRead:
    """Arrow-backed records (memory-mapped, possibly larger than memory, so not all checked
    at start): a malformed record reads as None and is counted the first time it is read;
    reading raises `DataError` once every record has been found malformed."""

    def __init__(self, records, problem, stats: SourceStats, name: str):
        self.records, self.problem, self.stats, self.name = records, problem, stats, name
        self._bad: set[int] = set()

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int):
        record = self.records[i]
        why = self.problem(record)
        if why is None:
            return record
        if i not in self._bad:
            self._bad.add(i)
            self.stats.skip(f"{self.name} row {i}", why)
            if len(self._bad) == len(self.records):
                raise DataError(f"{self.name}: every one of its {len(self.records)} records "
                                f"is malformed (e.g. row {i}: {why})")
        return None


def _arrow_dataset(path: str):
    """The Arrow-backed dataset that `path` names (a hub dataset, a saved `datasets`
    directory, or only .parquet or only .arrow files), else None."""
    saved = os.path.isdir(path) and os.path.isfile(os.path.join(path, "dataset_info.json"))
    if not (saved or path.startswith("hub:")):
        files = resolve_files(path)
        kinds = [k for k in ("parquet", "arrow") if all(f.endswith(f".{k}") for f in files)]
        if not kinds:
            return None
    import datasets
    if path.startswith("hub:"):
        return datasets.load_dataset(path[4:], split="train")
    if saved:
        ds = datasets.load_from_disk(path)
        return ds["train"] if isinstance(ds, datasets.DatasetDict) else ds
    return datasets.load_dataset(kinds[0], data_files=files, split="train")


def read_records(path: str, text_field: str, problem, columns: Sequence[str],
                 stats: SourceStats) -> Records:
    """The records of a source, as a random-access sequence of dicts.

    Files read whole (.jsonl, .json, .txt, and .parquet/.arrow beside them) are checked now
    with `problem` (record -> why it is unusable, or None): the usable records are returned,
    the others counted once. Arrow-backed datasets are checked as they are read
    (`CheckedAsRead`); now only that they hold records and one of `columns`.
    """
    ds = _arrow_dataset(path)
    if ds is not None:
        if len(ds) == 0:
            raise DataError(f"{path} is empty")
        if not set(columns) & set(ds.column_names):
            raise DataError(f"{path} has no column {' or '.join(map(repr, columns))} (its "
                            f"columns: {', '.join(ds.column_names)}); check data.text_field "
                            "and data.source")
        return CheckedAsRead(ds, problem, stats, path)
    records: list = []
    for file in resolve_files(path):
        records.extend(_usable(file, _file_entries(file, text_field), problem, stats))
    return records


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
    """Plain documents: BOS + text + EOS, every token a target."""

    def __init__(self, records: Records, text_field: str, tokenizer):
        self.records, self.field, self.tokenizer = records, text_field, tokenizer

    def document(self, record) -> tuple[np.ndarray, np.ndarray]:
        tok = self.tokenizer
        ids = [tok.bos_id] * tok.add_bos + tok.encode(record[self.field]) + [tok.eos_id]
        tokens = np.asarray(ids, np.int32)
        loss = np.ones(len(ids), np.int8)
        loss[0] = 0  # the document's first token (BOS): nothing predicts it
        return tokens, loss


class ChatDocuments(_RecordDocuments):
    """ShareGPT conversations rendered with a chat template; loss on assistant tokens."""

    def __init__(self, records: Records, tokenizer, template: str):
        self.records, self.tokenizer = records, tokenizer
        self.template = TEMPLATES[template]
        check_template(self.template, tokenizer)  # its special tokens exist, or a ConfigError

    def document(self, record) -> tuple[np.ndarray, np.ndarray]:
        tokens, flags = render(conversation_turns(record), self.tokenizer, self.template)
        return tokens, flags.astype(np.int8)


class TokenizedDocuments:
    """Documents pre-tokenised by `lclm.data.prepare`: memory-mapped, read without copies.
    Opening checks the files' sizes and document offsets against each other (a truncated or
    mismatched directory fails here, not in the middle of training)."""

    def __init__(self, directory: str):
        meta_path = os.path.join(directory, TOKENIZED_META)
        if not os.path.isfile(meta_path):
            raise FileNotFoundError(f"{directory!r} is not a pre-tokenised directory (no "
                                    f"{TOKENIZED_META}); write one with python -m "
                                    "lclm.data.prepare")
        try:
            with open(meta_path) as f:
                self.meta = json.load(f)
            n_tokens, n_docs = int(self.meta["tokens"]), int(self.meta["documents"])
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{meta_path} is not a valid {TOKENIZED_META} ({e!r}); write the "
                            "directory again with python -m lclm.data.prepare") from None
        if n_docs == 0:
            raise DataError(f"{directory} holds no documents")
        paths = {name: os.path.join(directory, name)
                 for name in ("tokens.bin", "loss.bin", "offsets.bin")}
        want = {"tokens.bin": 4 * n_tokens, "loss.bin": n_tokens, "offsets.bin": 8 * (n_docs + 1)}
        for name, size in want.items():
            have = os.path.getsize(paths[name]) if os.path.isfile(paths[name]) else None
            if have != size:
                raise DataError(f"{paths[name]} has {have} bytes where {TOKENIZED_META} "
                                f"({n_docs} documents, {n_tokens} tokens) needs {size}; write "
                                "the directory again with python -m lclm.data.prepare")
        self.offsets = np.fromfile(paths["offsets.bin"], np.int64)
        if self.offsets[0] != 0 or self.offsets[-1] != n_tokens or (
                np.diff(self.offsets) <= 0).any():
            raise DataError(f"{paths['offsets.bin']} is not a list of increasing document "
                            f"boundaries from 0 to {n_tokens}; write the directory again "
                            "with python -m lclm.data.prepare")
        self.tokens = np.memmap(paths["tokens.bin"], np.uint32, "r", shape=(n_tokens,))
        self.loss = np.memmap(paths["loss.bin"], np.int8, "r", shape=(n_tokens,))

    @property
    def vocab_size(self) -> int:
        return self.meta["vocab_size"]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int):
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.tokens[a:b].astype(np.int32), np.asarray(self.loss[a:b])


def is_tokenized_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, TOKENIZED_META))


def open_documents(kind: str, path: str, tokenizer, *, text_field: str = "text",
                   chat_template: str = "vicuna", stats: SourceStats | None = None):
    """A random-access document set of source `kind` ('text', 'sharegpt', 'tokenized' or
    'line_retrieval', whose `path` is its options: see `lclm.data.line_retrieval.Spec`).

    A source that cannot give a single document fails here with a `DataError` (or
    `FileNotFoundError`) naming it; single malformed records are left out and counted in
    `stats`, once.
    """
    stats = SourceStats() if stats is None else stats
    if kind == "line_retrieval":  # synthetic documents made on the fly; `path` holds options
        return line_retrieval.open_source(path, tokenizer)
    if kind == "tokenized" or (os.path.isdir(path) and is_tokenized_dir(path)):
        docs = TokenizedDocuments(path)
        if docs.vocab_size > tokenizer.vocab_size:
            raise DataError(f"{path!r} was tokenised with {docs.vocab_size} pieces but the "
                            f"tokenizer has {tokenizer.vocab_size}; re-run lclm.data.prepare")
        return docs
    if kind == "text":
        records = read_records(path, text_field, lambda r: text_problem(r, text_field),
                               (text_field,), stats)
        return TextDocuments(records, text_field, tokenizer)
    if kind == "sharegpt":
        if chat_template not in TEMPLATES:
            raise ValueError(f"unknown chat template {chat_template!r}; use one of "
                             f"{sorted(TEMPLATES)}")
        records = read_records(path, text_field, chat_problem, ("conversations", "messages"),
                               stats)
        return ChatDocuments(records, tokenizer, chat_template)
    raise ValueError(f"unknown data source {kind!r}; use text, sharegpt or tokenized")

"""Data sources: raw records from local files or `datasets`, and documents made from them.

Record formats: .jsonl / .json (read tolerantly line by line: one bad line is skipped, not
the file), .txt (documents separated by blank lines), .parquet / .arrow files and saved
`datasets` directories (through `datasets`, memory-mapped), `hub:NAME` (a named hub dataset,
only where a hub is reachable), and pre-tokenised directories written by
`python -m lclm.data.prepare`. Nothing loaded is unpickled or executed.

A document is `(tokens int32 [n], loss int8 [n])`, where `loss[i]` says whether token i is
a training target (predicting it is learned). Malformed records (bad JSON, missing or
non-string fields, empty text, bad UTF-8, conversations without an assistant reply) are
skipped and counted in `SourceStats`.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Sequence

import numpy as np

from lclm.data.chat import TEMPLATES, conversation_turns, render

TOKENIZED_META = "lclm_tokens.json"


@dataclasses.dataclass
class SourceStats:
    documents: int = 0
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
    if os.path.isdir(path):
        files = sorted(f for ext in ("jsonl", "json", "txt", "parquet", "arrow")
                       for f in glob.glob(os.path.join(path, f"*.{ext}")))
    else:
        files = sorted(glob.glob(path))
    if not files:
        raise FileNotFoundError(f"no data files at {path!r}; point config.data.path at a "
                                ".jsonl/.json/.txt/.parquet/.arrow file, a directory or a glob")
    return files


def _json_records(file: str, stats: SourceStats) -> list:
    """Records of a .json (a list) or .jsonl file; a bad line costs only that line."""
    with open(file, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
        stats.skip(file, "invalid UTF-8 (undecodable bytes replaced)")
    if file.endswith(".json"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            # not a JSON document: try it as JSON lines before giving up on it
            if "\n" not in text.strip():
                stats.skip(file, f"bad JSON ({e.msg})")
                return []
        else:
            if isinstance(data, list):
                return data
            stats.skip(file, "a .json file must hold a list of records")
            return []
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            stats.skip(f"{file}:{n}", f"bad JSON ({e.msg})")
    return records


def read_records(path: str, text_field: str, stats: SourceStats) -> Sequence:
    """All records of a source, as a random-access sequence of dicts."""
    if path.startswith("hub:"):
        import datasets
        return datasets.load_dataset(path[4:], split="train")
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "dataset_info.json")):
        import datasets
        ds = datasets.load_from_disk(path)
        return ds["train"] if isinstance(ds, datasets.DatasetDict) else ds
    files = resolve_files(path)
    columnar = [f for f in files if f.endswith((".parquet", ".arrow"))]
    if columnar and len(columnar) == len(files):
        # memory-mapped Arrow tables with random access: nothing is read into Python lists
        import datasets
        kind = "parquet" if columnar[0].endswith(".parquet") else "arrow"
        return datasets.load_dataset(kind, data_files=columnar, split="train")
    records: list = []
    for file in files:
        if file.endswith((".jsonl", ".json")):
            records.extend(_json_records(file, stats))
        elif file.endswith(".txt"):
            with open(file, "rb") as f:
                text = f.read().decode("utf-8", errors="replace")
            records.extend({text_field: d} for d in text.split("\n\n"))
        else:
            import datasets
            kind = "parquet" if file.endswith(".parquet") else "arrow"
            records.extend(datasets.load_dataset(kind, data_files=file, split="train"))
    return records


class TextDocuments:
    """Plain documents: BOS + text + EOS, every token a target."""

    def __init__(self, records: Sequence, text_field: str, tokenizer, stats: SourceStats):
        self.records, self.field, self.tokenizer, self.stats = records, text_field, tokenizer, stats

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int):
        record = self.records[i]
        text = record.get(self.field) if isinstance(record, dict) else None
        if not isinstance(text, str) or not text.strip():
            self.stats.skip(f"record {i}", f"no non-empty string field {self.field!r}")
            return None
        ids = [self.tokenizer.bos_id] + self.tokenizer.encode(text) + [self.tokenizer.eos_id]
        tokens = np.asarray(ids, np.int32)
        loss = np.ones(len(ids), np.int8)
        loss[0] = 0  # BOS starts a document: nothing predicts it
        return tokens, loss


class ChatDocuments:
    """ShareGPT conversations rendered with a chat template; loss on assistant tokens."""

    def __init__(self, records: Sequence, tokenizer, template: str, stats: SourceStats):
        if template not in TEMPLATES:
            raise ValueError(f"unknown chat template {template!r}; use one of {sorted(TEMPLATES)}")
        self.records, self.tokenizer, self.stats = records, tokenizer, stats
        self.template = TEMPLATES[template]

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int):
        turns = conversation_turns(self.records[i])
        if turns is None:
            self.stats.skip(f"record {i}", "not a conversation with an assistant reply")
            return None
        tokens, flags = render(turns, self.tokenizer, self.template)
        return tokens, flags.astype(np.int8)


class TokenizedDocuments:
    """Documents pre-tokenised by `lclm.data.prepare`: memory-mapped, read without copies."""

    def __init__(self, directory: str):
        meta_path = os.path.join(directory, TOKENIZED_META)
        if not os.path.isfile(meta_path):
            raise FileNotFoundError(f"{directory!r} is not a pre-tokenised directory (no "
                                    f"{TOKENIZED_META}); write one with python -m lclm.data.prepare")
        with open(meta_path) as f:
            self.meta = json.load(f)
        n_tokens = self.meta["tokens"]
        self.tokens = np.memmap(os.path.join(directory, "tokens.bin"), np.uint32, "r",
                                shape=(n_tokens,)) if n_tokens else np.zeros(0, np.uint32)
        self.loss = np.memmap(os.path.join(directory, "loss.bin"), np.int8, "r",
                              shape=(n_tokens,)) if n_tokens else np.zeros(0, np.int8)
        self.offsets = np.fromfile(os.path.join(directory, "offsets.bin"), np.int64)

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
    'line_retrieval', whose `path` is its options: see `lclm.data.line_retrieval.Spec`)."""
    stats = SourceStats() if stats is None else stats
    if kind == "line_retrieval":  # synthetic documents made on the fly; `path` holds options
        from lclm.data.line_retrieval import open_source
        return open_source(path, tokenizer)
    if kind == "tokenized" or (os.path.isdir(path) and is_tokenized_dir(path)):
        docs = TokenizedDocuments(path)
        if docs.vocab_size > tokenizer.vocab_size:
            raise ValueError(f"{path!r} was tokenised with {docs.vocab_size} pieces but the "
                             f"tokenizer has {tokenizer.vocab_size}; re-run lclm.data.prepare")
        return docs
    records = read_records(path, text_field, stats)
    if kind == "text":
        docs = TextDocuments(records, text_field, tokenizer, stats)
    elif kind == "sharegpt":
        docs = ChatDocuments(records, tokenizer, chat_template, stats)
    else:
        raise ValueError(f"unknown data source {kind!r}; use text, sharegpt or tokenized")
    if len(docs) == 0:
        raise ValueError(f"data source {path!r} holds no records ({stats.summary()})")
    return docs

"""Document sources: local text corpora (jsonl / json / txt), read tolerantly.

A malformed record (bad JSON, missing or non-string field, empty text, bad UTF-8) is
skipped and counted in `SourceStats`, never fatal.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Iterator


@dataclasses.dataclass
class SourceStats:
    documents: int = 0
    skipped: int = 0
    examples: list = dataclasses.field(default_factory=list)

    def skip(self, where: str, why: str) -> None:
        self.skipped += 1
        if len(self.examples) < 5:
            self.examples.append(f"{where}: {why}")


def resolve_files(path: str) -> list[str]:
    """Files named by a path, a directory or a glob; a clear error when there are none."""
    if os.path.isdir(path):
        files = sorted(f for ext in ("jsonl", "json", "txt")
                       for f in glob.glob(os.path.join(path, f"*.{ext}")))
    else:
        files = sorted(glob.glob(path))
    if not files:
        raise FileNotFoundError(f"no data files at config.data.path={path!r}; point it at a "
                                ".jsonl/.json/.txt file, a directory or a glob")
    return files


def read_documents(path: str, text_field: str = "text",
                   stats: SourceStats | None = None) -> Iterator[str]:
    """Yield document texts from every file at `path`.

    .jsonl: one JSON object per line with `text_field`; .json: a list of such objects;
    .txt: documents separated by blank lines.
    """
    stats = SourceStats() if stats is None else stats
    for file in resolve_files(path):
        with open(file, "rb") as f:
            raw = f.read()
        text = raw.decode("utf-8", errors="replace")
        if file.endswith(".txt"):
            records = [(f"{file}", {text_field: d}) for d in text.split("\n\n")]
        elif file.endswith(".json"):
            try:
                data = json.loads(text)
                records = [(f"{file}[{i}]", r) for i, r in enumerate(data)]
            except (json.JSONDecodeError, TypeError) as e:
                stats.skip(file, f"not a JSON list ({e})")
                continue
        else:
            records = []
            for n, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    records.append((f"{file}:{n}", json.loads(line)))
                except json.JSONDecodeError as e:
                    stats.skip(f"{file}:{n}", f"bad JSON ({e.msg})")
        for where, record in records:
            value = record.get(text_field) if isinstance(record, dict) else None
            if not isinstance(value, str) or not value.strip():
                stats.skip(where, f"no non-empty string field {text_field!r}")
                continue
            stats.documents += 1
            yield value

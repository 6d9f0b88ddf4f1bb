"""Records of data sources: raw records read from local or object-store files or `datasets`.

Record formats: .jsonl / .json (read tolerantly line by line: one bad line is skipped, not
the file), .txt (documents separated by blank lines), .parquet / .arrow files (read in
place with pyarrow: no copy, no `datasets` cache), saved `datasets` directories (through
`datasets`, memory-mapped) and `hub:NAME` (a named hub dataset, only where a hub is
reachable). Nothing loaded is unpickled or executed. Every path may be local or on gs:// or
s3:// (through lclm.storage): there files read whole are downloaded, parquet files are read
in ranges as records are drawn, and Arrow files (which cannot be mapped) are held in memory.

Malformed records (bad JSON, missing or non-string fields, empty text, bad UTF-8 - per line
or record, not per file -, conversations without an assistant reply) are skipped and counted
once in `SourceStats`: records of files read whole are all checked when the source is
opened, column-stored ones (parquet, Arrow, `datasets`) as they are first read. A source
without a single usable record (empty, binary, another format, the wrong field) fails when
it is opened (`DataError`). The kinds that make documents of records: `lclm.data.documents`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import glob
import json
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from lclm import storage
from lclm.data.chat import conversation_turns
from lclm.data.stats import SourceStats
from lclm.errors import StartupError

log = logging.getLogger(__name__)


class DataError(StartupError):
    """A data source that cannot be trained on (entirely malformed, empty, too small for its
    readers); the message is one line that names the file or source."""


DATA_EXTENSIONS = ("jsonl", "json", "txt", "parquet", "arrow")


def resolve_files(path: str) -> list[str]:
    """Files named by a path, a directory (an object-store prefix) or a glob; a clear error
    when there are none."""
    files = _remote_files(path) if storage.is_remote(path) else _local_files(path)
    if not files:
        raise FileNotFoundError(
            f"no data files at {path!r}; point config.data.path at a "
            ".jsonl/.json/.txt/.parquet/.arrow file, a directory or a glob"
        )
    return files


def _local_files(path: str) -> list[str]:
    if os.path.isfile(path):  # a name with glob characters ('[') is still itself
        return [path]
    if os.path.isdir(path):
        return sorted(
            f
            for ext in DATA_EXTENSIONS
            for f in glob.glob(os.path.join(glob.escape(path), f"*.{ext}"))
        )
    return sorted(glob.glob(path))


def _remote_files(path: str) -> list[str]:
    """As `_local_files`, for gs:// and s3:// paths; full URLs (the client's listings drop
    the scheme)."""
    fs, p = storage.filesystem(path)
    fs.invalidate_cache()  # objects written since this process last listed them
    if fs.isfile(p):
        return [path]
    if fs.isdir(p):
        found = [f for f in fs.ls(p, detail=False) if f.rsplit(".", 1)[-1] in DATA_EXTENSIONS]
    else:
        found = fs.glob(p)
    return sorted(f"{storage.scheme(path)}://{f}" for f in found)


def names_data(path: str) -> bool:
    """Whether `path` names anything to read: a file, a directory (prefix) or a glob that
    matches; object-store paths are looked up in their bucket."""
    if not storage.is_remote(path):
        return os.path.exists(path) or bool(glob.glob(path))
    fs, p = storage.filesystem(path)
    fs.invalidate_cache()
    return fs.exists(p) or bool(fs.glob(p))


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


def _file_entries(file: str, text_field: str, columns: Sequence[str]) -> list[_Entry]:
    """Entries of one file of any format that is read whole."""
    if file.endswith(COLUMNAR):
        records = ColumnarRecords([file], columns, file)
        return [(f"{file} row {k}", records[k], None) for k in range(len(records))]
    text = storage.read_bytes(file).decode("utf-8", errors="surrogateescape")
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
        raise DataError(
            f"{file} is empty"
            if not bad
            else f"{file} holds no usable record ({bad} malformed, the first {first})"
        )
    return good


class Records(Protocol):
    """A random-access sequence of records (a list, or `CheckedAsRead`)."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int, /) -> Any: ...


class CheckedAsRead:
    """Column-stored records (possibly larger than memory, so not all checked at start): a
    malformed record reads as None and is counted the first time it is read; reading raises
    `DataError` once every record has been found malformed."""

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
                raise DataError(
                    f"{self.name}: every one of its {len(self.records)} records "
                    f"is malformed (e.g. row {i}: {why})"
                )
        return None


COLUMNAR = (".parquet", ".arrow")
# Decoded parquet row groups kept per source. Documents are read in shuffled order, so once a
# source's row groups outgrow this, reading a document mostly means decoding its row group.
PARQUET_CACHE_BYTES = 1 << 30


def _check_columns(name: str, have: Sequence[str], columns: Sequence[str]) -> list[str]:
    """Those of `columns` that `name` has; a `DataError` when it has none of them."""
    found = [c for c in columns if c in have]
    if not found:
        raise DataError(
            f"{name} has no column {' or '.join(map(repr, columns))} (its columns: "
            f"{', '.join(have)}); check data.text_field and data.source"
        )
    return found


@dataclasses.dataclass(frozen=True)
class _RowGroup:
    """One row group of a parquet file, decoded (only `columns`) when read."""

    file: str
    index: int
    num_rows: int
    columns: tuple[str, ...]

    def read(self):
        with _parquet_file(self.file) as f:
            return f.read_row_group(self.index, columns=list(self.columns))


@contextlib.contextmanager
def _parquet_file(file: str):
    """A `pq.ParquetFile`; one on object storage reads only its footer and the column chunks
    asked for (ranged reads), not the whole object."""
    if not storage.is_remote(file):
        with pq.ParquetFile(file) as f:
            yield f
        return
    with storage.open_file(file) as source, pq.ParquetFile(source) as f:
        yield f


def _row_groups(file: str, columns: Sequence[str]) -> list[_RowGroup]:
    try:
        with _parquet_file(file) as f:
            meta, names = f.metadata, f.schema_arrow.names
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{file} is not a readable parquet file ({e})") from None
    found = tuple(_check_columns(file, names, columns))
    return [
        _RowGroup(file, k, meta.row_group(k).num_rows, found) for k in range(meta.num_row_groups)
    ]


def _record_batches(file: str, columns: Sequence[str]) -> list:
    """The record batches of an Arrow IPC file (the random-access format, or the stream
    format that `datasets` saves), memory-mapped: nothing is copied or decoded. One on
    object storage cannot be mapped: it is read into memory whole."""
    try:
        with _arrow_source(file) as source:
            try:
                reader = pa.ipc.open_file(source)
                batches = [reader.get_batch(k) for k in range(reader.num_record_batches)]
            except pa.ArrowInvalid:
                source.seek(0)
                reader = pa.ipc.open_stream(source)
                batches = list(reader)
            names = reader.schema.names
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{file} is not a readable Arrow file ({e})") from None
    found = _check_columns(file, names, columns)
    return [b.select(found) for b in batches]


def _arrow_source(file: str):
    if not storage.is_remote(file):
        return pa.memory_map(file)
    return pa.BufferReader(storage.read_bytes(file))


class ColumnarRecords:
    """The records (dicts of the columns a source reads) of .parquet and .arrow files, read
    where they lie with pyarrow: no copy and no `datasets` cache. Arrow files are
    memory-mapped; parquet row groups are decoded when first read and the most recently read
    are kept, up to PARQUET_CACHE_BYTES (a source whose row groups do not fit is read
    quickly only in file order, as `lclm.data.prepare` reads: one warning says so)."""

    def __init__(self, files: Sequence[str], columns: Sequence[str], name: str):
        self.blocks: list = []  # pyarrow record batches and _RowGroups, in file order
        for file in files:
            self.blocks += (
                _row_groups(file, columns)
                if file.endswith(".parquet")
                else _record_batches(file, columns)
            )
        self.starts = np.cumsum([0] + [b.num_rows for b in self.blocks])
        self.name = name
        self._decoded: collections.OrderedDict[int, Any] = collections.OrderedDict()
        self._decoded_bytes = 0
        self._ever_decoded: set[int] = set()
        self._warned = False
        # the loader's thread and its statistics (lclm.data.filters) may read at once
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < len(self):
            raise IndexError(f"record {i} of {self.name}, which has {len(self)}")
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        return self._block(k).slice(i - int(self.starts[k]), 1).to_pylist()[0]

    def _block(self, k: int):
        block = self.blocks[k]
        if not isinstance(block, _RowGroup):
            return block
        with self._lock:
            table = self._decoded.pop(k, None)
            if table is None:
                table = self._decode(k, block)
            self._decoded[k] = table
            while self._decoded_bytes > PARQUET_CACHE_BYTES and len(self._decoded) > 1:
                self._decoded_bytes -= self._decoded.popitem(last=False)[1].nbytes
            return table

    def _decode(self, k: int, group: _RowGroup):
        if k in self._ever_decoded and not self._warned:
            self._warned = True
            log.warning(
                "%s: its decoded row groups outgrow the %d MiB cache, so shuffled "
                "reading decodes a row group for most documents (slow); pre-tokenise "
                "it with python -m lclm.data.prepare",
                self.name,
                PARQUET_CACHE_BYTES >> 20,
            )
        self._ever_decoded.add(k)
        table = group.read()
        self._decoded_bytes += table.nbytes
        return table


def _columnar(path: str, columns: Sequence[str]):
    """The column-stored records that `path` names: a hub dataset or a saved `datasets`
    directory (through `datasets`, memory-mapped), or .parquet and .arrow files only
    (`ColumnarRecords`); else None."""
    saved = storage.isfile(storage.join(path, "dataset_info.json"))
    if not (saved or path.startswith("hub:")):
        files = resolve_files(path)
        return (
            ColumnarRecords(files, columns, path)
            if all(f.endswith(COLUMNAR) for f in files)
            else None
        )
    import datasets

    ds = (
        datasets.load_dataset(path[4:], split="train")
        if path.startswith("hub:")
        else datasets.load_from_disk(path)
    )
    _check_columns(path, ds.column_names, columns)
    return ds


def read_records(
    path: str, text_field: str, problem, columns: Sequence[str], stats: SourceStats
) -> Records:
    """The records of a source, as a random-access sequence of dicts.

    Files read whole (.jsonl, .json, .txt, and .parquet/.arrow beside them) are checked now
    with `problem` (record -> why it is unusable, or None): the usable records are returned,
    the others counted once. Column-stored sources (only .parquet/.arrow files, saved
    `datasets` directories, hub datasets) are checked as they are read
    (`CheckedAsRead`); now only that they hold records and one of `columns`.
    """
    records = _columnar(path, columns)
    if records is not None:
        if len(records) == 0:
            raise DataError(f"{path} is empty")
        return CheckedAsRead(records, problem, stats, path)
    usable: list = []
    for file in resolve_files(path):
        usable.extend(_usable(file, _file_entries(file, text_field, columns), problem, stats))
    return usable

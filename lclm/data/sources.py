"""Data sources: raw records from local files or `datasets`, and documents made from them.

Record formats: .jsonl / .json (read tolerantly line by line: one bad line is skipped, not
the file), .txt (documents separated by blank lines), .parquet / .arrow files (read in
place with pyarrow: no copy, no `datasets` cache), saved `datasets` directories (through
`datasets`, memory-mapped), `hub:NAME` (a named hub dataset, only where a hub is reachable),
pre-tokenised directories written by `python -m lclm.data.prepare`, and directories of code
packages (`lclm.data.code`: one document per package). Nothing loaded is
unpickled or executed. Every path may be local or on gs:// or s3:// (through lclm.storage):
there files read whole are downloaded, parquet files and pre-tokenised directories are read
in ranges as documents are drawn, and Arrow files (which cannot be mapped) are held in memory.

A document is `(tokens int32 [n], loss int8 [n])`, where `loss[i]` says whether token i is
a training target (predicting it is learned); document i of a source is always the same.
Malformed records (bad JSON, missing or non-string fields, empty text, bad UTF-8 - per line
or record, not per file -, conversations without an assistant reply) are skipped and counted
once in `SourceStats`: records of files read whole are all checked when the source is
opened, column-stored ones (parquet, Arrow, `datasets`) as they are first read. A source
without a single usable record (empty, binary, another format, the wrong field) fails when
it is opened (`DataError`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import glob
import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from lclm import storage
from lclm.config.schema import SOURCE_KINDS
from lclm.data import code, line_retrieval, ruler
from lclm.data.chat import ChatTemplate, conversation_turns, get_template
from lclm.data.model_chat import TemplateRefused
from lclm.data.stats import SourceStats
from lclm.errors import StartupError

TOKENIZED_META = "lclm_tokens.json"
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
        raise FileNotFoundError(f"no data files at {path!r}; point config.data.path at a "
                                ".jsonl/.json/.txt/.parquet/.arrow file, a directory or a glob")
    return files


def _local_files(path: str) -> list[str]:
    if os.path.isfile(path):   # a name with glob characters ('[') is still itself
        return [path]
    if os.path.isdir(path):
        return sorted(f for ext in DATA_EXTENSIONS
                      for f in glob.glob(os.path.join(glob.escape(path), f"*.{ext}")))
    return sorted(glob.glob(path))


def _remote_files(path: str) -> list[str]:
    """As `_local_files`, for gs:// and s3:// paths; full URLs (the client's listings drop
    the scheme)."""
    fs, p = storage.filesystem(path)
    fs.invalidate_cache()   # objects written since this process last listed them
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
        raise DataError(f"{file} is empty" if not bad else
                        f"{file} holds no usable record ({bad} malformed, the first {first})")
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
                raise DataError(f"{self.name}: every one of its {len(self.records)} records "
                                f"is malformed (e.g. row {i}: {why})")
        return None


COLUMNAR = (".parquet", ".arrow")
# Decoded parquet row groups kept per source. Documents are read in shuffled order, so once a
# source's row groups outgrow this, reading a document mostly means decoding its row group.
PARQUET_CACHE_BYTES = 1 << 30


def _check_columns(name: str, have: Sequence[str], columns: Sequence[str]) -> list[str]:
    """Those of `columns` that `name` has; a `DataError` when it has none of them."""
    found = [c for c in columns if c in have]
    if not found:
        raise DataError(f"{name} has no column {' or '.join(map(repr, columns))} (its columns: "
                        f"{', '.join(have)}); check data.text_field and data.source")
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
    return [_RowGroup(file, k, meta.row_group(k).num_rows, found)
            for k in range(meta.num_row_groups)]


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
            self.blocks += (_row_groups(file, columns) if file.endswith(".parquet")
                            else _record_batches(file, columns))
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
            log.warning("%s: its decoded row groups outgrow the %d MiB cache, so shuffled "
                        "reading decodes a row group for most documents (slow); pre-tokenise "
                        "it with python -m lclm.data.prepare", self.name,
                        PARQUET_CACHE_BYTES >> 20)
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
        return (ColumnarRecords(files, columns, path)
                if all(f.endswith(COLUMNAR) for f in files) else None)
    import datasets
    ds = (datasets.load_dataset(path[4:], split="train") if path.startswith("hub:")
          else datasets.load_from_disk(path))
    _check_columns(path, ds.column_names, columns)
    return ds


def read_records(path: str, text_field: str, problem, columns: Sequence[str],
                 stats: SourceStats) -> Records:
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

    def __init__(self, records: Records, tokenizer, template):
        self.records, self.tokenizer, self.template = records, tokenizer, template

    def document(self, record) -> tuple[np.ndarray, np.ndarray]:
        tokens, flags = self.template.render(conversation_turns(record), self.tokenizer)
        return tokens, flags.astype(np.int8)


def offsets_digest(offsets: np.ndarray) -> str:
    """The fingerprint of a pre-tokenised directory's document offsets kept in its metadata."""
    return hashlib.sha256(np.ascontiguousarray(offsets, np.int64).tobytes()).hexdigest()


_REWRITE = "write the directory again with python -m lclm.data.prepare"


def _check_size(path: str, have: int, size: int, expected: str) -> None:
    if have != size:
        raise DataError(f"{path} has {have} bytes where {expected} needs {size}; "
                        f"{_REWRITE}")


def _open_sized(path: str, size: int, expected: str):
    """`path` opened for reading, with the `size` bytes that `expected` says it holds."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise DataError(f"{path} is missing; {_REWRITE}") from None
    try:
        _check_size(path, os.fstat(f.fileno()).st_size, size, expected)
    except DataError:
        f.close()
        raise
    return f


class RangedArray:
    """A read-only 1-D array `[n]` of `dtype` stored in an object: `a[i:j]` fetches only
    those bytes with one ranged request, so each host reads only the documents its rows
    draw, never whole token files. Opening checks that the object holds `n` items."""

    def __init__(self, path: str, dtype, n: int, expected: str):
        self.fs, self.key = storage.filesystem(path)
        self.dtype, self.n = np.dtype(dtype), n
        self.fs.invalidate_cache(self.key)   # a listing made before it was written again
        try:
            have = self.fs.size(self.key)
        except FileNotFoundError:
            raise DataError(f"{path} is missing; {_REWRITE}") from None
        _check_size(path, have, n * self.dtype.itemsize, expected)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: slice) -> np.ndarray:
        start, stop, step = index.indices(self.n)
        if step != 1:
            raise IndexError("a RangedArray reads contiguous slices only")
        if stop <= start:
            return np.empty(0, self.dtype)
        size = self.dtype.itemsize
        # by keyword: s3fs's second parameter is an object version
        data = self.fs.cat_file(self.key, start=start * size, end=stop * size)
        return np.frombuffer(data, self.dtype)


def ranged_slices(arrays: list[RangedArray], start: int, stop: int) -> list[np.ndarray]:
    """`[a[start:stop] for a in arrays]` (arrays of one filesystem) with concurrent ranged
    requests: one round trip to the store, not one per array."""
    fs = arrays[0].fs
    data = fs.cat_ranges([a.key for a in arrays], [start * a.dtype.itemsize for a in arrays],
                         [stop * a.dtype.itemsize for a in arrays])
    return [np.frombuffer(d, a.dtype) for d, a in zip(data, arrays)]


class TokenizedDocuments:
    """Documents pre-tokenised by `lclm.data.prepare`: memory-mapped, read without copies.
    Opening checks the files' sizes and document offsets against each other and the metadata
    (a truncated or mismatched directory fails here, not in the middle of training). What was
    opened stays readable when the directory is prepared again: prepare renames new files
    into place, and the maps hold the old ones.

    On object storage (gs://, s3://) the offsets are read whole (8 bytes a document) and
    tokens and loss flags document by document with ranged reads (`RangedArray`). Objects
    are replaced in place there, so prepare into a new prefix rather than the one a run
    reads."""

    tokens: np.ndarray | RangedArray
    loss: np.ndarray | RangedArray

    def __init__(self, directory: str):
        meta_path = storage.join(directory, TOKENIZED_META)
        if not storage.isfile(meta_path):
            raise FileNotFoundError(f"{directory!r} is not a pre-tokenised directory (no "
                                    f"{TOKENIZED_META}); write one with python -m "
                                    "lclm.data.prepare")
        try:
            self.meta = json.loads(storage.read_bytes(meta_path))
            n_tokens, n_docs = int(self.meta["tokens"]), int(self.meta["documents"])
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{meta_path} is not a valid {TOKENIZED_META} ({e!r}); "
                            f"{_REWRITE}") from None
        if n_docs == 0:
            raise DataError(f"{directory} holds no documents")
        expected = f"{TOKENIZED_META} ({n_docs} documents, {n_tokens} tokens)"
        paths = {name: storage.join(directory, name)
                 for name in ("tokens.bin", "loss.bin", "offsets.bin")}
        if storage.is_remote(directory):
            self._open_objects(paths, n_tokens, n_docs, expected)
        else:
            self._map_files(paths, n_tokens, n_docs, expected)
        self._check_offsets(paths["offsets.bin"], n_tokens)

    def _map_files(self, paths: dict, n_tokens: int, n_docs: int, expected: str) -> None:
        # offsets.bin opened last: prepare renames it first, so that a directory prepared
        # again while this opens it shows in offsets that disagree with the metadata
        with _open_sized(paths["tokens.bin"], 4 * n_tokens, expected) as tokens, \
                _open_sized(paths["loss.bin"], n_tokens, expected) as loss, \
                _open_sized(paths["offsets.bin"], 8 * (n_docs + 1), expected) as offsets:
            self.offsets = np.fromfile(offsets, np.int64)
            self.tokens = np.memmap(tokens, np.uint32, "r", shape=(n_tokens,))
            self.loss = np.memmap(loss, np.int8, "r", shape=(n_tokens,))

    def _open_objects(self, paths: dict, n_tokens: int, n_docs: int, expected: str) -> None:
        # offsets.bin read last, for the reason given in `_map_files`: prepare uploads it
        # first and the metadata last
        self.tokens = RangedArray(paths["tokens.bin"], np.uint32, n_tokens, expected)
        self.loss = RangedArray(paths["loss.bin"], np.int8, n_tokens, expected)
        offsets = RangedArray(paths["offsets.bin"], np.int64, n_docs + 1, expected)
        self.offsets = offsets[0:n_docs + 1]

    def _check_offsets(self, path: str, n_tokens: int) -> None:
        if self.offsets[0] != 0 or self.offsets[-1] != n_tokens or (
                np.diff(self.offsets) <= 0).any():
            raise DataError(f"{path} is not a list of increasing document boundaries from 0 "
                            f"to {n_tokens}; {_REWRITE}")
        digest = self.meta.get("offsets_sha256")  # absent from directories of older versions
        if digest is not None and digest != offsets_digest(self.offsets):
            raise DataError(f"{path} is not the one its {TOKENIZED_META} describes: the "
                            "directory was being prepared again (open it again), or such a "
                            f"prepare was killed ({_REWRITE})")

    @property
    def vocab_size(self) -> int:
        return self.meta["vocab_size"]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int):
        a, b = self.offsets[i], self.offsets[i + 1]
        if isinstance(self.tokens, RangedArray) and isinstance(self.loss, RangedArray):
            tokens, loss = ranged_slices([self.tokens, self.loss], a, b)
            return tokens.astype(np.int32), loss
        return self.tokens[a:b].astype(np.int32), np.asarray(self.loss[a:b])


def _refused(template, record) -> str | None:
    """Why the tokenizer's own chat template cannot render `record` (None: it can)."""
    try:
        template.text_and_replies(conversation_turns(record))
    except TemplateRefused as e:
        return str(e)
    return None


def is_tokenized_dir(path: str) -> bool:
    return storage.isfile(storage.join(path, TOKENIZED_META))


def open_documents(kind: str, path: str, tokenizer, *, text_field: str = "text",
                   chat_template: str = "vicuna", stats: SourceStats | None = None):
    """A random-access document set of source `kind` (one of SOURCE_KINDS: 'text',
    'sharegpt', 'tokenized', 'code' and 'code-heldout', whose `path` is a directory of
    packages: see `lclm.data.code`, or 'line_retrieval' and 'ruler', whose `path` is their
    options: see `lclm.data.line_retrieval.Spec`, `lclm.data.ruler.Spec`).

    A source that cannot give a single document fails here with a `DataError` (or
    `FileNotFoundError`) naming it; single malformed records are left out and counted in
    `stats`, once.
    """
    stats = SourceStats() if stats is None else stats
    if kind == "line_retrieval":  # synthetic documents made on the fly; `path` holds options
        return line_retrieval.open_source(path, tokenizer)
    if kind == ruler.KIND:
        return ruler.open_source(path, tokenizer)
    if kind in code.CODE_KINDS:
        packages = code.CodeRecords(path, kind == "code-heldout", stats)
        if not len(packages):
            split = "held-out " if kind == "code-heldout" else ""
            raise DataError(f"{kind}:{path} holds no {split}package with "
                            f"{'/'.join(code.EXTENSIONS)} files")
        return TextDocuments(packages, "text", tokenizer)
    if kind == "tokenized" or is_tokenized_dir(path):
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
        template = get_template(chat_template, tokenizer)
        template.check(tokenizer)   # its special tokens exist, or a ConfigError
        problem: Callable[[object], str | None] = chat_problem
        if not isinstance(template, ChatTemplate):   # the tokenizer's own may refuse some
            problem = lambda r: chat_problem(r) or _refused(template, r)
        records = read_records(path, text_field, problem, ("conversations", "messages"),
                               stats)
        return ChatDocuments(records, tokenizer, template)
    raise ValueError(f"unknown data source {kind!r}; use one of {', '.join(SOURCE_KINDS)}")

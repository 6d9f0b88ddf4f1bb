"""Prepared data: directories pre-tokenised by `python -m lclm.data.prepare`, the
`tokenized` kind.

A prepared directory holds tokens.bin (uint32), loss.bin (int8: the token is a training
target), offsets.bin (int64 document boundaries) and `TOKENIZED_META` (counts, tokenizer,
the offsets' digest). Local directories are memory-mapped; on gs:// and s3:// the offsets are
read whole and each document with ranged reads (`RangedArray`).
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from lclm import storage
from lclm.data.kind import FILES, Kind, Reading
from lclm.data.records import DataError

TOKENIZED_META = "lclm_tokens.json"


def offsets_digest(offsets: np.ndarray) -> str:
    """The fingerprint of a pre-tokenised directory's document offsets kept in its metadata."""
    return hashlib.sha256(np.ascontiguousarray(offsets, np.int64).tobytes()).hexdigest()


_REWRITE = "write the directory again with python -m lclm.data.prepare"


def _check_size(path: str, have: int, size: int, expected: str) -> None:
    if have != size:
        raise DataError(f"{path} has {have} bytes where {expected} needs {size}; {_REWRITE}")


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
        self.fs.invalidate_cache(self.key)  # a listing made before it was written again
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
    data = fs.cat_ranges(
        [a.key for a in arrays],
        [start * a.dtype.itemsize for a in arrays],
        [stop * a.dtype.itemsize for a in arrays],
    )
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
            raise FileNotFoundError(
                f"{directory!r} is not a pre-tokenised directory (no "
                f"{TOKENIZED_META}); write one with python -m "
                "lclm.data.prepare"
            )
        try:
            self.meta = json.loads(storage.read_bytes(meta_path))
            n_tokens, n_docs = int(self.meta["tokens"]), int(self.meta["documents"])
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(
                f"{meta_path} is not a valid {TOKENIZED_META} ({e!r}); {_REWRITE}"
            ) from None
        if n_docs == 0:
            raise DataError(f"{directory} holds no documents")
        expected = f"{TOKENIZED_META} ({n_docs} documents, {n_tokens} tokens)"
        paths = {
            name: storage.join(directory, name)
            for name in ("tokens.bin", "loss.bin", "offsets.bin")
        }
        if storage.is_remote(directory):
            self._open_objects(paths, n_tokens, n_docs, expected)
        else:
            self._map_files(paths, n_tokens, n_docs, expected)
        self._check_offsets(paths["offsets.bin"], n_tokens)

    def _map_files(self, paths: dict, n_tokens: int, n_docs: int, expected: str) -> None:
        # offsets.bin opened last: prepare renames it first, so that a directory prepared
        # again while this opens it shows in offsets that disagree with the metadata
        with (
            _open_sized(paths["tokens.bin"], 4 * n_tokens, expected) as tokens,
            _open_sized(paths["loss.bin"], n_tokens, expected) as loss,
            _open_sized(paths["offsets.bin"], 8 * (n_docs + 1), expected) as offsets,
        ):
            self.offsets = np.fromfile(offsets, np.int64)
            self.tokens = np.memmap(tokens, np.uint32, "r", shape=(n_tokens,))
            self.loss = np.memmap(loss, np.int8, "r", shape=(n_tokens,))

    def _open_objects(self, paths: dict, n_tokens: int, n_docs: int, expected: str) -> None:
        # offsets.bin read last, for the reason given in `_map_files`: prepare uploads it
        # first and the metadata last
        self.tokens = RangedArray(paths["tokens.bin"], np.uint32, n_tokens, expected)
        self.loss = RangedArray(paths["loss.bin"], np.int8, n_tokens, expected)
        offsets = RangedArray(paths["offsets.bin"], np.int64, n_docs + 1, expected)
        self.offsets = offsets[0 : n_docs + 1]

    def _check_offsets(self, path: str, n_tokens: int) -> None:
        if (
            self.offsets[0] != 0
            or self.offsets[-1] != n_tokens
            or (np.diff(self.offsets) <= 0).any()
        ):
            raise DataError(
                f"{path} is not a list of increasing document boundaries from 0 "
                f"to {n_tokens}; {_REWRITE}"
            )
        digest = self.meta.get("offsets_sha256")  # absent from directories of older versions
        if digest is not None and digest != offsets_digest(self.offsets):
            raise DataError(
                f"{path} is not the one its {TOKENIZED_META} describes: the "
                "directory was being prepared again (open it again), or such a "
                f"prepare was killed ({_REWRITE})"
            )

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


def is_tokenized_dir(path: str) -> bool:
    """Whether `path` is a directory that `python -m lclm.data.prepare` wrote."""
    return storage.isfile(storage.join(path, TOKENIZED_META))


def open_prepared(path: str, tokenizer, reading: Reading) -> TokenizedDocuments:
    """The documents of a prepared directory, which must fit the tokenizer's vocabulary."""
    docs = TokenizedDocuments(path)
    if docs.vocab_size > tokenizer.vocab_size:
        raise DataError(
            f"{path!r} was tokenised with {docs.vocab_size} pieces but the "
            f"tokenizer has {tokenizer.vocab_size}; re-run lclm.data.prepare"
        )
    return docs


KIND = Kind("tokenized", open_prepared, FILES)

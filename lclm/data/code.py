"""Code repositories as long documents: local directories read as repository-level records.

`code:DIR` reads a directory whose immediate subdirectories are packages (the standard
library, a site-packages, a folder of checked-out repositories), as ProLong and Fu et al.
build long data from code: each package is one document, its files of `EXTENSIONS` in
sorted path order, each as a header line `# <path relative to DIR>` and then its text. A
file directly in DIR (`json.py`, `LICENSE.txt`) is a short document of its own. A package of
more than `MAX_DOCUMENT_BYTES` continues in the next document, cut between files.

`code-heldout:DIR` reads only the held-out packages: those whose name hashes below
`HELDOUT_SHARE` (about 5%), a pure function of the name, so a package (with the top-level
modules of its name) is on one side only, whatever DIR holds beside it.

Left out: caches and install metadata (`SKIPPED_DIRS`, `*.dist-info`, `*.egg-info`, hidden
names), files larger than `MAX_FILE_BYTES`, symlinks that leave DIR, binary and non-UTF-8
files; all but the first are counted once in the source's `SourceStats` (the size and the
symlink when the source is opened, the content when the file is first read). Document i is
the same as long as DIR does not change: installing packages into DIR renumbers them.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import threading

from lclm.data.documents import TextDocuments
from lclm.data.kind import DIRECTORY, Kind, Reading
from lclm.data.records import DataError
from lclm.data.stats import SourceStats

# Python sources, stubs and Cython, and the prose beside them. C/C++ files are left out: in a
# site-packages they are mostly the vendored headers of compiled libraries (9891 .h files,
# 41 MB in lclm's own .venv, against 303 MB of .py), which would swamp the Python.
EXTENSIONS = (".py", ".pyi", ".pyx", ".pxd", ".md", ".rst", ".txt")
# caches, and directories of other packages (a stdlib's site-packages is its own source)
SKIPPED_DIRS = frozenset({"__pycache__", "site-packages", "dist-packages", "node_modules"})
MAX_FILE_BYTES = 1 << 20   # larger files are generated or data (The Stack drops > 1 MB too)
MAX_DOCUMENT_BYTES = 8 << 20   # ~2M LLaMA tokens; bounds the cost of reading one document
HELDOUT_SHARE = 0.05
_PACKAGES = "a directory of packages (e.g. a site-packages)"   # what DIR is, as messages say


@dataclasses.dataclass(frozen=True)
class CodeDocument:
    """One document: `files` (paths relative to the root, in path order) of package `name`
    (for a file directly in the root, its name up to the first '.')."""
    name: str
    files: tuple[str, ...]


def is_heldout(name: str) -> bool:
    """Whether package `name` is in the held-out split: its SHA-256 as a number in [0, 1)
    is below HELDOUT_SHARE (not Python's `hash`, which changes between processes)."""
    digest = hashlib.sha256(name.encode("utf-8", "surrogateescape")).digest()
    return int.from_bytes(digest[:8], "big") < HELDOUT_SHARE * 2.0 ** 64


def _skipped_dir(name: str) -> bool:
    return (name in SKIPPED_DIRS or name.startswith(".")
            or name.endswith((".dist-info", ".egg-info")))


def _inside(path: str, root: str) -> bool:
    """Whether `path` (resolved through its symlinks) lies under `root` (already resolved)."""
    return os.path.commonpath([os.path.realpath(path), root]) == root


class _Walker:
    """Lists the source files (path relative to the root, bytes) of the root's packages,
    counting those left out for their size or for a symlink that leaves the root."""

    def __init__(self, root: str, stats: SourceStats):
        self.root, self.real, self.stats = root, os.path.realpath(root), stats

    def chosen(self, path: str) -> tuple[str, int] | None:
        """(relative path, bytes) of the file at `path` when it is read; None otherwise."""
        if not path.endswith(EXTENSIONS):
            return None
        if os.path.islink(path) and not _inside(path, self.real):
            self.stats.skip(path, "a symlink out of the source's directory")
            return None
        try:
            size = os.stat(path).st_size
        except OSError:   # a dangling symlink, or a file removed while listing
            return None
        if size > MAX_FILE_BYTES:
            self.stats.skip(path, f"over {MAX_FILE_BYTES} bytes")
            return None
        return os.path.relpath(path, self.root), size

    def package(self, directory: str) -> list[tuple[str, int]]:
        """The chosen files of the package at `directory`, in path order."""
        found: list[tuple[str, int]] = []
        for parent, dirs, names in os.walk(directory):   # symlinked directories not entered
            dirs[:] = [d for d in dirs if not _skipped_dir(d)]
            found += filter(None, (self.chosen(os.path.join(parent, n)) for n in names))
        return sorted(found, key=lambda f: f[0].split(os.sep))


def _parts(name: str, files: list[tuple[str, int]]) -> list[CodeDocument]:
    """A package's files `[(path, bytes)]` as documents of at most MAX_DOCUMENT_BYTES each
    (cut between files; a package under the limit is one document)."""
    parts: list[list[str]] = [[]]
    size = 0
    for path, n in files:
        if parts[-1] and size + n > MAX_DOCUMENT_BYTES:
            parts.append([])
            size = 0
        parts[-1].append(path)
        size += n
    return [CodeDocument(name, tuple(p)) for p in parts if p]


def list_documents(root: str, heldout: bool, stats: SourceStats) -> list[CodeDocument]:
    """The documents of `root` in one split (`heldout`: the held-out packages, else the
    others), in the order of the root's sorted entries."""
    walker = _Walker(root, stats)
    with os.scandir(root) as listing:
        entries = sorted(listing, key=lambda e: e.name)
    documents = []
    for entry in entries:
        if entry.is_dir():
            if _skipped_dir(entry.name) or is_heldout(entry.name) != heldout:
                continue
            if _inside(entry.path, walker.real):
                documents += _parts(entry.name, walker.package(entry.path))
            else:
                stats.skip(entry.path, "a symlink out of the source's directory")
            continue
        name = entry.name.split(".", 1)[0] or entry.name   # json.py goes with json/
        if (entry.is_file() and is_heldout(name) == heldout
                and (chosen := walker.chosen(entry.path)) is not None):
            documents.append(CodeDocument(name, (chosen[0],)))
    return documents


def _read(path: str) -> tuple[str | None, str]:
    """(the text of a file, '') or (None, why it is not text: binary, i.e. holding a NUL
    byte, not UTF-8, or unreadable)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        return None, f"unreadable ({e.strerror})"
    if b"\0" in data:
        return None, "binary"
    try:
        return data.decode("utf-8"), ""
    except UnicodeDecodeError:
        return None, "invalid UTF-8"


class CodeRecords:
    """The records `{"text": document}` of `code:` (or `code-heldout:`) DIR, read when asked
    for: `[i]` reads document i's files (a record of None when none of them is text). A
    bad file is left out of its document and counted once in `stats`; the loader's thread
    and its statistics may read at once."""

    def __init__(self, root: str, heldout: bool, stats: SourceStats):
        if not os.path.isdir(root):
            raise FileNotFoundError(f"no directory at {root!r}; a code source reads "
                                    f"{_PACKAGES}")
        self.root, self.stats = root, stats
        self.documents = list_documents(root, heldout, stats)
        self._bad: set[str] = set()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.documents)

    def __getitem__(self, i: int) -> dict | None:
        parts = []
        for path in self.documents[i].files:
            text, why = _read(os.path.join(self.root, path))
            if text is None:
                self._skip(path, why)
                continue
            newline = "" if text.endswith("\n") or not text else "\n"
            parts.append(f"# {path}\n{text}{newline}")
        return {"text": "\n".join(parts)} if parts else None

    def _skip(self, path: str, why: str) -> None:
        with self._lock:
            if path not in self._bad:
                self._bad.add(path)
                self.stats.skip(os.path.join(self.root, path), why)


def open_packages(heldout: bool, root: str, tokenizer, reading: Reading) -> TextDocuments:
    """The documents of `code:` DIR (`code-heldout:` DIR when `heldout`), one a package."""
    packages = CodeRecords(root, heldout, reading.stats)
    if not len(packages):
        kind, split = ("code-heldout", "held-out ") if heldout else ("code", "")
        raise DataError(f"{kind}:{root} holds no {split}package with "
                        f"{'/'.join(EXTENSIONS)} files")
    return TextDocuments(packages, "text", tokenizer)


KINDS = (Kind("code", functools.partial(open_packages, False), DIRECTORY, path_help=_PACKAGES),
         Kind("code-heldout", functools.partial(open_packages, True), DIRECTORY,
              path_help=_PACKAGES))

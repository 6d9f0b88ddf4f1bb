"""Code repositories as long documents: local directories read as repository-level records.

`code:DIR` reads a directory whose immediate subdirectories are packages (the standard
library, a site-packages, a folder of checked-out repositories), as ProLong and Fu et al.
build long data from code: each package is one document, its files of `EXTENSIONS` in
sorted path order, each as a header line `# <path relative to DIR>` and then its text. A
file directly in DIR (`json.py`, `LICENSE.txt`) is a short document of its own. A package of
more than `MAX_DOCUMENT_BYTES` continues in the next document, cut between files.

`code-heldout:DIR` reads the held-out split, made for evaluation by length: enough long
held-out documents at every length evaluated, none sharing a file with `code:DIR`, which
reads all the other files. The candidates ("units") are the packages, each cut between files
into parts of at most 704, 352 and 176 KiB in turn (`PART_BYTES`; a package under 704 KiB is
one part), so that a long package offers units of every long size, and the files directly in
DIR. Units fall into the size bands of `HELDOUT_BANDS`; in each band the units whose first
path has the lowest SHA-256 are held out, the band's count of them but never more than half
the band, so that training keeps units of every size too. Each held-out unit is one
document (at most 704 KiB, or a single file of at most `MAX_FILE_BYTES`); `code:DIR` reads
each package's other files as above. A file directly in DIR named after a package (`json.py`
beside `json/`) is held out with that package's first part.

The split is a pure function of DIR's listing: the paths (relative to DIR) of the files read,
as chosen below, and their sizes in bytes; not their contents, times, DIR's own path or the
tokenizer. Adding, removing or resizing a file can move units between parts and bands, and
so change the split: compare a model's numbers on the same DIR.

Left out: caches and install metadata (`SKIPPED_DIRS`, `*.dist-info`, `*.egg-info`, hidden
names), files larger than `MAX_FILE_BYTES`, symlinks that leave DIR, binary and non-UTF-8
files; all but the first are counted once in the source's `SourceStats` (the size and the
symlink when the source is opened, by both splits as each lists all of DIR; the content when
the file is first read). Document i is the same as long as DIR does not change: installing
packages into DIR renumbers them.
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
MAX_FILE_BYTES = 1 << 20  # larger files are generated or data (The Stack drops > 1 MB too)
MAX_DOCUMENT_BYTES = 8 << 20  # ~2M LLaMA tokens; bounds the cost of reading one document
# The held-out split's size bands: (least bytes, units held out). Evaluation at L tokens reads
# documents of L + 1 (perplexity --documents 16 of each length, validation a batch); at 5
# bytes a token, above the 4.5 of SmolLM2's tokenizer on the stdlib's most prose-like long
# packages (3.4 on the whole stdlib), a unit of 640, 320, 160, 40 or 10 KiB holds over 128K,
# 64K, 32K, 8K or 2K tokens. So a DIR with twice these counts in every band has at least 4
# held-out documents over 128K tokens, 8 over 64K and 16 over 32K, 8K and 2K; the short bands
# keep short documents in validation.
HELDOUT_BANDS = (
    (640 << 10, 4),
    (320 << 10, 4),
    (160 << 10, 8),
    (40 << 10, 4),
    (10 << 10, 4),
    (0, 4),
)
# A package's parts for the split, cut in turn at a tenth above the three long bands' least
# sizes: so the long packages (the stdlib's `test` is over half of it) give units to each long
# band, and a held-out document is not much longer than its band needs.
PART_BYTES = (704 << 10, 352 << 10, 176 << 10)
_PACKAGES = "a directory of packages (e.g. a site-packages)"  # what DIR is, as messages say

Files = list[tuple[str, int]]  # (path relative to DIR, bytes) in path order


@dataclasses.dataclass(frozen=True)
class CodeDocument:
    """One document: `files` (paths relative to the root, in path order) of package `name`
    (for a file directly in the root, its name up to the first '.')."""

    name: str
    files: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class _Entry:
    """An entry of the root: a package directory's files, or a file directly in the root."""

    name: str
    files: Files
    directory: bool


def _skipped_dir(name: str) -> bool:
    return (
        name in SKIPPED_DIRS or name.startswith(".") or name.endswith((".dist-info", ".egg-info"))
    )


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
        except OSError:  # a dangling symlink, or a file removed while listing
            return None
        if size > MAX_FILE_BYTES:
            self.stats.skip(path, f"over {MAX_FILE_BYTES} bytes")
            return None
        return os.path.relpath(path, self.root), size

    def package(self, directory: str) -> list[tuple[str, int]]:
        """The chosen files of the package at `directory`, in path order."""
        found: list[tuple[str, int]] = []
        for parent, dirs, names in os.walk(directory):  # symlinked directories not entered
            dirs[:] = [d for d in dirs if not _skipped_dir(d)]
            found += filter(None, (self.chosen(os.path.join(parent, n)) for n in names))
        return sorted(found, key=lambda f: f[0].split(os.sep))


def _cut(files: Files, limits: tuple[int, ...]) -> list[Files]:
    """`files` cut between files into parts, the i-th of at most `limits[i % len(limits)]`
    bytes (a larger file alone); none for no files."""
    parts: list[Files] = [[]]
    size = 0
    for path, n in files:
        if parts[-1] and size + n > limits[(len(parts) - 1) % len(limits)]:
            parts.append([])
            size = 0
        parts[-1].append((path, n))
        size += n
    return [p for p in parts if p]


def _digest(path: str) -> bytes:
    """SHA-256 of `path` (not Python's `hash`, which changes between processes)."""
    return hashlib.sha256(path.encode("utf-8", "surrogateescape")).digest()


def _heldout_units(units: list[Files]) -> set[str]:
    """The first paths of the held-out units: in each band of HELDOUT_BANDS, the units of
    the lowest `_digest` of their first path, the band's count of them but at most half."""
    bands: list[list[str]] = [[] for _ in HELDOUT_BANDS]
    for unit in units:
        size = sum(n for _, n in unit)
        band = next(i for i, (least, _) in enumerate(HELDOUT_BANDS) if size >= least)
        bands[band].append(unit[0][0])
    held: set[str] = set()
    for (_, count), firsts in zip(HELDOUT_BANDS, bands, strict=True):
        held.update(sorted(firsts, key=_digest)[: min(count, len(firsts) // 2)])
    return held


def _document(name: str, files: Files) -> CodeDocument:
    """The document of package `name` holding `files` (their sizes dropped)."""
    return CodeDocument(name, tuple(path for path, _ in files))


def _split(entries: list[_Entry]) -> tuple[list[CodeDocument], list[CodeDocument]]:
    """(training documents, held-out documents) of the root's `entries`, each in their order:
    the held-out units (packages' parts of PART_BYTES, files directly in the root) one
    document each, and every package's other files cut at MAX_DOCUMENT_BYTES."""
    parts = {e.name: _cut(e.files, PART_BYTES) for e in entries if e.directory and e.files}
    units = [p for e in entries if e.directory for p in parts.get(e.name, [])]
    units += [e.files for e in entries if not e.directory and e.name not in parts]
    held = _heldout_units(units)
    train: list[CodeDocument] = []
    heldout: list[CodeDocument] = []
    for e in entries:
        if not e.directory:  # with its package's first part, if it is named after one
            first = parts[e.name][0] if e.name in parts else e.files
            (heldout if first[0][0] in held else train).append(_document(e.name, e.files))
            continue
        package = parts.get(e.name, [])
        heldout += [_document(e.name, p) for p in package if p[0][0] in held]
        rest = [f for p in package if p[0][0] not in held for f in p]
        train += [_document(e.name, p) for p in _cut(rest, (MAX_DOCUMENT_BYTES,))]
    return train, heldout


def _entries(root: str, stats: SourceStats) -> list[_Entry]:
    """The package directories and files directly in `root`, in the order of its sorted
    entries, with their chosen files; the files left out for their size or a symlink out
    of the root are counted in `stats`."""
    walker = _Walker(root, stats)
    with os.scandir(root) as listing:
        found = sorted(listing, key=lambda e: e.name)
    entries = []
    for entry in found:
        if entry.is_dir():
            if _skipped_dir(entry.name):
                continue
            if _inside(entry.path, walker.real):
                entries.append(_Entry(entry.name, walker.package(entry.path), True))
            else:
                stats.skip(entry.path, "a symlink out of the source's directory")
            continue
        name = entry.name.split(".", 1)[0] or entry.name  # json.py goes with json/
        if entry.is_file() and (chosen := walker.chosen(entry.path)) is not None:
            entries.append(_Entry(name, [chosen], False))
    return entries


def list_documents(root: str, heldout: bool, stats: SourceStats) -> list[CodeDocument]:
    """The documents of `root` in one split (`heldout`: the held-out split, else training),
    in the order of the root's sorted entries."""
    train, held = _split(_entries(root, stats))
    return held if heldout else train


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
            raise FileNotFoundError(f"no directory at {root!r}; a code source reads {_PACKAGES}")
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
        raise DataError(f"{kind}:{root} holds no {split}package with {'/'.join(EXTENSIONS)} files")
    return TextDocuments(packages, "text", tokenizer)


KINDS = (
    Kind(
        "code",
        functools.partial(open_packages, False),
        DIRECTORY,
        prepare=True,
        path_help=_PACKAGES,
    ),
    Kind(
        "code-heldout",
        functools.partial(open_packages, True),
        DIRECTORY,
        prepare=True,
        path_help=_PACKAGES,
    ),
)

"""What a data source kind is: `Kind`, one entry of the registry `lclm.data.sources.KINDS`.

A kind is the `KIND:` of a `KIND:PATH` entry of data.path (or data.source, every entry's
default). Its entry says how documents are opened from PATH and what PATH is, which is all
that the loader, the start-up check (`lclm.train.startup_checks.check_data`), the
evaluation's `--data` and `python -m lclm.data.prepare` ask of a kind; none of them chooses by
name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

from lclm.data.stats import SourceStats

# What the PATH of a `KIND:PATH` entry is (`Kind.path`):
FILES = "files"  # a file, a directory (an object-store prefix) or a glob; local, gs://, s3://
DIRECTORY = "directory"  # a local directory, read with os (not through lclm.storage)
OPTIONS = "options"  # ';'-separated key=value of generated documents: nothing is read
PATHS = (FILES, DIRECTORY, OPTIONS)


class Documents(Protocol):
    """A random-access document set: document i is `(tokens int32 [n], loss int8 [n])`, the
    same every time it is read, or None for a malformed record (counted when first read).

    A set whose documents cost work may also answer, more cheaply, what the loader asks
    (`lclm.data.filters`, `lclm.data.loader`): `most_tokens(i)`, an upper bound of document
    i's length or None, and `partial(i, n)`, document i read to at least n tokens, the rest
    read as it is needed (`lclm.data.documents.Partial`; `TextDocuments` does both)."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int, /) -> Any: ...


@dataclasses.dataclass(frozen=True)
class Reading:
    """What config.data says about reading records (for the kinds that read records), and
    where the malformed ones are counted."""

    text_field: str = "text"
    chat_template: str = "vicuna"
    stats: SourceStats = dataclasses.field(default_factory=SourceStats)


@dataclasses.dataclass(frozen=True)
class Kind:
    """One data source kind.

    name: the `KIND:` prefix (and a data.source choice: `lclm.config.schema.SOURCE_KINDS`
    lists the same names). open: `(PATH, tokenizer, Reading) -> Documents`; a source that
    cannot give a single document fails here with a `DataError` (or `FileNotFoundError`, or a
    `ValueError` for bad options) naming it. path: what PATH is, one of PATHS (FILES are
    looked up at start wherever they are, a DIRECTORY is checked to be a local one, OPTIONS
    are not looked up). prepare: `python -m lclm.data.prepare --source NAME` takes it, and so
    a directory that prepare wrote is read as such under this kind too. path_help: what a
    DIRECTORY kind's directory holds, as the start-up check asks for it.
    """

    name: str
    open: Callable[[str, Any, Reading], Documents]
    path: str
    prepare: bool = False
    path_help: str = ""

    def __post_init__(self):
        if self.path not in PATHS:
            raise ValueError(f"Kind {self.name!r}: path={self.path!r}; use one of {PATHS}")
        if self.path == DIRECTORY and not self.path_help:
            raise ValueError(
                f"Kind {self.name!r}: a DIRECTORY kind says what its directory holds (path_help)"
            )


__all__ = ["DIRECTORY", "FILES", "OPTIONS", "PATHS", "Documents", "Kind", "Reading"]

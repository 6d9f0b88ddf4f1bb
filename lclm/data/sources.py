"""Data sources: the kinds of data.path entries (`KINDS`) and the documents a source opens to.

An entry `KIND:PATH` names one source; its kind's module reads it:

- text, sharegpt (`lclm.data.documents`): records of files, directories, globs, `datasets`
  or `hub:NAME` (`lclm.data.records`); a directory that `python -m lclm.data.prepare` wrote
  is read as it is under either name;
- tokenized (`lclm.data.prepared`): a directory that prepare wrote;
- line_retrieval, ruler (`lclm.data.line_retrieval`, `lclm.data.ruler`): synthetic documents
  generated on the fly, PATH their options;
- code, code-heldout (`lclm.data.code`): a local directory of packages, one document each.

A document is `(tokens int32 [n], loss int8 [n])`, where `loss[i]` says whether token i is
a training target (predicting it is learned); document i of a source is always the same.
A new kind is a module defining its `Kind` (`lclm.data.kind`) and its line in `KINDS`; its
name also goes into `lclm.config.schema.SOURCE_KINDS` (data.source's choices, which the
config layer holds below the data; tests/data/test_kinds.py checks that they agree).
"""

from __future__ import annotations

from lclm.data import code, documents, line_retrieval, prepared, ruler
from lclm.data.kind import Documents, Kind, Reading
from lclm.data.records import DataError
from lclm.data.stats import SourceStats

KINDS: dict[str, Kind] = {
    k.name: k
    for k in (*documents.KINDS, prepared.KIND, line_retrieval.KIND, ruler.KIND, *code.KINDS)
}


def get_kind(name: str) -> Kind:
    """The kind called `name` (a ValueError naming every kind otherwise)."""
    if name not in KINDS:
        raise ValueError(f"unknown data source {name!r}; use one of {', '.join(KINDS)}")
    return KINDS[name]


def open_documents(
    kind: str,
    path: str,
    tokenizer,
    *,
    text_field: str = "text",
    chat_template: str = "vicuna",
    stats: SourceStats | None = None,
) -> Documents:
    """A random-access document set of source `kind` (a name of `KINDS`) at `path` (options
    for a kind whose `Kind.path` is OPTIONS).

    A source that cannot give a single document fails here with a `DataError` (or
    `FileNotFoundError`) naming it; single malformed records are left out and counted in
    `stats`, once.
    """
    source = get_kind(kind)
    if source.prepare and prepared.is_tokenized_dir(path):
        source = prepared.KIND
    reading = Reading(text_field, chat_template, SourceStats() if stats is None else stats)
    return source.open(path, tokenizer, reading)


# DataError is what opening a source raises (its readers define it) and SourceStats what it
# counts into: importers of open_documents take them from here
__all__ = ["KINDS", "DataError", "SourceStats", "get_kind", "open_documents"]

"""The held-out documents an extension is measured on: `extension.data` (default
`validation.path`) read with the model's own tokenizer, counted at every length of the loss
by position before anything trains (a length with fewer than `extension.documents` long
enough documents is refused in one line: by `python -m lclm.extend` and by `python -m
lclm.check`), and written once as a pre-tokenised directory (`lclm.data.prepare`'s format)
that every evaluation part then reads: the same documents before and after, tokenised once.

A document counts at length L when it holds at least L + 1 tokens (the loss at position p
predicts token p + 1). What is kept are the documents `lclm.eval.perplexity` would take from
the source itself (the first `documents` long enough at each length, in the source's order),
each cut to the longest length + 1 tokens: reading the kept directory gives the same windows
as reading the source.
"""

from __future__ import annotations

import dataclasses

from lclm.config.run_config import RunConfig
from lclm.config.stages import stage_configs
from lclm.config.syntax import format_tokens
from lclm.data.prepare import write_prepared
from lclm.data.sources import open_documents
from lclm.data.stats import SourceStats
from lclm.data.tokenizer import Tokenizer
from lclm.errors import ConfigError
from lclm.eval.perplexity import data_source
from lclm.extend.plan import Lengths, extension_lengths, stage_runs, starting_length

# documents read at most when counting: a held-out set is a few hundred documents; a large
# one is only counted up to here
MAX_READ = 4096


@dataclasses.dataclass
class HeldOut:
    """What the held-out source holds: `counts[L]` documents of at least L + 1 tokens among
    the `read` first ones, and the documents kept for the evaluation (ids, loss flags)."""

    source: str
    counts: dict[int, int]
    read: int
    longest: int
    kept: list
    malformed: int = 0

    def lines(self) -> list[str]:
        return [
            f"{format_tokens(n)}: {c} documents of at least {n + 1:,} tokens"
            for n, c in self.counts.items()
        ]


def heldout_source(sections: RunConfig) -> str:
    """extension.data, else validation.path; neither is one line."""
    source = sections.extension.data or sections.validation.path
    if not source:
        raise ConfigError(
            "an extension is measured on held-out long documents: set "
            "extension.data (or validation.path), e.g. code-heldout:DIR"
        )
    return source


def count(
    source: str, tokenizer: Tokenizer, lengths: list[int], needed: int, text_field: str = "text"
) -> HeldOut:
    """Read the held-out documents of `source` (the data.path syntax, one source) and count
    them at each of `lengths`; keep the first `needed` long enough at each."""
    entry = data_source("extension.data", source)
    stats = SourceStats()
    docs = open_documents(entry.kind, entry.path, tokenizer, text_field=text_field, stats=stats)
    counts = dict.fromkeys(sorted(lengths), 0)
    top = max(lengths) + 1
    kept, read, longest = [], 0, 0
    for i in range(min(len(docs), MAX_READ)):
        doc = docs[i]
        if doc is None:  # malformed: counted in stats
            continue
        read += 1
        tokens, loss = doc
        longest = max(longest, len(tokens))
        wanted = any(len(tokens) >= n + 1 and counts[n] < needed for n in counts)
        for n in counts:
            counts[n] += len(tokens) >= n + 1
        if wanted:
            kept.append((tokens[:top], loss[:top]))
    return HeldOut(source, counts, read, longest, kept, stats.skipped)


def counted(config) -> tuple[Lengths, HeldOut]:
    """The lengths of the extension `config` describes and its held-out documents counted at
    each (a config that cannot be measured is one line)."""
    stages = stage_runs(config)
    first = stages[0]
    lengths = extension_lengths(first, stages, starting_length(first))
    # each earlier stage's weights are measured at its own length too
    measured = sorted(set(lengths.perplexity) | {s.data.seq_len for s in stages})
    held = count(
        heldout_source(first),
        Tokenizer(first.data.tokenizer),
        measured,
        first.extension.documents,
        first.data.text_field,
    )
    return lengths, held


def is_extension(config) -> bool:
    """Whether `config` is made for `python -m lclm.extend`: stages from trained weights, with
    its held-out data named (extension.data; a recipe that only validates on some data is not
    held to the extension's document counts)."""
    model = config.model
    return bool(
        stage_configs(config)
        and (model.init_from_hf or model.init_from_checkpoint)
        and config.extension.data
    )


def preflight(config) -> tuple[bool, str]:
    """(passed, one line) of `python -m lclm.check`: enough held-out documents at every length
    the extension measures."""
    try:
        _, held = counted(config)
        check_counts(held, config.extension.documents)
    except ConfigError as e:
        return False, f"FAIL held-out documents for python -m lclm.extend: {e}"
    counts = ", ".join(f"{format_tokens(n)} {c}" for n, c in held.counts.items())
    return True, (
        f"ok   held-out documents for python -m lclm.extend in {held.source}, per "
        f"length (at least extension.documents={config.extension.documents}): "
        f"{counts}"
    )


def check_counts(held: HeldOut, needed: int) -> None:
    """One line for the shortest length with fewer than `needed` documents."""
    for n, c in held.counts.items():
        if c < needed:
            raise ConfigError(
                f"the loss by position at {format_tokens(n)} needs extension.documents={needed} "
                f"held-out documents of at least {n + 1:,} tokens, and {held.source} holds {c} "
                f"(of {held.read} read; the longest holds {held.longest:,}): use longer "
                "held-out documents (extension.data), fewer (extension.documents) or leave "
                f"{format_tokens(n)} out of extension.lengths"
            )


def write(held: HeldOut, out: str, tokenizer: Tokenizer) -> dict:
    """The kept documents as a pre-tokenised directory `out` (its metadata)."""
    return write_prepared(held.kept, out, "tokenized", held.source, tokenizer, SourceStats())

"""Long-document engineering per source: the `?key=value&...` options of a data.path entry.

`min_tokens` drops shorter documents, `max_tokens` longer ones (a source's short documents
alone, e.g. for short-context retention); `short_below` + `short_keep` keep documents under
short_below tokens with probability short_keep (Fu et al. 2024 keep 10% under 4K);
`long_above` + `long_repeat` draw documents of at least long_above tokens long_repeat times
per epoch (a real number >= 1: the fraction is a per-document chance of one more copy).

Every decision is a pure function of (seed, source, document, epoch, copy), so a resumed run
decides exactly as the run it continues (the loader's state holds positions only). A
document's length is known without reading it for pre-tokenised sources (their offsets);
other sources measure it when the document is first read, and remember it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from lclm.config.syntax import format_tokens, parse_tokens
from lclm.data.ahead import read_many
from lclm.data.documents import Partial, document_length, read_partly
from lclm.data.prepared import TokenizedDocuments
from lclm.data.records import DataError
from lclm.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class LengthRules:
    """The options of one source; the defaults change nothing."""

    min_tokens: int = 0
    max_tokens: int = 0  # 0: no limit
    short_below: int = 0
    short_keep: float = 1.0
    long_above: int = 0
    long_repeat: float = 1.0

    @property
    def copies(self) -> int:
        """Draws an epoch may make of one document (its original and its possible copies)."""
        return math.ceil(self.long_repeat)

    @property
    def trivial(self) -> bool:
        return self == LengthRules()

    def text(self) -> str:
        """The options as written in a data.path entry ('' for none)."""
        parts = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value != field.default:
                shown = f"{value:g}" if isinstance(value, float) else format_tokens(value)
                parts.append(f"{field.name}={shown}")
        return "&".join(parts)


_PAIRS = (("short_below", "short_keep", "0.1"), ("long_above", "long_repeat", "2"))


def _option_value(name: str, text: str) -> int | float:
    """One option's value; ValueError naming what it must be."""
    if name in ("min_tokens", "max_tokens", "short_below", "long_above"):
        return parse_tokens(text)
    value = float(text)
    if name == "short_keep" and not 0 <= value <= 1:
        raise ValueError(f"short_keep={text} must be a probability in [0, 1]")
    if name == "long_repeat" and not 1 <= value < float("inf"):
        raise ValueError(f"long_repeat={text} must be a number >= 1")
    return value


def parse_options(text: str, where: str) -> LengthRules:
    """`key=value&key=value` (what follows '?' in a data.path entry) as `LengthRules`;
    `where` names the entry in the one-line ConfigError for an unknown option or bad value."""
    names = [f.name for f in dataclasses.fields(LengthRules)]
    values: dict[str, int | float] = {}
    for item in filter(None, text.split("&")):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in names:
            raise ConfigError(
                f"{where}: unknown option {item!r}; the options are "
                f"{', '.join(names)} (e.g. ?short_below=4k&short_keep=0.1)"
            )
        if name in values:
            raise ConfigError(f"{where}: option {name} is given twice; keep one")
        try:
            values[name] = _option_value(name, value.strip())
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None
    for length, share, example in _PAIRS:
        if (length in values) != (share in values):
            raise ConfigError(
                f"{where}: {length} and {share} go together; give both (e.g. "
                f"{length}={format_tokens(int(values.get(length, 4096)))}"
                f"&{share}={example})"
            )
    return LengthRules(**values)  # type: ignore[arg-type]  # typed per field above


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 `[k]` (wrapping arithmetic): every output bit
    depends on every input bit."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def uniforms(key: Sequence[int], documents: np.ndarray) -> np.ndarray:
    """A uniform number in [0, 1) per document of `documents` `[k]`: a pure function of
    (key, document), vectorised, so that a whole source is decided at once for statistics
    and a single document as it is drawn, alike."""
    base = np.random.SeedSequence(list(key)).generate_state(1, np.uint64)[0]
    h = _mix(_mix(np.asarray(documents, np.uint64) + np.uint64(0x9E3779B97F4A7C15)) ^ base)
    return (h >> np.uint64(11)).astype(np.float64) * 2.0**-53


class DocumentLengths:
    """Token counts `[n]` of a document set's documents: exact from the offsets of a
    pre-tokenised directory, else measured when a document is first read (`known`, -1: not
    yet; a malformed document counts 0 tokens). Where only bounds were asked for, `least`
    and `most` hold what they found (see `LengthFilter.read`)."""

    def __init__(self, docs):
        self.docs = docs
        self.exact = isinstance(docs, TokenizedDocuments)
        n = len(docs)
        self.known = np.diff(docs.offsets) if self.exact else np.full(n, -1, np.int64)
        self.least = np.zeros(n, np.int64)
        self.most = np.full(n, np.iinfo(np.int64).max, np.int64)
        self._bounded = np.zeros(n, bool)  # most_tokens asked

    def note(self, i: int, doc) -> None:
        """What reading document i found (a document, a `Partial` or None): its length where
        that is known, else a lower bound."""
        if isinstance(doc, Partial) and not doc.complete:
            self.least[i] = max(self.least[i], doc.encoded)
        else:
            self.known[i] = self.least[i] = self.most[i] = document_length(doc)

    def bounds(self, i: int) -> tuple[int, int]:
        """(at least, at most) tokens of document i; both its length where it is known."""
        if self.known[i] >= 0:
            return int(self.known[i]), int(self.known[i])
        return int(self.least[i]), int(self.most[i])

    def bound(self, i: int) -> None:
        """Bound document i's length from above without tokenising it, where its document
        set can (`most_tokens`, see `lclm.data.kind.Documents`)."""
        if self.known[i] < 0 and not self._bounded[i]:
            self._bounded[i] = True
            most = getattr(self.docs, "most_tokens", None)
            found = None if most is None else most(i)
            if found is not None:
                self.most[i] = min(self.most[i], found)

    def partial(self, i: int, n: int):
        """Document i read to at least `n` tokens (`lclm.data.documents.read_partly`), what
        that found noted."""
        doc = read_partly(self.docs, i, n)
        self.note(i, doc)
        return doc

    def measure(self, indices: np.ndarray) -> np.ndarray:
        """The lengths `[k]` of documents `indices` `[k]`, reading those not yet known (in
        parallel where the documents are read ahead: `lclm.data.ahead`)."""
        unknown = indices[self.known[indices] < 0]
        for i, doc in zip(unknown, read_many(self.docs, unknown)):
            self.note(int(i), doc)
        return self.known[indices]


_UNREAD = object()  # LengthFilter.read: the document not read yet


class LengthFilter:
    """A source's options applied to its documents; shared by all its readers.

    `read(i, epoch, copy)` is document i as its `copy`-th draw of `epoch` (0: the original,
    >= 1: a copy of a long document), or None where the options (or a malformed record)
    leave that draw out. `lengths`: those of `docs`, where another source reads the same
    documents (each is measured once); else its own.

    A draw is decided on bounds of the document's length where they decide it, so that a
    document is rarely tokenised whole to decide it: first an upper bound from its text's
    bytes (a document under `min_tokens` is left out unread by the tokenizer), then its text
    tokenised until past the largest length the options compare with (`max_tokens`,
    `min_tokens`, ...); a document drawn so is handed out as read, a `Partial` its row reads
    further. The decision is the one its exact length gives, so batches and resumes do not
    depend on what was measured.
    """

    def __init__(
        self,
        docs,
        rules: LengthRules,
        seed: int,
        source: int,
        lengths: DocumentLengths | None = None,
    ):
        self.docs, self.rules, self.seed, self.source = docs, rules, seed, source
        self.lengths = DocumentLengths(docs) if lengths is None else lengths
        self.copies = rules.copies

    def keep(self, indices: np.ndarray, lengths: np.ndarray, epoch: int, copy: int) -> np.ndarray:
        """Whether draw `copy` of `epoch` takes each of documents `indices` `[k]` of
        `lengths` `[k]`: bool `[k]`."""
        r = self.rules
        kept = self._fits(lengths)
        if r.short_keep < 1:
            lucky = uniforms((self.seed, self.source, epoch, 0), indices) < r.short_keep
            kept &= (lengths >= r.short_below) | lucky
        if copy:
            kept &= lengths >= r.long_above
            whole = math.floor(r.long_repeat)
            if copy >= whole:  # the last copy, made with the fraction's chance
                chance = uniforms((self.seed, self.source, epoch, copy), indices)
                kept &= chance < r.long_repeat - whole
        return kept

    def _fits(self, lengths: np.ndarray) -> np.ndarray:
        """Whether each of `lengths` `[k]` is within min_tokens..max_tokens: bool `[k]`."""
        r = self.rules
        fits = lengths >= max(r.min_tokens, 1)
        return fits & (lengths <= r.max_tokens) if r.max_tokens else fits

    def _thresholds(self, copy: int) -> list[int]:
        """The lengths where `keep`'s answer for draw `copy` may change (it compares the
        length with each as `length >= threshold`)."""
        r = self.rules
        found = [max(r.min_tokens, 1)]
        if r.max_tokens:
            found.append(r.max_tokens + 1)
        if r.short_keep < 1:
            found.append(r.short_below)
        if copy:
            found.append(r.long_above)
        return found

    def _on_bounds(self, i: int, thresholds: list[int], judge) -> bool | None:
        """`judge(length)` of document i where what is known of its length decides it (it
        changes only at `thresholds`, as `length >= threshold` does); else None."""
        least, most = self.lengths.bounds(i)
        if any(least < t <= most for t in thresholds):
            return None
        return bool(judge(least))

    def _judged(self, i: int, thresholds: list[int], judge) -> tuple[bool, object]:
        """(`judge(length)` of document i, the document where it was read on the way, else
        _UNREAD), measuring no more than it takes: its known bounds, the bytes' bound, then
        its text tokenised until past the largest threshold (or whole)."""
        doc: object = _UNREAD
        if (answer := self._on_bounds(i, thresholds, judge)) is None:
            self.lengths.bound(i)
            answer = self._on_bounds(i, thresholds, judge)
        if answer is None:
            doc = self.lengths.partial(i, max(thresholds))
            answer = self._on_bounds(i, thresholds, judge)
        assert answer is not None  # known, or at least the largest threshold
        return answer, doc

    def _keeps(self, i: int, epoch: int, copy: int):
        return lambda n: self.keep(np.array([i]), np.array([n]), epoch, copy)[0]

    def read(self, i: int, epoch: int, copy: int):
        thresholds = self._thresholds(copy)
        taken, doc = self._judged(i, thresholds, self._keeps(i, epoch, copy))
        if not taken:
            return None
        return read_partly(self.docs, i) if doc is _UNREAD else doc

    def ahead(self, i: int, copy: int) -> tuple[int, int]:
        """What reading document i ahead for draw `copy` should read (see
        `lclm.data.ahead.Ahead.want`): enough to decide the draw."""
        return i, 0 if self.lengths.known[i] >= 0 else max(self._thresholds(copy))

    def may_keep(self, i: int, epoch: int, copy: int) -> bool:
        """Whether `read(i, epoch, copy)` may give the document: False only where what is
        known of its length decides that the options leave that draw out (its upper bound
        asked for first: the text's bytes, where the documents give it)."""
        thresholds, keeps = self._thresholds(copy), self._keeps(i, epoch, copy)
        if self._on_bounds(i, thresholds, keeps) is None:
            self.lengths.bound(i)
        return self._on_bounds(i, thresholds, keeps) is not False

    def check_keepable(self, indices: np.ndarray, name: str) -> None:
        """A DataError naming `name` when no document of `indices` could ever be drawn: a
        reader of only those would search forever (each measured only as far as that
        takes)."""
        r = self.rules
        # where `possible` may change: min_tokens, max_tokens and, where no short document
        # is ever kept, short_below
        thresholds = [max(r.min_tokens, 1)] + [r.max_tokens + 1] * bool(r.max_tokens)
        thresholds += [r.short_below] * (r.short_keep <= 0)

        def possible(n: int) -> bool:
            return bool(self._fits(np.array([n]))[0]) and (n >= r.short_below or r.short_keep > 0)

        if not any(self._judged(int(i), thresholds, possible)[0] for i in indices):
            raise DataError(
                f"data source {name}: its options ?{r.text()} leave out every "
                f"document of a batch row's share ({len(indices)} documents); "
                "loosen min_tokens, max_tokens or short_keep, or use more data"
            )


# (label, first length, end): the length buckets of the statistics
BUCKETS = (
    ("<4K", 0, 4096),
    ("4-16K", 4096, 16384),
    ("16-64K", 16384, 65536),
    ("64-256K", 65536, 262144),
    (">=256K", 262144, None),
)


def _sample(n: int, cap: int, seed: int, source: int) -> np.ndarray:
    """The documents `[min(n, cap)]` measured for the statistics, in index order: all of
    them, or a deterministic random sample of `cap`."""
    if n <= cap:
        return np.arange(n)
    return np.sort(np.random.default_rng([seed, source]).choice(n, cap, replace=False))


def statistics(f: LengthFilter, cap: int) -> dict:
    """What one epoch of the source draws under its options (epoch 0, exactly as drawn):
    `documents` (draws, copies counted) and `tokens`, in total and per length bucket, and
    the source before its options (`source_documents`, `source_tokens`). Pre-tokenised
    sources are counted exactly; others measure up to `cap` documents (a deterministic
    sample) and scale, with `estimated` true when they sampled."""
    n = len(f.docs)
    indices = np.arange(n) if f.lengths.exact else _sample(n, cap, f.seed, f.source)
    lengths = f.lengths.measure(indices)
    draws = np.sum([f.keep(indices, lengths, 0, c) for c in range(f.copies)], axis=0)
    scale = n / len(indices)

    def count(mask: np.ndarray) -> dict[str, int]:
        return dict(
            documents=round(float(draws[mask].sum()) * scale),
            tokens=round(float((draws * lengths)[mask].sum()) * scale),
        )

    buckets = {
        label: count((lengths >= lo) & (lengths < (hi or np.inf))) for label, lo, hi in BUCKETS
    }
    return dict(
        options=f.rules.text(),
        estimated=len(indices) < n,
        measured=len(indices),
        source_documents=n,
        source_tokens=round(float(lengths.sum()) * scale),
        **count(np.ones(len(indices), bool)),
        buckets=buckets,
    )

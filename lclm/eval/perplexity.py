"""Loss (and perplexity) by token position over held-out long documents.

    python -m lclm.eval perplexity --checkpoint WORKDIR
    python -m lclm.eval perplexity --checkpoint WORKDIR --data heldout.jsonl --lengths 4k,16k
    python -m lclm.eval perplexity --hf HF_DIR --data books/ --lengths 32k,128k --sp 8

For each of `--lengths` L (default: the trained length x1, x2 and x4), the first
`--documents` documents of `--data` holding at least L + 1 tokens are cut to their first
L + 1: the model reads tokens 0..L-1 and the loss at position p is that of predicting token
p + 1 from tokens 0..p. Shorter documents are skipped and counted (the table and JSON say
how many, per length); a length that no document reaches is said in a line under the table
and on the plot, and when no length has a document the command stops before measuring
anything. `--data` is read by the training data sources (`lclm.data.sources`:
.jsonl/.json/.txt/.parquet/.arrow files, a directory or glob of them, a `lclm.data.prepare`
directory, or a `[kind:]path` source), documents in file order; targets a document does
not train on (chat prompts) are left out, as in training's loss. By default `--data` is the
held-out packages of this Python's standard library as repository documents
(`code-heldout:STDLIB`, `lclm.data.code`): long documents that any machine with Python has.

The positions 0..L-1 are cut into `--buckets` equal ranges and the mean token loss of each
(summed in float64 over float32 token losses) is reported with its perplexity exp(loss).
How to read it: a loss that stays flat or keeps falling as the position grows means the
model uses the longer context (later tokens have more to condition on); a loss that rises
past some position (often the length it was trained at) means it does not, and the context
beyond is noise to it. L may exceed the trained length: that is what the test is for.

The losses come from training's forward (`lclm.eval.token_loss`): the same layers, the same
context-parallel strategy and token layout on the mesh the flags choose (default: the
checkpoint's), the same chunked float32 cross-entropy. Each token's loss is put back into
original order before bucketing, so the result does not depend on the mesh, layout or
strategy (up to float rounding). Rows are padded at the END to a length that `sp` and the
chunks divide, in a separate segment that no document token attends to.

Writes the table to stdout and `OUT/perplexity.md`, `OUT/perplexity.json` (buckets per
length, each document's mean loss) and `OUT/perplexity.png` (loss against position). The
report is written again after each length, marked incomplete until the last: a run that
stops at a long length (out of memory, interrupted) keeps the lengths it measured.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import sysconfig
from collections.abc import Callable

import numpy as np

from lclm.config import AttentionConfig, ModelConfig
from lclm.config.syntax import format_tokens
from lclm.data.kind import DIRECTORY
from lclm.data.loader import SourceEntry, parse_sources
from lclm.data.prepared import is_tokenized_dir
from lclm.data.records import resolve_files
from lclm.data.sources import get_kind, open_documents
from lclm.data.stats import SourceStats
from lclm.errors import StartupError
from lclm.eval import report
from lclm.eval.decode import padded_length
from lclm.eval.model import LoadedModel, load_model
from lclm.eval.retrieval import batch_rows
from lclm.eval.token_loss import losses_in_order
from lclm.writes import check_input

TASK = "perplexity"
# long held-out documents that every machine with Python has (see the module's docstring)
DEFAULT_DATA = f"code-heldout:{sysconfig.get_paths()['stdlib']}"
log = logging.getLogger(__name__)


# -- documents (host side) -----------------------------------------------------------------


def windows(docs, lengths: list[int], max_docs: int) -> dict[int, dict]:
    """For each length L: {'tokens': [n, L+1] int32 and 'mask': [n, L] (whether target p is
    one training would learn) of the first `max_docs` documents of at least L + 1 tokens,
    in order, 'skipped': how many shorter documents were passed over and 'longest': the
    most tokens one of them held}. One pass over the documents, stopping once every length
    has its `max_docs`."""
    tokens_of: dict[int, list[np.ndarray]] = {n: [] for n in lengths}
    masks_of: dict[int, list[np.ndarray]] = {n: [] for n in lengths}
    skipped = dict.fromkeys(lengths, 0)
    longest = dict.fromkeys(lengths, 0)
    for i in range(len(docs)):
        if all(len(t) >= max_docs for t in tokens_of.values()):
            break
        doc = docs[i]
        if doc is None:  # a malformed record (counted by the source's SourceStats)
            continue
        tokens, loss = doc
        for n in lengths:
            if len(tokens_of[n]) >= max_docs:
                continue
            if len(tokens) < n + 1:
                skipped[n] += 1
                longest[n] = max(longest[n], len(tokens))
            else:
                tokens_of[n].append(np.asarray(tokens[: n + 1], np.int32))
                masks_of[n].append(np.asarray(loss[1 : n + 1], bool))
    return {
        n: dict(
            tokens=np.asarray(tokens_of[n], np.int32).reshape(-1, n + 1),
            mask=np.asarray(masks_of[n], bool).reshape(-1, n),
            skipped=skipped[n],
            longest=longest[n],
        )
        for n in lengths
    }


def rows_of(windows_: np.ndarray, row_len: int) -> dict:
    """Model inputs `[n, row_len]` (original order) of windows `[n, L+1]`: tokens 0..L-1,
    targets 1..L, positions from 0, the document in segment 1 and the padding after it
    (row_len - L tokens) in segment 0."""
    n, length = windows_.shape[0], windows_.shape[1] - 1
    tokens = np.zeros((n, row_len), np.int32)
    targets = np.zeros((n, row_len), np.int32)
    segments = np.zeros((n, row_len), np.int32)
    tokens[:, :length], targets[:, :length] = windows_[:, :-1], windows_[:, 1:]
    segments[:, :length] = 1
    positions = np.broadcast_to(np.arange(row_len, dtype=np.int32), (n, row_len)).copy()
    return dict(tokens=tokens, targets=targets, positions=positions, segment_ids=segments)


def row_length(c: ModelConfig, a: AttentionConfig, sp: int, length: int) -> int:
    """The smallest row length >= `length` that the mesh's `sp`, the attention and FFN
    chunks (`decode.padded_length`) and the loss chunk divide."""
    p = padded_length(length, sp, c.ffn_chunk, a)
    while (p // sp) % min(c.loss_chunk, p // sp):
        p = padded_length(p + 1, sp, c.ffn_chunk, a)
    return p


# -- losses by position --------------------------------------------------------------------


def bucket_losses(losses: np.ndarray, mask: np.ndarray, n_buckets: int) -> list[dict]:
    """Mean loss of each of `n_buckets` equal position ranges of losses `[n, L]` (original
    order; only where `mask`), summed in float64."""
    length = losses.shape[1]
    bucket = np.arange(length) * n_buckets // length
    out = []
    for b in range(n_buckets):
        cols = bucket == b
        picked = mask[:, cols]
        total = float(np.sum(losses[:, cols][picked], dtype=np.float64))
        count = int(picked.sum())
        mean = total / count if count else float("nan")
        out.append(
            dict(
                bucket=b,
                lo=int(np.flatnonzero(cols)[0]),
                hi=int(np.flatnonzero(cols)[-1]) + 1,
                tokens=count,
                loss=mean,
                perplexity=math.exp(mean) if count else float("nan"),
            )
        )
    return out


def position_losses(model: LoadedModel, windows_: np.ndarray, batch_size: int) -> np.ndarray:
    """Float32 losses `[n, L]` in original order of windows `[n, L+1]`, `batch_size` rows
    per forward (the last batch filled up with copies of its last window)."""
    length = windows_.shape[1] - 1
    row_len = row_length(model.config, model.attention, model.mesh.shape["sp"], length)
    out = []
    for start in range(0, len(windows_), batch_size):
        group = windows_[start : start + batch_size]
        n = len(group)
        group = np.concatenate([group, np.repeat(group[-1:], batch_size - n, axis=0)])
        losses = losses_in_order(
            model.config, model.attention, model.mesh, model.params, rows_of(group, row_len)
        )
        out.append(losses[:n, :length])
    return np.concatenate(out)


def check_buckets(lengths: list[int], n_buckets: int) -> None:
    """Every length must hold at least `n_buckets` positions (a bucket of none has no loss);
    one line naming the fix otherwise. Buckets are not shrunk to fit: the table has one
    column per bucket for every length, and a column would mean different ranges."""
    short = [n for n in lengths if n < n_buckets]
    if short:
        raise StartupError(
            f"--buckets {n_buckets} cuts each length into {n_buckets} ranges of positions, but "
            f"length{'s' * (len(short) > 1)} {','.join(map(str, short))} of --lengths "
            f"hold{'s' * (len(short) == 1)} fewer positions; use --buckets {min(lengths)} or "
            f"fewer, or longer --lengths"
        )


def no_document_line(entry: dict) -> str:
    """What a report says of a length that no document of --data reaches."""
    return (
        f"length {format_tokens(entry['length'])}: nothing measured, no document of "
        f"--data holds {entry['length'] + 1} tokens (of {entry['skipped']} read, the "
        f"longest holds {entry['longest']})"
    )


def evaluate(
    model: LoadedModel,
    docs,
    lengths: list[int],
    *,
    n_buckets: int,
    max_docs: int,
    batch_size: int | None = None,
    measured: Callable[[dict], None] | None = None,
) -> dict:
    """{'lengths': [per length: documents, skipped, the longest skipped, loss, perplexity,
    buckets, the documents' mean losses]}; one log line per length, and `measured(result so
    far)` after each. Every length's documents are found before anything is measured: when
    no length has one, a StartupError says so (and how long the documents are)."""
    rows = batch_rows(model, batch_size)
    found = windows(docs, lengths, max_docs)
    if not any(len(w["tokens"]) for w in found.values()):
        longest = max(w["longest"] for w in found.values())
        read = max(w["skipped"] for w in found.values())
        raise StartupError(
            f"--data holds no document long enough for any of --lengths (each needs length + 1 "
            f"tokens; the longest of the {read} documents read holds {longest}): use --lengths "
            f"below {longest} or longer documents, e.g. the default --data {DEFAULT_DATA}"
        )
    results: list[dict] = []
    for length, w in found.items():
        entry = dict(
            length=length,
            documents=len(w["tokens"]),
            skipped=w["skipped"],
            longest_skipped=w["longest"],
        )
        if not len(w["tokens"]):
            log.warning("%s", no_document_line(dict(entry, longest=w["longest"])))
            results.append(dict(entry, loss=None, perplexity=None, buckets=[], document_losses=[]))
        else:
            losses = position_losses(model, w["tokens"], rows)
            mask = w["mask"]
            mean = float(np.sum(losses[mask], dtype=np.float64) / max(1, mask.sum()))
            per_doc = [
                float(np.sum(r[m], dtype=np.float64) / max(1, m.sum()))
                for r, m in zip(losses, mask)
            ]
            results.append(
                dict(
                    entry,
                    loss=mean,
                    perplexity=math.exp(mean),
                    buckets=bucket_losses(losses, mask, n_buckets),
                    document_losses=per_doc,
                )
            )
            log.info(
                "length %d: %d documents (%d shorter skipped), loss %.4f",
                length,
                len(w["tokens"]),
                w["skipped"],
                mean,
            )
        if measured:
            measured(dict(lengths=list(results)))
    return dict(lengths=results)


# -- report --------------------------------------------------------------------------------


def markdown_table(result: dict, n_buckets: int) -> str:
    """Rows = lengths; columns = documents, skipped, the mean loss of each position bucket
    (share of the length), the whole length's loss and perplexity."""
    heads = report.depth_labels(n_buckets)
    lines = [
        "| length | documents | skipped (shorter) | " + " | ".join(heads) + " | all | perplexity |",
        "| --- | --- | --- | " + " | ".join("---" for _ in heads) + " | --- | --- |",
    ]
    for r in result["lengths"]:
        if r["loss"] is None:
            cells = " | ".join("-" for _ in heads) + " | - | -"
        else:
            cells = (
                " | ".join(f"{b['loss']:.4f}" for b in r["buckets"])
                + f" | {r['loss']:.4f} | {r['perplexity']:.2f}"
            )
        lines.append(
            f"| {format_tokens(r['length'])} | {r['documents']} | {r['skipped']} | {cells} |"
        )
    lines += [
        f"\n**{no_document_line(dict(r, longest=r['longest_skipped']))}**"
        for r in result["lengths"]
        if r["loss"] is None
    ]
    if result.get("complete") is False:
        lines.append(
            f"\n**incomplete: the lengths measured so far ({len(result['lengths'])});"
            " the run goes on or stopped**"
        )
    return "\n".join(lines)


def draw(path: str, result: dict, title: str, trained: int | None) -> None:
    """Mean loss against position (bucket middles), one line per length; the trained
    length dashed."""
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for r in result["lengths"]:
        if r["buckets"]:
            ax.plot(
                [(b["lo"] + b["hi"]) / 2 for b in r["buckets"]],
                [b["loss"] for b in r["buckets"]],
                marker="o",
                label=f"{format_tokens(r['length'])} ({r['documents']} docs)",
            )
    if trained:
        ax.axvline(trained, color="grey", linestyle="--", label=f"trained length {trained}")
    missing = [format_tokens(r["length"]) for r in result["lengths"] if r["loss"] is None]
    if missing:
        ax.text(
            0.5,
            0.5,
            f"no document of --data is long enough for {', '.join(missing)}:\n"
            "nothing measured there",
            transform=ax.transAxes,
            ha="center",
            va="center",
            color="darkred",
            fontsize=9,
            fontweight="bold",
        )
    ax.set_xlabel("token position")
    ax.set_ylabel("mean token loss")
    ax.set_title(title, fontsize=9)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    report.save_png(path, fig)


def write_report(out_dir: str, result: dict, n_buckets: int, meta: dict) -> None:
    report.write_files(
        out_dir,
        TASK,
        markdown_table(result, n_buckets),
        dict(meta, **result),
        lambda path: draw(
            path, result, f"loss by position: {meta['model']}", meta.get("trained_length")
        ),
    )


# -- command line --------------------------------------------------------------------------


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--data",
        default=DEFAULT_DATA,
        help="held-out documents: a .jsonl/.json/.txt/.parquet/.arrow file, a "
        "directory or glob of them, a lclm.data.prepare directory, or one "
        "[kind:]path source of the data.path syntax (e.g. code-heldout:DIR, "
        "the held-out packages of a code directory); default: those of this "
        "Python's standard library, whose documents run to thousands of "
        "tokens, %(default)s",
    )
    ap.add_argument("--text-field", default="text", help="the documents' text field")
    report.add_lengths_argument(ap)
    ap.add_argument(
        "--buckets",
        type=int,
        default=8,
        help="equal ranges the positions 0..L-1 are cut into (at most the shortest length)",
    )
    ap.add_argument(
        "--documents",
        type=int,
        default=16,
        help="documents per length (the first long enough ones)",
    )
    ap.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="rows per forward (default 1; rounded up to the mesh's dp x fsdp)",
    )


def parse_args(argv=None, prog: str | None = None):
    return report.parse_task_args(__doc__, TASK, add_arguments, argv, prog)


def data_source(flag: str, text: str) -> SourceEntry:
    """The one `[kind:]path` source --data names (the data.path syntax, 'text' by default);
    one that names nothing is one line before the model loads."""
    check_input(flag, text)
    entries = parse_sources(text, "text", flag.lstrip("-"))
    if len(entries) != 1:
        raise StartupError(f"{flag} {text!r} names {len(entries)} sources; evaluate one at a time")
    (entry,) = entries
    if get_kind(entry.kind).path == DIRECTORY:
        if not os.path.isdir(entry.path):
            raise StartupError(f"{flag} {text!r}: {entry.path!r} is not a directory")
    elif not is_tokenized_dir(entry.path):
        try:
            resolve_files(entry.path)
        except FileNotFoundError as e:
            # the sources word it for training (config.data.path); here the flag is meant
            raise StartupError(
                f"{flag} {text!r}: " + str(e).replace("config.data.path", flag)
            ) from None
    return entry


def main(argv=None, prog: str | None = None) -> int:
    return report.run_task(parse_args(argv, prog), _run)


def _run(args) -> int:
    report.check_model_args(args, ("buckets", "documents", "batch_size"))
    source = data_source("--data", args.data)
    given = report.explicit_lengths(args)
    check_buckets(given or [], args.buckets)
    model, saved = load_model(args)
    lengths = report.task_lengths(given, model, saved)
    check_buckets(lengths, args.buckets)
    stats = SourceStats()
    docs = open_documents(
        source.kind, source.path, model.tokenizer, text_field=args.text_field, stats=stats
    )
    meta = lambda: dict(
        report.model_meta(model),
        data=args.data,
        buckets=args.buckets,
        trained_length=report.trained_length(model, saved),
        malformed_records=stats.skipped,
    )
    written: list[str] = []

    def write_so_far(partial: dict) -> None:
        """The report of the lengths measured so far (the last one's is written below)."""
        if len(partial["lengths"]) == len(lengths):
            return
        try:
            write_report(
                args.out,
                dict(partial, complete=False),
                args.buckets,
                dict(meta(), lengths_asked=lengths),
            )
        except OSError as e:
            log.warning(
                "could not write the report so far into %s (%s); it is tried again "
                "after the next length",
                args.out,
                e.strerror or e,
            )
        else:
            written[:] = [format_tokens(r["length"]) for r in partial["lengths"]]

    try:
        result = evaluate(
            model,
            docs,
            lengths,
            n_buckets=args.buckets,
            max_docs=args.documents,
            batch_size=args.batch_size,
            measured=write_so_far,
        )
    except BaseException:
        if written:
            print(
                f"note: the report of the lengths measured before this ({', '.join(written)})"
                f" is in {args.out}",
                file=sys.stderr,
                flush=True,
            )
        raise
    if stats.skipped:
        log.warning("--data: %s", stats.summary())
    result = dict(result, complete=True)
    print(markdown_table(result, args.buckets), flush=True)
    return report.save_report(
        args.out,
        TASK,
        lambda folder: write_report(
            folder, result, args.buckets, dict(meta(), lengths_asked=lengths)
        ),
        lost="the per-document losses and the plot are lost",
    )


if __name__ == "__main__":
    sys.exit(main())

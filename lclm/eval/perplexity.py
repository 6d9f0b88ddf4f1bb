"""Loss (and perplexity) by token position over held-out long documents.

    python -m lclm.eval perplexity --checkpoint WORKDIR --data heldout.jsonl --lengths 4k,16k
    python -m lclm.eval perplexity --hf HF_DIR --data books/ --lengths 32k,128k --sp 8

For each of `--lengths` L, the first `--documents` documents of `--data` holding at least
L + 1 tokens are cut to their first L + 1: the model reads tokens 0..L-1 and the loss at
position p is that of predicting token p + 1 from tokens 0..p. Shorter documents are
skipped and counted (the table and JSON say how many, per length). `--data` is read by the
training data sources (`lclm.data.sources`: .jsonl/.json/.txt/.parquet/.arrow files, a
directory or glob of them, a `lclm.data.prepare` directory), documents in file order;
targets a document does not train on (chat prompts) are left out, as in training's loss.

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
length, each document's mean loss) and `OUT/perplexity.png` (loss against position).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys

import numpy as np

from lclm.config.syntax import format_tokens, parse_lengths
from lclm.data.code import CODE_KINDS
from lclm.data.loader import SourceEntry, parse_sources
from lclm.data.sources import SourceStats, is_tokenized_dir, open_documents, resolve_files
from lclm.errors import StartupError
from lclm.eval import report
from lclm.eval.decode import padded_length
from lclm.eval.model import Model, load_model
from lclm.eval.retrieval import batch_rows
from lclm.eval.token_loss import losses_in_order
from lclm.files import check_input

TASK = "perplexity"
log = logging.getLogger(__name__)


# -- documents (host side) -----------------------------------------------------------------

def windows(docs, lengths: list[int], max_docs: int) -> dict[int, dict]:
    """For each length L: {'tokens': [n, L+1] int32 and 'mask': [n, L] (whether target p is
    one training would learn) of the first `max_docs` documents of at least L + 1 tokens,
    in order, and 'skipped': how many shorter documents were passed over}. One pass over
    the documents, stopping once every length has its `max_docs`."""
    tokens_of: dict[int, list[np.ndarray]] = {n: [] for n in lengths}
    masks_of: dict[int, list[np.ndarray]] = {n: [] for n in lengths}
    skipped = dict.fromkeys(lengths, 0)
    for i in range(len(docs)):
        if all(len(t) >= max_docs for t in tokens_of.values()):
            break
        doc = docs[i]
        if doc is None:   # a malformed record (counted by the source's SourceStats)
            continue
        tokens, loss = doc
        for n in lengths:
            if len(tokens_of[n]) >= max_docs:
                continue
            if len(tokens) < n + 1:
                skipped[n] += 1
            else:
                tokens_of[n].append(np.asarray(tokens[:n + 1], np.int32))
                masks_of[n].append(np.asarray(loss[1:n + 1], bool))
    return {n: dict(tokens=np.asarray(tokens_of[n], np.int32).reshape(-1, n + 1),
                    mask=np.asarray(masks_of[n], bool).reshape(-1, n), skipped=skipped[n])
            for n in lengths}


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


def row_length(model: Model, length: int) -> int:
    """The smallest row length >= `length` that the mesh's `sp`, the attention and FFN
    chunks (`decode.padded_length`) and the loss chunk divide."""
    sp = model.mesh.shape["sp"]
    p = padded_length(length, sp, model.config.ffn_chunk, model.attention)
    while (p // sp) % min(model.config.loss_chunk, p // sp):
        p = padded_length(p + 1, sp, model.config.ffn_chunk, model.attention)
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
        out.append(dict(bucket=b, lo=int(np.flatnonzero(cols)[0]),
                        hi=int(np.flatnonzero(cols)[-1]) + 1, tokens=count, loss=mean,
                        perplexity=math.exp(mean) if count else float("nan")))
    return out


def position_losses(model: Model, windows_: np.ndarray, batch_size: int) -> np.ndarray:
    """Float32 losses `[n, L]` in original order of windows `[n, L+1]`, `batch_size` rows
    per forward (the last batch filled up with copies of its last window)."""
    length = windows_.shape[1] - 1
    row_len = row_length(model, length)
    out = []
    for start in range(0, len(windows_), batch_size):
        group = windows_[start:start + batch_size]
        n = len(group)
        group = np.concatenate([group, np.repeat(group[-1:], batch_size - n, axis=0)])
        losses = losses_in_order(model.config, model.attention, model.mesh, model.params,
                                 rows_of(group, row_len))
        out.append(losses[:n, :length])
    return np.concatenate(out)


def evaluate(model: Model, docs, lengths: list[int], *, n_buckets: int, max_docs: int,
             batch_size: int | None = None) -> dict:
    """{'lengths': [per length: documents, skipped, loss, perplexity, buckets, the
    documents' mean losses]}; one log line per length."""
    rows = batch_rows(model, batch_size)
    results = []
    for length, w in windows(docs, lengths, max_docs).items():
        entry = dict(length=length, documents=len(w["tokens"]), skipped=w["skipped"])
        if not len(w["tokens"]):
            log.warning("length %d: no document of %d tokens or more (%d shorter skipped)",
                        length, length + 1, w["skipped"])
            results.append(dict(entry, loss=None, perplexity=None, buckets=[],
                                document_losses=[]))
            continue
        losses = position_losses(model, w["tokens"], rows)
        mask = w["mask"]
        mean = float(np.sum(losses[mask], dtype=np.float64) / max(1, mask.sum()))
        per_doc = [float(np.sum(r[m], dtype=np.float64) / max(1, m.sum()))
                   for r, m in zip(losses, mask)]
        results.append(dict(entry, loss=mean, perplexity=math.exp(mean),
                            buckets=bucket_losses(losses, mask, n_buckets),
                            document_losses=per_doc))
        log.info("length %d: %d documents (%d shorter skipped), loss %.4f", length,
                 len(w["tokens"]), w["skipped"], mean)
    return dict(lengths=results)


# -- report --------------------------------------------------------------------------------

def markdown_table(result: dict, n_buckets: int) -> str:
    """Rows = lengths; columns = documents, skipped, the mean loss of each position bucket
    (share of the length), the whole length's loss and perplexity."""
    heads = report.depth_labels(n_buckets)
    lines = ["| length | documents | skipped (shorter) | " + " | ".join(heads)
             + " | all | perplexity |",
             "| --- | --- | --- | " + " | ".join("---" for _ in heads) + " | --- | --- |"]
    for r in result["lengths"]:
        if r["loss"] is None:
            cells = " | ".join("-" for _ in heads) + " | - | -"
        else:
            cells = (" | ".join(f"{b['loss']:.4f}" for b in r["buckets"])
                     + f" | {r['loss']:.4f} | {r['perplexity']:.2f}")
        lines.append(f"| {format_tokens(r['length'])} | {r['documents']} | "
                     f"{r['skipped']} | {cells} |")
    return "\n".join(lines)


def draw(path: str, result: dict, title: str, trained: int | None) -> None:
    """Mean loss against position (bucket middles), one line per length; the trained
    length dashed."""
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for r in result["lengths"]:
        if r["buckets"]:
            ax.plot([(b["lo"] + b["hi"]) / 2 for b in r["buckets"]],
                    [b["loss"] for b in r["buckets"]], marker="o",
                    label=f"{format_tokens(r['length'])} ({r['documents']} docs)")
    if trained:
        ax.axvline(trained, color="grey", linestyle="--", label=f"trained length {trained}")
    ax.set_xlabel("token position")
    ax.set_ylabel("mean token loss")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    report.save_png(path, fig)


def write_report(out_dir: str, result: dict, n_buckets: int, meta: dict) -> None:
    report.write_files(out_dir, TASK, markdown_table(result, n_buckets), dict(meta, **result),
                       lambda path: draw(path, result, f"loss by position: {meta['model']}",
                                         meta.get("trained_length")))


# -- command line --------------------------------------------------------------------------

def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--data", required=True,
                    help="held-out documents: a .jsonl/.json/.txt/.parquet/.arrow file, a "
                         "directory or glob of them, a lclm.data.prepare directory, or one "
                         "[kind:]path source of the data.path syntax (e.g. code-heldout:DIR, "
                         "the held-out packages of a code directory)")
    ap.add_argument("--text-field", default="text", help="the documents' text field")
    ap.add_argument("--lengths", default="2k,4k,8k", help="comma-separated, e.g. 512,2k,4k")
    ap.add_argument("--buckets", type=int, default=8, help="equal position ranges")
    ap.add_argument("--documents", type=int, default=16,
                    help="documents per length (the first long enough ones)")
    ap.add_argument("--batch-size", type=int, default=None,
                    help="rows per forward (rounded up to the mesh's dp x fsdp)")


def parse_args(argv=None, prog: str | None = None):
    return report.parse_task_args(__doc__, TASK, add_arguments, argv, prog)


def data_source(flag: str, text: str) -> SourceEntry:
    """The one `[kind:]path` source --data names (the data.path syntax, 'text' by default);
    one that names nothing is one line before the model loads."""
    check_input(flag, text)
    entries = parse_sources(text, "text", flag.lstrip("-"))
    if len(entries) != 1:
        raise StartupError(f"{flag} {text!r} names {len(entries)} sources; evaluate one at a "
                           "time")
    (entry,) = entries
    if entry.kind in CODE_KINDS:
        if not os.path.isdir(entry.path):
            raise StartupError(f"{flag} {text!r}: {entry.path!r} is not a directory")
    elif not is_tokenized_dir(entry.path):
        try:
            resolve_files(entry.path)
        except FileNotFoundError as e:
            # the sources word it for training (config.data.path); here the flag is meant
            raise StartupError(f"{flag} {text!r}: "
                               + str(e).replace("config.data.path", flag)) from None
    return entry


def main(argv=None, prog: str | None = None) -> int:
    return report.run_task(parse_args(argv, prog), _run)


def _run(args) -> int:
    report.check_model_args(args, ("buckets", "documents", "batch_size"))
    source = data_source("--data", args.data)
    lengths = parse_lengths(args.lengths)
    model, saved = load_model(args)
    stats = SourceStats()
    docs = open_documents(source.kind, source.path, model.tokenizer,
                          text_field=args.text_field, stats=stats)
    result = evaluate(model, docs, lengths, n_buckets=args.buckets, max_docs=args.documents,
                      batch_size=args.batch_size)
    if stats.skipped:
        log.warning("--data: %s", stats.summary())
    trained = saved.get("data", {}).get("seq_len") if saved else None
    meta = dict(model=model.name, mesh=dict(model.mesh.shape), layout=model.attention.layout,
                strategy=model.attention.strategy, data=args.data, buckets=args.buckets,
                trained_length=trained, malformed_records=stats.skipped)
    print(markdown_table(result, args.buckets), flush=True)
    return report.save_report(args.out, TASK,
                              lambda folder: write_report(folder, result, args.buckets, meta),
                              lost="the per-document losses and the plot are lost")


if __name__ == "__main__":
    sys.exit(main())

"""Line-retrieval accuracy per context length and needle depth (Ring Attention, section 5.3).

    python -m lclm.eval.line_retrieval --checkpoint WORKDIR --lengths 2k,4k,8k --samples 10
    python -m lclm.eval.line_retrieval --hf HF_DIR --format paper --lengths 4k,16k --sp 4

Each prompt is a document of numbered lines holding random numbers, ending with a question
for one line (`lclm.data.line_retrieval`, the format the tiny config trains on). The asked
line is drawn from one of `--depths` equal bins of the document, `--samples` prompts per
(length, bin). A prompt is prefilled with the same striped ring attention as training, on
the mesh given by the flags (default: the checkpoint's), then decoded greedily with a KV
cache (`lclm.eval.decode`); the answer is the first number in the generated text.

Lengths and padding. A prompt built for length L holds at most L tokens (the example is L
tokens with its answer, so the prompt is L minus the answer's). The ring needs a sequence
that `sp` and the attention/feed-forward chunks divide, so each row is padded at the FRONT
to the next such length with a separate pad segment: segment ids keep the padding and the
document apart (the pad tokens are never attended to), positions start at 0 at the
document's first token (as in training's packed rows), and the prompt's last token is the
row's last, where decoding continues.

Writes a markdown table to stdout and `OUT/line_retrieval.md`, `OUT/line_retrieval.json`
(cells and per-sample answers) and `OUT/line_retrieval.png` (accuracy heatmap). OUT is checked
before the model is loaded; the table is printed before the files are written, and a write
that still fails (a disk filled meanwhile) puts the report in a temporary folder and says
where (exit status 1). Loading reads Orbax tensors, JSON, safetensors and a SentencePiece
model only: nothing is unpickled.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import sys
import tempfile

import numpy as np

from lclm import logs
from lclm.cli import run_cli
from lclm.config.syntax import parse_lengths
from lclm.data.line_retrieval import (
    Spec,
    build_example,
    filler_id,
    line_format,
    parse_answer,
    spec_of_config,
)
from lclm.errors import StartupError
from lclm.eval.decode import greedy_generate, pad_front, padded_length
from lclm.eval.model import Model, add_model_arguments, answer_text, load_model
from lclm.files import check_input, output_problem, replacing, write_json

log = logging.getLogger(__name__)


# -- lengths and prompts (host side, numpy only) -------------------------------------------

def format_length(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def make_examples(tokenizer, length: int, n_bins: int, samples: int, fmt, seed: int):
    """`samples` examples of `length` tokens for each depth bin: [(bin, Example)], each
    deterministic from (seed, length, bin, sample)."""
    out = []
    for b in range(n_bins):
        for i in range(samples):
            rng = np.random.default_rng([seed, length, b, i])
            out.append((b, build_example(tokenizer, rng, length, fmt, depth_bin=b,
                                         n_bins=n_bins)))
    return out


# -- evaluation ----------------------------------------------------------------------------

def generate_answers(model: Model, prompts: list[np.ndarray], max_new: int,
                     batch_size: int) -> tuple[list[str], int]:
    """Greedy answers (text up to EOS) of token prompts, `batch_size` rows per prefill, and
    the padded length all rows shared (see the module docstring). The last batch is filled
    up with copies of its last prompt so that the mesh's batch axes divide it.
    """

    length = padded_length(max(map(len, prompts)), model.mesh.shape["sp"],
                           model.config.ffn_chunk, model.attention)
    pad = filler_id(model.tokenizer)  # any id: the pad segment is never attended to
    answers: list[str] = []
    for start in range(0, len(prompts), batch_size):
        group = prompts[start:start + batch_size]
        n = len(group)
        rows = pad_front(group + [group[-1]] * (batch_size - n), length, pad)
        ids = greedy_generate(model.config, model.attention, model.params, *rows, max_new,
                              mesh=model.mesh)
        answers.extend(answer_text(model.tokenizer, row) for row in ids[:n])
    return answers, length


def _cell(records: list[dict], length: int, b: int, n_bins: int) -> dict:
    mine = [r for r in records if r["length"] == length and r["depth_bin"] == b]
    correct = sum(r["correct"] for r in mine)
    return dict(length=length, depth_bin=b, depth_lo=b / n_bins, depth_hi=(b + 1) / n_bins,
                n=len(mine), correct=correct, accuracy=correct / len(mine),
                prompt_tokens=int(np.mean([r["prompt_tokens"] for r in mine])),
                padded_to=mine[0]["padded_to"])


def evaluate(model: Model, lengths, *, samples: int, n_bins: int, fmt, seed: int = 0,
             batch_size: int | None = None, max_new: int | None = None) -> dict:
    """Accuracy per (length, depth bin): {'cells': [...], 'samples': [...]} (one record per
    prompt: asked line, depth, expected and generated answer)."""

    rows = model.mesh.shape["dp"] * model.mesh.shape["fsdp"]  # the batch axes
    batch_size = rows * max(1, -(-(batch_size or 1) // rows))
    max_new = max_new or fmt.digits + 3  # the leading '▁' (a space), digits, EOS, slack
    cells, records = [], []
    for length in lengths:
        examples = make_examples(model.tokenizer, length, n_bins, samples, fmt, seed)
        prompts = [ex.tokens[:ex.prompt_len] for _, ex in examples]
        answers, padded = generate_answers(model, prompts, max_new, batch_size)
        for (b, ex), text in zip(examples, answers):
            records.append(dict(length=length, depth_bin=b, depth=round(ex.depth, 4),
                                key=ex.key, lines=ex.n_lines, prompt_tokens=ex.prompt_len,
                                padded_to=padded, answer=ex.answer, output=text,
                                correct=parse_answer(text) == ex.answer))
        cells += [_cell(records, length, b, n_bins) for b in range(n_bins)]
        log.info("length %d: accuracy %.3f", length,
                 np.mean([r["correct"] for r in records if r["length"] == length]))
    return dict(cells=cells, samples=records)


def accuracy_grid(cells, lengths, n_bins: int) -> np.ndarray:
    """Accuracy `[n_bins, len(lengths)]` from the cells."""
    grid = np.full((n_bins, len(lengths)), np.nan)
    for c in cells:
        grid[c["depth_bin"], lengths.index(c["length"])] = c["accuracy"]
    return grid


def markdown_table(cells, lengths, n_bins: int) -> str:
    """Rows = lengths, columns = depth bins, then the length's mean accuracy."""
    grid = accuracy_grid(cells, lengths, n_bins)
    bins = [f"{100 * b // n_bins}-{100 * (b + 1) // n_bins}%" for b in range(n_bins)]
    lines = ["| length | prompt tokens | " + " | ".join(bins) + " | all |",
             "| --- | --- | " + " | ".join("---" for _ in bins) + " | --- |"]
    for j, length in enumerate(lengths):
        mine = [c for c in cells if c["length"] == length]
        tokens = int(np.mean([c["prompt_tokens"] for c in mine]))
        mean = sum(c["correct"] for c in mine) / sum(c["n"] for c in mine)
        accs = " | ".join(f"{grid[b, j]:.2f}" for b in range(n_bins))
        lines.append(f"| {format_length(length)} | {tokens} | {accs} | {mean:.2f} |")
    return "\n".join(lines)


def save_heatmap(path: str, cells, lengths, n_bins: int, title: str) -> None:
    """Accuracy heatmap PNG: x = context length, y = needle depth."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    grid = accuracy_grid(cells, lengths, n_bins)
    fig, ax = plt.subplots(figsize=(1.2 * len(lengths) + 2.5, 0.5 * n_bins + 1.8))
    im = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(lengths)), [format_length(n) for n in lengths])
    ax.set_yticks(range(n_bins), [f"{100 * b // n_bins}-{100 * (b + 1) // n_bins}%"
                                  for b in range(n_bins)])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("depth of the asked line")
    for b in range(n_bins):
        for j in range(len(lengths)):
            ax.text(j, b, f"{grid[b, j]:.2f}", ha="center", va="center", fontsize=8)
    fig.colorbar(im, ax=ax, label="accuracy")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    with replacing(path, binary=True) as f:
        fig.savefig(f, dpi=120, format="png")
    plt.close(fig)


def write_report(out_dir: str, result: dict, lengths, n_bins: int, meta: dict) -> str:
    """Write table, JSON and PNG into `out_dir`; returns the markdown table."""
    os.makedirs(out_dir, exist_ok=True)
    table = markdown_table(result["cells"], lengths, n_bins)
    with replacing(os.path.join(out_dir, "line_retrieval.md")) as f:
        f.write(table + "\n")
    write_json(os.path.join(out_dir, "line_retrieval.json"),
               dict(meta, lengths=lengths, depth_bins=n_bins, **result))
    save_heatmap(os.path.join(out_dir, "line_retrieval.png"), result["cells"], lengths, n_bins,
                 f"line retrieval: {meta['model']}")
    return table


# -- command line --------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(ap)
    ap.add_argument("--lengths", default="2k,4k,8k", help="comma-separated, e.g. 512,2k,4k")
    ap.add_argument("--samples", type=int, default=10, help="prompts per (length, depth bin)")
    ap.add_argument("--depths", type=int, default=5, help="number of needle-depth bins")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--format", help="line format (default: the run's line_retrieval data, "
                                     "else 'compact')")
    ap.add_argument("--digits", type=int, help="digits of the numbers (default: as --format)")
    ap.add_argument("--batch-size", type=int, default=None,
                    help="prompts per prefill (rounded up to the mesh's dp x fsdp)")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="tokens decoded per prompt (default: digits + 3)")
    ap.add_argument("--out", help="output directory (default: line_retrieval_eval/ in the "
                                   "checkpoint's workdir; runs/line_retrieval_eval/<name> "
                                   "with --hf)")
    args = ap.parse_args(argv)
    args.default_out = args.out is None
    if args.out is None:  # beside what was evaluated, never in the current directory
        args.out = (os.path.join(args.checkpoint, "line_retrieval_eval") if args.checkpoint else
                    os.path.join("runs", "line_retrieval_eval",
                                 os.path.basename(os.path.normpath(args.hf))))
    return args


def _line_format(args, saved: dict | None):
    spec = spec_of_config(saved.get("data", {})) if saved else None
    spec = spec or Spec()
    return line_format(args.format or spec.format, args.digits or spec.digits)


def _check_args(args) -> None:
    """Flags that would fail only after the model is loaded, or at the very end (--out), or
    as a misleading 'not found' (an object-store input looked up as a local path)."""
    for flag in ("checkpoint", "hf", "tokenizer"):
        check_input(f"--{flag}", getattr(args, flag))
    for name in ("samples", "depths", "batch_size", "max_new_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise StartupError(f"--{name.replace('_', '-')}={value} must be >= 1")
    if args.default_out and args.checkpoint and not os.path.isdir(args.checkpoint):
        return  # the default lies inside it: 'no checkpoints in ...' is the line that helps
    problem = output_problem(args.out)
    if problem:
        flag = "the default --out" if args.default_out else "--out"
        raise StartupError(f"{flag} {args.out!r} {problem}")


def main(argv=None) -> int:
    args = parse_args(argv)
    logs.configure()
    return run_cli(lambda: _run(args), input_errors=(ValueError,))  # e.g. a prompt too long


def _run(args) -> int:
    _check_args(args)
    lengths = parse_lengths(args.lengths)
    model, saved = load_model(args)
    fmt = _line_format(args, saved)
    result = evaluate(model, lengths, samples=args.samples, n_bins=args.depths, fmt=fmt,
                      seed=args.seed, batch_size=args.batch_size, max_new=args.max_new_tokens)
    meta = dict(model=model.name, mesh=dict(model.mesh.shape), layout=model.attention.layout,
                format=dataclasses.asdict(fmt), samples_per_cell=args.samples, seed=args.seed)
    print(markdown_table(result["cells"], lengths, args.depths), flush=True)
    return save_report(args.out, result, lengths, args.depths, meta)


def save_report(out_dir: str, result: dict, lengths, n_bins: int, meta: dict) -> int:
    """`write_report` into `out_dir` (0), or, where that fails although it was checked at
    start (a disk filled during the evaluation), into a new temporary folder: one line on
    stderr says why and where the report went (1). The table is on stdout already."""
    try:
        write_report(out_dir, result, lengths, n_bins, meta)
    except OSError as e:
        why = f"could not write the report into --out {out_dir!r} ({e.strerror or e})"
    else:
        print(f"wrote {out_dir}/line_retrieval.{{md,json,png}}")
        return 0
    fallback = None
    try:
        fallback = tempfile.mkdtemp(prefix="line_retrieval_eval_")
        write_report(fallback, result, lengths, n_bins, meta)
        kept = f"the table is printed above and the report was written to {fallback}"
    except OSError:
        if fallback:
            shutil.rmtree(fallback, ignore_errors=True)
        kept = "the table is printed above; the per-sample answers and the heatmap are lost"
    print(f"error: {why}; {kept}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())

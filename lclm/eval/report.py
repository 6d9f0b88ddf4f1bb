"""What every evaluation task shares about its report: where it goes (`--out`, checked before
the model loads), how it is written (`OUT/<task>.md`, `.json` and `.png`, each replaced
atomically) and what happens when writing fails after the evaluation (a temporary folder),
plus the accuracy-by-(length, depth) table and heatmap of the retrieval tasks.

Cells of the retrieval tasks are dicts with `length`, `depth_bin`, `n`, `correct`,
`accuracy` and `prompt_tokens` (see `lclm.eval.retrieval.cell`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections.abc import Callable

import numpy as np

from lclm import logs, storage
from lclm.cli import run_cli
from lclm.config.syntax import format_tokens
from lclm.errors import StartupError
from lclm.eval.model import add_model_arguments
from lclm.files import check_input, output_problem, replacing, write_json

# -- the command line of a task --------------------------------------------------------------

def parse_task_args(doc: str, task: str, add_arguments: Callable[[argparse.ArgumentParser], None],
                    argv=None, prog: str | None = None) -> argparse.Namespace:
    """A task's flags: the model's (`add_model_arguments`), its own, and `--out` (defaulted
    after parsing: `set_out`)."""
    ap = argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0])
    add_model_arguments(ap)
    add_arguments(ap)
    ap.add_argument("--out", help=f"output directory (default: {task}_eval/ in the "
                                   f"checkpoint's workdir; runs/{task}_eval/<name> with --hf)")
    args = ap.parse_args(argv)
    set_out(args, task)
    return args


def run_task(args, run: Callable[[argparse.Namespace], int]) -> int:
    """`run(args)` as a command: bad input (a prompt too long, ...) is one line, exit 2."""
    logs.configure()
    return run_cli(lambda: run(args), input_errors=(ValueError,))


# -- --out -------------------------------------------------------------------------------

def default_out(args, task: str) -> str:
    """`<task>_eval/` inside the checkpoint's workdir, `runs/<task>_eval/<name>` with --hf:
    beside what was evaluated, never in the current directory."""
    folder = f"{task}_eval"
    if args.checkpoint:
        return storage.join(args.checkpoint, folder)
    return os.path.join("runs", folder, os.path.basename(os.path.normpath(args.hf)))


def set_out(args, task: str) -> None:
    """Fill `args.out` (default: `default_out`) and `args.default_out` after parsing."""
    args.default_out = args.out is None
    if args.out is None:
        args.out = default_out(args, task)


def check_model_args(args, positive: tuple[str, ...] = ()) -> None:
    """Start-up checks for the flags of `add_model_arguments` and `--out`, before the model
    loads: object-store inputs, the `positive` flags (attribute names) >= 1, and an --out
    that could not be written (after an hour of evaluation is too late to find out)."""
    for flag in ("checkpoint", "hf", "tokenizer"):
        check_input(f"--{flag}", getattr(args, flag))
    for name in positive:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise StartupError(f"--{name.replace('_', '-')}={value} must be >= 1")
    if args.default_out and args.checkpoint and not storage.isdir(args.checkpoint):
        return  # the default lies inside it: 'no checkpoints in ...' is the line that helps
    problem = output_problem(args.out, remote=True)
    if problem:
        flag = "the default --out" if args.default_out else "--out"
        raise StartupError(f"{flag} {args.out!r} {problem}")


# -- writing -----------------------------------------------------------------------------

def write_files(out_dir: str, task: str, table: str, payload: dict,
                draw: Callable[[str], None]) -> None:
    """`OUT/<task>.md` (the table), `.json` (payload) and `.png` (`draw(path)` writes it); a
    gs:// or s3:// OUT gets one object each (`replacing`)."""
    storage.makedirs(out_dir)
    with replacing(storage.join(out_dir, f"{task}.md")) as f:
        f.write(table + "\n")
    write_json(storage.join(out_dir, f"{task}.json"), payload)
    draw(storage.join(out_dir, f"{task}.png"))


def save_report(out_dir: str, task: str, write: Callable[[str], object],
                lost: str = "the per-sample answers and the heatmap are lost") -> int:
    """`write(folder)` into `out_dir` (0), or, where that fails although --out was checked at
    start (a disk filled during the evaluation), into a new temporary folder: one line on
    stderr says why and where the report went (1). The table is on stdout already; `lost`
    says what is gone when no folder can be written."""
    try:
        write(out_dir)
    except OSError as e:
        why = f"could not write the report into --out {out_dir!r} ({e.strerror or e})"
    else:
        print(f"wrote {out_dir}/{task}.{{md,json,png}}")
        return 0
    fallback = None
    try:
        fallback = tempfile.mkdtemp(prefix=f"{task}_eval_")
        write(fallback)
        kept = f"the table is printed above and the report was written to {fallback}"
    except OSError:
        if fallback:
            shutil.rmtree(fallback, ignore_errors=True)
        kept = f"the table is printed above; {lost}"
    print(f"error: {why}; {kept}", file=sys.stderr)
    return 1


def save_png(path: str, fig) -> None:
    """A matplotlib figure as a PNG at `path`, replaced atomically; the figure is closed."""
    import matplotlib.pyplot as plt  # after the caller chose the Agg backend

    with replacing(path, binary=True) as f:
        fig.savefig(f, dpi=120, format="png")
    plt.close(fig)


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (no display is ever opened)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


# -- accuracy by length and depth (passkey, needle, line retrieval) ------------------------

def depth_labels(n_bins: int) -> list[str]:
    return [f"{100 * b // n_bins}-{100 * (b + 1) // n_bins}%" for b in range(n_bins)]


def accuracy_grid(cells, lengths, n_bins: int) -> np.ndarray:
    """Accuracy `[n_bins, len(lengths)]` from the cells."""
    grid = np.full((n_bins, len(lengths)), np.nan)
    for c in cells:
        grid[c["depth_bin"], lengths.index(c["length"])] = c["accuracy"]
    return grid


def accuracy_table(cells, lengths, n_bins: int) -> str:
    """Rows = lengths, columns = depth bins, then the length's mean accuracy."""
    grid = accuracy_grid(cells, lengths, n_bins)
    bins = depth_labels(n_bins)
    lines = ["| length | prompt tokens | " + " | ".join(bins) + " | all |",
             "| --- | --- | " + " | ".join("---" for _ in bins) + " | --- |"]
    for j, length in enumerate(lengths):
        mine = [c for c in cells if c["length"] == length]
        tokens = int(np.mean([c["prompt_tokens"] for c in mine]))
        mean = sum(c["correct"] for c in mine) / sum(c["n"] for c in mine)
        accs = " | ".join(f"{grid[b, j]:.2f}" for b in range(n_bins))
        lines.append(f"| {format_tokens(length)} | {tokens} | {accs} | {mean:.2f} |")
    return "\n".join(lines)


def accuracy_heatmap(path: str, cells, lengths, n_bins: int, title: str,
                     depth_of: str = "the needle") -> None:
    """Accuracy heatmap PNG: x = context length, y = depth bin."""
    plt = pyplot()
    grid = accuracy_grid(cells, lengths, n_bins)
    fig, ax = plt.subplots(figsize=(1.2 * len(lengths) + 2.5, 0.5 * n_bins + 1.8))
    im = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(lengths)), [format_tokens(n) for n in lengths])
    ax.set_yticks(range(n_bins), depth_labels(n_bins))
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(f"depth of {depth_of}")
    for b in range(n_bins):
        for j in range(len(lengths)):
            ax.text(j, b, f"{grid[b, j]:.2f}", ha="center", va="center", fontsize=8)
    fig.colorbar(im, ax=ax, label="accuracy")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    save_png(path, fig)

"""What every evaluation task shares: its command line (the module's docstring as --help's
description, every flag's default shown, `--lengths` defaulting to the trained length x1, x2
and x4), where its report goes (`--out`, checked before the model loads; by default a new
timestamped folder, so that no run replaces another's report), how it is written
(`OUT/<task>.md`, `.json` and `.png`, each replaced atomically) and what happens when
writing fails after the evaluation (a temporary folder), plus the accuracy-by-(length,
depth) table and heatmap of the retrieval tasks.

Cells of the retrieval tasks are dicts with `length`, `depth_bin`, `n`, `correct`,
`accuracy` and `prompt_tokens` (see `lclm.eval.retrieval.cell`).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np

from lclm import logs, storage
from lclm.cli import run_cli
from lclm.config.syntax import format_tokens, parse_lengths
from lclm.errors import StartupError
from lclm.eval.model import LoadedModel, add_model_arguments
from lclm.workdir.resume import CONVERTED_FROM
from lclm.writes import check_input, output_problem, replacing, write_json

log = logging.getLogger(__name__)

# -- the command line of a task --------------------------------------------------------------


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help with the task's docstring as written (its examples keep their lines) and every
    flag's default: '(default: X)' is added to a flag's help unless the help already says
    its default in words or there is none (None, or a switch)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (
            "default" in text
            or action.default is None
            or action.default is argparse.SUPPRESS
            or isinstance(action.default, bool)
        ):
            return text
        return f"{text} (default: %(default)s)"


LENGTHS_HELP = (
    "context lengths in tokens, comma-separated, e.g. 512,2k,4k (default: the "
    "trained length x1, x2 and x4: the checkpoint's data.seq_len, with --hf or a "
    "converted checkpoint the model's max_position_embeddings)"
)


def add_lengths_argument(ap: argparse.ArgumentParser) -> None:
    """--lengths (resolved after the model loads: `task_lengths`)."""
    ap.add_argument("--lengths", default=None, help=LENGTHS_HELP)


def task_parser(
    doc: str,
    task: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    prog: str | None = None,
) -> argparse.ArgumentParser:
    """A task's parser: the model's flags (`add_model_arguments`), its own, and `--out`."""
    ap = argparse.ArgumentParser(prog=prog, description=doc.strip(), formatter_class=HelpFormatter)
    add_model_arguments(ap)
    for action in ap._actions:
        if action.help is None and action.default is None:  # --layout, --q-chunk, --kv-chunk
            action.help = f"attention.{action.dest} (default: the checkpoint's)"
    add_arguments(ap)
    ap.add_argument(
        "--out",
        help=f"output directory (default: a new folder "
        f"{task}_eval/<date-time>/ in the checkpoint's workdir, "
        f"runs/{task}_eval/<name>/<date-time>/ with --hf, so that "
        f"no run replaces another's report); a given --out is "
        f"written into, replacing the {task}.md/.json/.png there",
    )
    return ap


def parse_task_args(
    doc: str,
    task: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    argv=None,
    prog: str | None = None,
) -> argparse.Namespace:
    """A task's flags (`task_parser`), `--out` defaulted after parsing (`set_out`)."""
    args = task_parser(doc, task, add_arguments, prog).parse_args(argv)
    set_out(args, task)
    return args


def explicit_lengths(args) -> list[int] | None:
    """The --lengths given (None when left to the default), parsed before the model loads
    so that a typo costs no loading."""
    if args.lengths is None:
        return None
    lengths = parse_lengths(args.lengths)
    if not lengths:
        raise StartupError(f"--lengths {args.lengths!r} names no length; e.g. --lengths 512,2k")
    return lengths


def trained_length(model: LoadedModel, saved: dict | None) -> int:
    """The context the model was trained at: its checkpoint's data.seq_len, else (a
    HuggingFace model, or a checkpoint converted from one: it trained nothing) the model's
    max_position_embeddings."""
    if saved and CONVERTED_FROM not in saved.get("identity", {}):
        return int(saved["data"]["seq_len"])
    return model.config.max_position_embeddings


def task_lengths(given: list[int] | None, model: LoadedModel, saved: dict | None) -> list[int]:
    """`given` (`explicit_lengths`), else the trained length x1, x2 and x4."""
    if given:
        return given
    trained = trained_length(model, saved)
    lengths = [trained, 2 * trained, 4 * trained]
    log.info(
        "lengths %s: the trained length %d x1, x2 and x4 (--lengths to choose others)",
        ",".join(map(format_tokens, lengths)),
        trained,
    )
    return lengths


def model_meta(model: LoadedModel) -> dict:
    """What every report records of the model it measured and how it ran."""
    return dict(
        model=model.name,
        mesh=dict(model.mesh.shape),
        layout=model.attention.layout,
        strategy=model.attention.strategy,
    )


def run_task(args, run: Callable[[argparse.Namespace], int]) -> int:
    """`run(args)` as a command: bad input (a prompt too long, ...) is one line, exit 2."""
    logs.configure()
    return run_cli(lambda: run(args), input_errors=(ValueError,))


# -- --out -------------------------------------------------------------------------------


def default_out(args, task: str) -> str:
    """A new folder `<task>_eval/<date-time>/` inside the checkpoint's workdir
    (`runs/<task>_eval/<name>/<date-time>/` with --hf): beside what was evaluated, never in
    the current directory, and never a folder an earlier run wrote (`unused`, once the
    paths are checked)."""
    if args.checkpoint:
        base = storage.join(args.checkpoint, f"{task}_eval")
    else:
        base = os.path.join("runs", f"{task}_eval", os.path.basename(os.path.normpath(args.hf)))
    return storage.join(base, time.strftime("%Y%m%d-%H%M%S"))


def unused(out: str) -> str:
    """`out`, or where it exists already (a second run in the same second) `out-2`, ..."""
    path, n = out, 1
    while storage.exists(path):
        n += 1
        path = f"{out}-{n}"
    return path


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
    if args.default_out:
        args.out = unused(args.out)
    for name in positive:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise StartupError(f"--{name.replace('_', '-')}={value} must be >= 1")
    if args.default_out and args.checkpoint and not storage.isdir(args.checkpoint):
        return  # the default lies inside it: the missing checkpoint is the line that helps
    problem = output_problem(args.out, remote=True)
    if problem:
        flag = "the default --out" if args.default_out else "--out"
        raise StartupError(f"{flag} {args.out!r} {problem}")


# -- writing -----------------------------------------------------------------------------


def write_files(
    out_dir: str, task: str, table: str, payload: dict, draw: Callable[[str], None]
) -> None:
    """`OUT/<task>.md` (the table), `.json` (payload) and `.png` (`draw(path)` writes it); a
    gs:// or s3:// OUT gets one object each (`replacing`)."""
    storage.makedirs(out_dir)
    with replacing(storage.join(out_dir, f"{task}.md")) as f:
        f.write(table + "\n")
    write_json(storage.join(out_dir, f"{task}.json"), payload)
    draw(storage.join(out_dir, f"{task}.png"))


def save_report(
    out_dir: str,
    task: str,
    write: Callable[[str], object],
    lost: str = "the per-sample answers and the heatmap are lost",
) -> int:
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
    """matplotlib.pyplot on the file-only Agg backend (no display is ever opened), its font
    manager quiet: its one INFO line when it builds a font cache ("generated new
    fontManager") would print in lclm's log format as if lclm had said it."""
    logging.getLogger("matplotlib.font_manager").setLevel(logging.WARNING)
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
    lines = [
        "| length | prompt tokens | " + " | ".join(bins) + " | all |",
        "| --- | --- | " + " | ".join("---" for _ in bins) + " | --- |",
    ]
    for j, length in enumerate(lengths):
        mine = [c for c in cells if c["length"] == length]
        tokens = int(np.mean([c["prompt_tokens"] for c in mine]))
        mean = sum(c["correct"] for c in mine) / sum(c["n"] for c in mine)
        accs = " | ".join(f"{grid[b, j]:.2f}" for b in range(n_bins))
        lines.append(f"| {format_tokens(length)} | {tokens} | {accs} | {mean:.2f} |")
    return "\n".join(lines)


def text_color(rgba) -> str:
    """Black on a light cell colour `rgba` (floats 0-1), white on a dark one (luma < 0.5)."""
    r, g, b = rgba[:3]
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b >= 0.5 else "white"


def trained_line_x(lengths: list[int], trained: int | None) -> float | None:
    """Where on a heatmap's length axis (column j at x = j) the trained length falls: the
    boundary after the last column not longer than it (-0.5: every column is longer); None
    when unknown."""
    if not trained:
        return None
    return sum(n <= trained for n in lengths) - 0.5


def accuracy_heatmap(
    path: str,
    cells,
    lengths,
    n_bins: int,
    title: str,
    depth_of: str = "the needle",
    trained: int | None = None,
    samples: int | None = None,
) -> None:
    """Accuracy heatmap PNG: x = context length, y = depth bin; each value written in the
    colour that reads on its cell; the trained length a dashed line (columns right of it
    are longer than training); `samples` prompts per cell in the title."""
    plt = pyplot()
    grid = accuracy_grid(cells, lengths, n_bins)
    fig, ax = plt.subplots(figsize=(1.2 * len(lengths) + 2.5, 0.5 * n_bins + 2.2))
    im = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(lengths)), [format_tokens(n) for n in lengths])
    ax.set_yticks(range(n_bins), depth_labels(n_bins))
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(f"depth of {depth_of}")
    for b in range(n_bins):
        for j in range(len(lengths)):
            if not np.isnan(grid[b, j]):
                ax.text(
                    j,
                    b,
                    f"{grid[b, j]:.2f}",
                    ha="center",
                    va="center",
                    fontsize=8,
                    color=text_color(im.cmap(im.norm(grid[b, j]))),
                )
    x = trained_line_x(list(lengths), trained)
    if x is not None:
        ax.axvline(
            x,
            color="black",
            linestyle="--",
            linewidth=1.5,
            label=f"trained length {format_tokens(trained or 0)}",
        )
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), frameon=False)
    fig.colorbar(im, ax=ax, label="accuracy")
    per_cell = f"\n{samples} prompt{'s' * (samples != 1)} per cell" if samples else ""
    ax.set_title(title + per_cell, fontsize=9)
    fig.tight_layout()
    save_png(path, fig)

"""RULER (Hsieh et al., 2024; NVIDIA/RULER): its generated tasks at any context length, scored
as RULER scores them, and the model's effective length.

    python -m lclm.eval ruler --hf HF_DIR --chat tokenizer --lengths 4k,8k,16k --samples 20
    python -m lclm.eval ruler --checkpoint WORKDIR --lengths 4k,32k --sp 8 --tasks vt,cwe

The prompts are `lclm.data.ruler`'s: exactly `length - budget` tokens of the model's own
tokenizer (budget: RULER's tokens to generate, 128 for niah, 30 vt, 120 cwe, 50 fwe), in
RULER's base form (the completion template ending with the answer prefix) or with
`--chat tokenizer` as the user turn of the tokenizer's chat template, the answer prefix after
the assistant header (as RULER writes chat prompts). Each is prefilled with the model's
context-parallel attention on its mesh and `budget` tokens are decoded greedily
(`lclm.eval.retrieval`, `lclm.eval.decode`).

Scoring is RULER's string_match_all: the share of a prompt's references found in the
prediction (stripped, control characters as newlines, case-insensitive), in percent,
averaged per task x length. The effective length is the longest length whose average over
the tasks is at least 85.6, RULER's threshold. That is Llama-2-7B's 4K average over RULER's
13 tasks, its two QA tasks among them; here it is applied to the average of the tasks run
(at most the 11 generated ones), which is not like for like, and the table says so.

Writes the table (task x length, the average row, the effective length) to stdout and
`OUT/ruler.md`, `OUT/ruler.json` (scores, every prediction) and `OUT/ruler.png`. Every
prompt is generated before the model decodes anything: a length too short for a task is one
line `error: ...`, exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import time
from collections.abc import Callable

import numpy as np

from lclm import storage
from lclm.config.syntax import format_tokens, parse_lengths
from lclm.data import ruler
from lclm.errors import ConfigError, StartupError
from lclm.eval import report, retrieval
from lclm.eval.model import LoadedModel, load_model

log = logging.getLogger(__name__)

TASK = "ruler"
THRESHOLD = 85.6  # Llama-2-7B's RULER average at 4K over RULER's 13 tasks (QA among them)


# -- scoring (RULER's scripts/eval) -------------------------------------------------------------


def postprocess(text: str) -> str:
    """A prediction as RULER reads it: stripped, control characters made newlines."""
    return re.sub(r"[\x00-\x1f]", "\n", text.strip()).strip()


def string_match_all(prediction: str, references: list[str]) -> float:
    """The share of `references` found in `prediction` (case-insensitive), in [0, 1]."""
    p = prediction.lower()
    return sum(r.lower() in p for r in references) / len(references)


def effective_length(average: dict[int, float], threshold: float = THRESHOLD) -> int | None:
    """The longest length whose average score reaches `threshold` (None: none does)."""
    passing = [n for n, score in average.items() if score >= threshold]
    return max(passing) if passing else None


# -- evaluation ---------------------------------------------------------------------------------


def prompts(
    tokenizer, form: ruler.Form, tasks: list[str], lengths: list[int], samples: int, seed: int
) -> dict[tuple[str, int], list[ruler.Sample]]:
    """Every prompt, by (task, length): made before anything is decoded, so that a length too
    short for a task fails at once."""
    return {
        (task, n): [ruler.sample(task, tokenizer, form, n, seed, i) for i in range(samples)]
        for n in lengths
        for task in tasks
    }


def _summary(scores: dict[str, dict[int, float]], records: list[dict], made: dict) -> dict:
    """The result of the cells scored so far: the average per length over the tasks scored
    there, the effective length over the lengths every task of `made` was scored at."""
    lengths = sorted({n for _, n in made})
    average = {
        n: round(float(np.mean([s[n] for s in scores.values() if n in s])), 2)
        for n in lengths
        if any(n in s for s in scores.values())
    }
    whole = {n: a for n, a in average.items() if all(n in scores.get(task, {}) for task, _ in made)}
    return dict(
        scores=scores, average=average, effective_length=effective_length(whole), samples=records
    )


def evaluate(
    model: LoadedModel,
    form: ruler.Form,
    made: dict,
    *,
    batch_size: int | None = None,
    measured: Callable[[dict], None] | None = None,
) -> dict:
    """Scores {task: {length: percent}}, the average per length and one record per prompt.
    One log line per (length, task) reports progress, and `measured(result so far)` follows
    each but the last."""
    rows = retrieval.batch_rows(model, batch_size)
    scores: dict[str, dict[int, float]] = {}
    records: list[dict] = []
    for done, ((task, n), items) in enumerate(made.items(), 1):
        start = time.time()
        texts, _ = retrieval.generate_answers(
            model, [s.tokens for s in items], ruler.TASKS[task].budget, rows, form.end_id
        )
        got = [string_match_all(postprocess(t), s.answers) for t, s in zip(texts, items)]
        scores.setdefault(task, {})[n] = round(100 * float(np.mean(got)), 2)
        records += [
            dict(
                task=task,
                length=n,
                index=i,
                prompt_tokens=len(s.tokens),
                answers=s.answers,
                output=t,
                score=g,
            )
            for i, (s, t, g) in enumerate(zip(items, texts, got))
        ]
        log.info(
            "length %d %s: %.1f (%d prompts, %.0f s; %d of %d cells)",
            n,
            task,
            scores[task][n],
            len(items),
            time.time() - start,
            done,
            len(made),
        )
        if measured and done < len(made):
            measured(_summary(scores, records, made))
    return _summary(scores, records, made)


# -- the report ---------------------------------------------------------------------------------


def markdown_table(result: dict) -> str:
    """Rows: the tasks, then their average; columns: the lengths; then the effective length
    (a cell not scored yet is '-', and an incomplete result says so)."""
    lengths = list(result["average"])
    lines = [
        "| task | " + " | ".join(format_tokens(n) for n in lengths) + " |",
        "| --- |" + " --- |" * len(lengths),
    ]
    for task, by_length in result["scores"].items():
        lines.append(
            f"| {task} | "
            + " | ".join(f"{by_length[n]:.1f}" if n in by_length else "-" for n in lengths)
            + " |"
        )
    lines.append(
        "| **average** | " + " | ".join(f"**{result['average'][n]:.1f}**" for n in lengths) + " |"
    )
    eff = result["effective_length"]
    lines.append("")
    lines.append(
        f"effective length (average of these {len(result['scores'])} tasks >= "
        f"{THRESHOLD}, RULER's threshold over its 13 tasks with QA): "
        + (format_tokens(eff) if eff else "none of the lengths")
    )
    if result.get("complete") is False:
        lines.append(
            f"\n**incomplete: the {len(result['samples'])} prompts scored so far; "
            "the run goes on or stopped**"
        )
    return "\n".join(lines)


def heatmap(path: str, result: dict, title: str) -> None:
    """PNG: score per task (rows, then the average) and length (columns)."""
    plt = report.pyplot()
    lengths, tasks = list(result["average"]), list(result["scores"])
    grid = np.asarray(
        [[result["scores"][t].get(n, np.nan) for n in lengths] for t in tasks]
        + [[result["average"][n] for n in lengths]]
    )
    fig, ax = plt.subplots(figsize=(1.2 * len(lengths) + 3.5, 0.4 * len(grid) + 1.8))
    im = ax.imshow(grid, vmin=0.0, vmax=100.0, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(lengths)), [format_tokens(n) for n in lengths])
    ax.set_yticks(range(len(grid)), tasks + ["average"])
    ax.set_xlabel("context length (tokens)")
    for i in range(len(grid)):
        for j in range(len(lengths)):
            ax.text(
                j,
                i,
                "-" if np.isnan(grid[i, j]) else f"{grid[i, j]:.0f}",
                ha="center",
                va="center",
                fontsize=8,
            )
    fig.colorbar(im, ax=ax, label="score (%)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    report.save_png(path, fig)


# -- command line -------------------------------------------------------------------------------


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The task's flags (beside `add_model_arguments`')."""
    ap.add_argument("--lengths", default="4k,8k,16k", help="comma-separated, e.g. 1k,2k,4k")
    ap.add_argument(
        "--tasks", default="all", help=f"comma-separated of {', '.join(ruler.TASKS)} (default: all)"
    )
    ap.add_argument("--samples", type=int, default=20, help="prompts per (task, length)")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument(
        "--chat",
        choices=["tokenizer"],
        default=None,
        help="prompts as a user turn of the tokenizer's chat template (default: RULER's base form)",
    )
    ap.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="prompts per prefill (rounded up to the mesh's dp x fsdp)",
    )


def parse_args(argv=None, prog: str | None = None):
    return report.parse_task_args(__doc__, TASK, add_arguments, argv, prog)


def task_names(flag: str) -> list[str]:
    names = list(ruler.TASKS) if flag == "all" else [t.strip() for t in flag.split(",")]
    unknown = [t for t in names if t not in ruler.TASKS]
    if unknown:
        raise StartupError(
            f"--tasks: unknown task {unknown[0]!r}; use {', '.join(ruler.TASKS)} or all"
        )
    return names


def main(argv=None, prog: str | None = None) -> int:
    return report.run_task(parse_args(argv, prog), _run)


def _evaluate(args) -> tuple[dict, dict, str]:
    """(the result, its description, the markdown table) of the flags `args`; the report so
    far is rewritten into --out after each cell, so a long run that stops keeps them."""
    report.check_model_args(args, ("samples", "batch_size"))
    tasks, lengths = task_names(args.tasks), parse_lengths(args.lengths)
    model, _ = load_model(args)
    try:
        form = ruler.prompt_form(model.tokenizer, args.chat)
    except ConfigError as e:
        raise StartupError(f"--chat {args.chat}: {e}") from None
    made = prompts(model.tokenizer, form, tasks, lengths, args.samples, args.seed)
    meta = dict(
        model=model.name,
        mesh=dict(model.mesh.shape),
        layout=model.attention.layout,
        strategy=model.attention.strategy,
        form=args.chat or "base",
        samples_per_cell=args.samples,
        seed=args.seed,
        lengths=lengths,
        threshold=THRESHOLD,
        haystack="Python reference documentation (pydoc_data)",
    )

    def write_so_far(partial: dict) -> None:
        partial = dict(partial, complete=False)
        try:
            _write(
                args.out,
                partial,
                meta,
                markdown_table(partial),
                f"RULER (incomplete): {model.name}",
            )
        except OSError as e:
            log.warning(
                "could not write the report so far into %s (%s); it is tried again "
                "after the next cell",
                args.out,
                e.strerror or e,
            )

    result = dict(
        evaluate(model, form, made, batch_size=args.batch_size, measured=write_so_far),
        complete=True,
    )
    return result, meta, markdown_table(result)


def _write(folder: str, result: dict, meta: dict, table: str, title: str) -> None:
    report.write_files(
        folder, TASK, table, dict(meta, **result), lambda path: heatmap(path, result, title)
    )


def _save(args, result: dict, meta: dict, table: str, title: str) -> int:
    return report.save_report(
        args.out, TASK, lambda folder: _write(folder, result, meta, table, title)
    )


def _run(args) -> int:
    result, meta, table = _evaluate(args)
    print(table, flush=True)
    return _save(args, result, meta, table, f"RULER: {meta['model']}")


def gate_argv(workdir: str, spec: dict) -> list[str]:
    """The `python -m lclm.eval ruler` flags that score a stage gate's RULER subset (`spec`:
    lclm.config.stages.gate_ruler's) on the stage's final checkpoint in `workdir`."""
    argv = [
        "--checkpoint",
        workdir,
        "--lengths",
        str(spec["length"]),
        "--tasks",
        spec["tasks"],
        "--samples",
        str(spec["samples"]),
        "--seed",
        str(spec["seed"]),
        "--out",
        storage.join(workdir, "ruler_gate"),
    ]
    if spec["chat"]:
        argv += ["--chat", spec["chat"]]
    if spec["batch_size"]:
        argv += ["--batch-size", str(spec["batch_size"])]
    return argv


def score_gate(workdir: str, spec: dict) -> dict:
    """A stage gate's RULER subset scored on the stage's final checkpoint, on its own mesh,
    as `python -m lclm.eval ruler` with `gate_argv`'s flags scores it (the report in
    `workdir/ruler_gate/`); what lclm.train.gates calls."""
    args = parse_args(gate_argv(workdir, spec), prog=f"{TASK} gate")
    result, meta, table = _evaluate(args)
    log.info("RULER gate of %s:\n%s", workdir, table)
    _save(args, result, meta, table, f"RULER gate: {meta['model']}")
    return result


if __name__ == "__main__":
    sys.exit(main())

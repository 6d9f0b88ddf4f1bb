"""One command for a whole context extension, with its before/after verdict.

    python -m lclm.extend --config configs/smollm2_64k.py [--budget-minutes 8.5] [--out DIR]
    python -m lclm.extend --config FILE --plan   (the checks and the time plan; nothing runs)
    (also: lclm-extend; every config field can be overridden with --config.<key>=<value>)

Before anything trains it checks the stages (as train.py does), counts the held-out
documents at every length of the loss by position with the model's own tokenizer (a length
with fewer than extension.documents is one line), and prints each part's expected time on the
device (lclm.extend.timing). Then it runs
the parts in the order of their value (lclm.extend.plan): the starting weights' loss by
position at the final length, the training (every stage, gates on, as train.py runs them),
the trained weights' loss at the final length, passkey after and before, the other lengths
(the short-context loss among them), the starting weights with YaRN at inference, a RULER
subset after and before, and each earlier stage's weights at its length. Each evaluation is a
`python -m lclm.eval` task whose own report lands in OUT/parts/<part>/.

The report, OUT/extension.{md,json,png} (OUT: the workdir's extension/ by default), is written
after every part: before and after side by side, and the verdict on each of the config's
targets (`targets` section: met, not met, not measured). Re-running the command skips the
parts that are done (an interrupted stage resumes from its checkpoint). With a budget, the
parts are taken in order while their expected times fit; the rest are left for the next run
of the same command (a device lent for a few minutes at a time runs the extension in more
than one call), and a budget that cannot hold the main question (before, the training, after at the
final length) is refused in one line; a part whose expected time no longer fits what is left
of the budget while it runs is left too, so a cut run still ends with its report.

Exit status: 0 every target met, 1 one not met or not measured, 2 bad input at start, 3 the
training stopped before its last stage's end (a gate, non-finite steps, storage).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time

import jax

from lclm import logs, storage
from lclm.cli import parse_cli, run_cli
from lclm.config import mesh_device_count
from lclm.config.run_config import RunConfig, run_config
from lclm.config.stages import stage_configs
from lclm.config.syntax import format_tokens
from lclm.data import ruler
from lclm.data.tokenizer import Tokenizer
from lclm.errors import ConfigError, StartupError, TrainingHalted
from lclm.eval.__main__ import TASKS
from lclm.extend import heldout, report
from lclm.extend.plan import (
    MAIN_QUESTION,
    TRAIN,
    Lengths,
    Part,
    eval_argv,
    extension_lengths,
    parts,
    starting_length,
)
from lclm.extend.targets import Measured, judge
from lclm.extend.timing import device_rate, expected_seconds
from lclm.parallel.devices import allow_gpu_host_memory, request_cpu_devices
from lclm.train.compile_cache import use_compile_cache
from lclm.train.first_weights import apply_hf_shapes
from lclm.train.stages import run_stages, validate_stages
from lclm.workdir.checkpoint import Checkpoints
from lclm.writes import write_json

log = logging.getLogger(__name__)
PROG = "python -m lclm.extend"
# beside an evaluation part's report: the flags and held-out documents it was measured with
STAMP = "measured_with.json"


def _saved_step(workdir: str) -> int | None:
    """The latest checkpoint step of `workdir` (None: none; nothing is created)."""
    if not storage.isdir(storage.join(workdir, "checkpoints")):
        return None
    checkpoints = Checkpoints(workdir, keep=1)
    try:
        return checkpoints.latest_step()
    finally:
        checkpoints.close()


def _trained(stages: list[RunConfig]) -> bool:
    return all((_saved_step(s.workdir) or 0) >= s.train.steps for s in stages)


def _report_of(part: Part, out: str, stamp: dict) -> dict | None:
    """The finished report of an evaluation part measured as `stamp` says (its flags and
    held-out documents; None: not there, cut short, or measured otherwise: the config
    changed since)."""
    folder = storage.join(out, "parts", part.key)
    path, flags = storage.join(folder, f"{part.task}.json"), storage.join(folder, STAMP)
    if not (storage.isfile(path) and storage.isfile(flags)):
        return None
    if json.loads(storage.read_text(flags)) != stamp:
        return None
    found = json.loads(storage.read_text(path))
    return found if found.get("complete", True) else None


def _check_ruler(sections: RunConfig, tokenizer: Tokenizer, final: int) -> None:
    """extension.ruler_tasks are known and their prompts fit the final length."""
    tasks = [t.strip() for t in sections.extension.ruler_tasks.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in ruler.TASKS]
    if unknown:
        raise ConfigError(
            f"extension.ruler_tasks: {unknown[0]!r} is not a RULER task; use "
            f"some of {', '.join(ruler.TASKS)}"
        )
    if tasks:
        try:
            form = ruler.prompt_form(
                tokenizer, "tokenizer" if sections.extension.ruler_chat else None
            )
            for task in tasks:
                ruler.sample(task, tokenizer, form, final, 0, 0)
        except ValueError as e:
            raise ConfigError(f"extension.ruler_tasks at {final} tokens: {e}") from None


class Extension:
    """One extension run: its stages, lengths, parts, their status and the report."""

    def __init__(self, config, out: str | None, command: str):
        if config.model.init_from_hf:
            config = apply_hf_shapes(config)  # every stage validates against the real model shape
        configs = validate_stages(config, len(jax.devices())) if stage_configs(config) else [config]
        self.config = config
        self.stages = [run_config(c) for c in configs]
        self.first, self.last = self.stages[0], self.stages[-1]
        self.lengths: Lengths = extension_lengths(
            self.first, self.stages, starting_length(self.first)
        )
        self.out = out or storage.join(config.workdir, "extension")
        self.command = command
        self.parts = parts(self.first, self.stages, self.lengths)
        self.rate = device_rate(self.last, mesh_device_count(config) or len(jax.devices()))
        self.heldout_dir = storage.join(self.out, "heldout")
        # set by prepare(): the held-out documents' counts, and what selected those kept
        self.held: dict = {}
        self.counts: dict[int, int] = {}
        self.selection: dict = {}
        self.status: dict[str, dict] = {}
        self.reports: dict[str, dict] = {}
        self.halted = ""  # why the training stopped, if it did

    # -- before anything runs ---------------------------------------------------------------

    def prepare(self) -> None:
        """The RULER subset and the held-out documents checked; the documents kept."""
        ext = self.first.extension
        tokenizer = Tokenizer(self.first.data.tokenizer)
        _check_ruler(self.first, tokenizer, self.lengths.final)
        started = time.perf_counter()
        _, held = heldout.counted(self.config)
        source = held.source
        print(
            f"held-out documents of {source} ({held.read} read, the longest "
            f"{held.longest:,} tokens; {time.perf_counter() - started:.0f} s):"
        )
        for line in held.lines():
            print(f"  {line}")
        heldout.check_counts(held, ext.documents)
        self.held = dict(
            source=source,
            counts={str(n): c for n, c in held.counts.items()},
            read=held.read,
            longest=held.longest,
            needed=ext.documents,
        )
        # the kept documents are rewritten when what selects them changed
        self.selection = dict(
            source=source,
            tokenizer=self.first.data.tokenizer,
            lengths=sorted(held.counts),
            documents=ext.documents,
            kept=len(held.kept),
        )
        selection = storage.join(self.out, "heldout.json")
        if not (
            storage.isdir(self.heldout_dir)
            and storage.isfile(selection)
            and json.loads(storage.read_text(selection)) == self.selection
        ):
            heldout.write(held, self.heldout_dir, tokenizer)
            write_json(selection, self.selection)
        self.counts = held.counts

    def plan(self, budget_minutes: float | None) -> float:
        """Each part's expected seconds (0 for what is done), printed. Within a budget the
        parts are taken in order while they fit; those that do not are left for the next run
        of the command. A budget that does not hold the main question (the parts up to the
        trained weights' loss at the final length) is refused in one line."""
        previous = self._previous_status()
        rate = self.rate
        budget = math.inf if budget_minutes is None else 60 * budget_minutes
        print(f"time plan on {rate.how}:")
        total, taken = 0.0, 0.0
        for i, part in enumerate(self.parts):
            if self._done(part):
                self.status[part.key] = dict(previous.get(part.key, {}), status="done")
                print(f"  {part.what}: done")
                continue
            seconds, how = self._expected(part, rate)
            total += seconds
            fits = taken + seconds <= budget
            if fits:
                taken += seconds
            elif i < MAIN_QUESTION:
                raise ConfigError(
                    f"--budget-minutes {budget_minutes:g} does not hold the main question: "
                    f"{part.what} would end at an expected {(taken + seconds) / 60:.1f} min; "
                    "train fewer steps (train.steps, per stage), measure fewer documents "
                    "(extension.documents) or allow more minutes"
                )
            self.status[part.key] = dict(
                expected=round(seconds, 1),
                how=how,
                status="to run" if fits else "left for the next run",
            )
            print(
                f"  {part.what}: {seconds / 60:.1f} min ({how})"
                + ("" if fits else ": past the budget, left for the next run")
            )
        print(f"  in all: {total / 60:.1f} min; within the budget: {taken / 60:.1f} min")
        return total

    def _expected(self, part: Part, rate) -> tuple[float, str]:
        if part.task != TRAIN:
            return expected_seconds(part, self.first, self.last, rate, self.counts)
        seconds, how = 0.0, []
        for s in self.stages:
            t, h = expected_seconds(part, self.first, s, rate, self.counts)
            seconds += t
            how.append(f"{format_tokens(s.data.seq_len)}: {h}")
        return seconds, "; ".join(how)

    def _previous_status(self) -> dict[str, dict]:
        path = storage.join(self.out, "extension.json")
        if not storage.isfile(path):
            return {}
        return {
            p["key"]: {k: v for k, v in p.items() if k in ("expected", "how", "seconds", "status")}
            for p in json.loads(storage.read_text(path)).get("parts", [])
        }

    def _done(self, part: Part) -> bool:
        if part.task == TRAIN:
            return _trained(self.stages)
        found = _report_of(part, self.out, self._stamp(part))
        if found is not None:
            self.reports[part.key] = found
        return found is not None

    def _stamp(self, part: Part) -> dict:
        """What an evaluation part is measured with: its flags and the held-out selection."""
        return dict(
            argv=eval_argv(
                part,
                self.first,
                self.last,
                self.lengths,
                storage.join(self.out, "parts", part.key),
                self.heldout_dir,
            ),
            heldout=self.selection,
        )

    # -- running ----------------------------------------------------------------------------

    def run(self, budget_minutes: float | None) -> int:
        started = time.monotonic()
        # the evaluations before the training, and their programs after it, compile once
        use_compile_cache(self.first.compile_cache)
        for part in self.parts:
            state = self.status[part.key]
            if state["status"] in ("done", "left for the next run"):
                continue
            left = (
                math.inf
                if budget_minutes is None
                else 60 * budget_minutes - (time.monotonic() - started)
            )
            if self.halted:  # a gate, a preemption: what stopped the training stops the run
                state["status"] = "not run: the training stopped"
            elif state["expected"] > left:
                state["status"] = "left for the next run: the budget's remainder is shorter"
            elif part.task != TRAIN and part.workdir and not _trained(self.stages):
                state["status"] = "not run: the training did not finish"
            else:
                print(f"== {part.what} (expected {state['expected'] / 60:.1f} min)", flush=True)
                began = time.monotonic()
                state["status"] = self._run_part(part)
                state["seconds"] = round(time.monotonic() - began, 1)
            self.write()
        verdicts = self.write()
        for v in verdicts:
            print(f"{v.word}: {v.name}: {v.line}")
        print(f"wrote {self.out}/extension.{{md,json,png}}")
        if self.halted:
            print(f"error: {self.halted}", file=sys.stderr)
            return 3
        return 0 if verdicts and all(v.met for v in verdicts) else 1

    def _run_part(self, part: Part) -> str:
        if part.task == TRAIN:
            try:
                run_stages(self.config)
            except TrainingHalted as e:
                self.halted = str(e)
                return f"stopped: {e}"
            if not _trained(self.stages):
                self.halted = (
                    "the training stopped before its last stage's end; run the "
                    "same command to resume"
                )
                return "stopped"
            return "done"
        stamp = self._stamp(part)
        folder = storage.join(self.out, "parts", part.key)
        storage.makedirs(folder)
        write_json(storage.join(folder, STAMP), stamp)
        argv = stamp["argv"]
        try:
            code = TASKS[part.task](argv, prog=f"python -m lclm.eval {part.task}")
        except Exception as e:  # noqa: BLE001  (one part's failure, an OOM, leaves the rest)
            log.exception("%s failed", part.what)
            return f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        found = _report_of(part, self.out, stamp)
        if code or found is None:
            return f"failed (exit status {code})"
        self.reports[part.key] = found
        return "done"

    def write(self):
        measured = Measured(self.parts, self.reports)
        verdicts = judge(self.first.targets, self.lengths, measured)
        start = self.first.model.init_from_hf or self.first.model.init_from_checkpoint
        title = (
            f"Context extension of {storage.basename(start)}: "
            f"{format_tokens(self.lengths.trained)} -> {format_tokens(self.lengths.final)}"
        )
        report.write(
            self.out,
            title,
            self.lengths,
            self.parts,
            self.status,
            self.held,
            verdicts,
            measured,
            self.command,
            dict(
                workdir=self.config.workdir,
                jax=jax.__version__,
                device=jax.devices()[0].device_kind,
            ),
        )
        return verdicts


def extend(config, args, command: str) -> int:
    # before JAX starts its backends, as the training program does
    stages = stage_configs(config) or [config]
    request_cpu_devices(max(mesh_device_count(c) or 1 for c in stages))
    allow_gpu_host_memory(1)
    logs.configure()
    run = Extension(config, args.out, command)
    run.prepare()
    run.plan(args.budget_minutes)
    if args.plan:
        return 0
    return run.run(args.budget_minutes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__)
    parser.add_argument(
        "--budget-minutes",
        type=float,
        default=None,
        help="refuse a plan expected to take longer; skip the parts that no "
        "longer fit while it runs",
    )
    parser.add_argument("--out", help="the report's folder (default: the workdir's extension/)")
    parser.add_argument(
        "--plan",
        action="store_true",
        help="check, count the held-out documents, print the time plan; run nothing",
    )
    given = sys.argv[1:] if argv is None else list(argv)

    def body() -> int:
        args, config = parse_cli(parser, given)
        if args.budget_minutes is not None and not args.budget_minutes > 0:
            raise StartupError(f"--budget-minutes {args.budget_minutes:g} must be > 0")
        return extend(config, args, " ".join([PROG, *given]))

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())

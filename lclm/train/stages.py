"""Staged context extension: one run that trains its stages one after another.

The stages are records of what changes at each one (`config.stages.list`, or the one-line
`stages.schedule` "seq_len:rope_theta:steps[:sp], ..."; what a stage may set:
lclm.config.stages). Each stage is an ordinary training run in `{workdir}/stage{i}_{seq_len}`
with its own config (checkpoints are layout-free, so the mesh, strategy and remat may change
between stages). Stage 0 starts from `model.init_from_hf` (or from scratch); stage i > 0
starts from stage i-1's final parameters and, unless the stage says `optimizer='fresh'`, its
optimizer state (Adam's moments; the learning-rate schedule starts again with the stage's own
warm-up and decay, as ProLong's second stage continues from the first's optimizer). Re-running
the same command resumes: finished stages are skipped, a stage with a checkpoint resumes from
it (same data order), the next one starts from its predecessor's final checkpoint.
"""

from __future__ import annotations

import logging
import math

import jax

from lclm import storage
from lclm.config import MESH_AXES
from lclm.config.run_config import RunConfig, run_config
from lclm.config.stages import gate_ruler, stage_configs, stage_name, stage_records
from lclm.data import ruler
from lclm.data.tokenizer import Tokenizer
from lclm.errors import ConfigError, TrainingHalted
from lclm.train import gates
from lclm.train.first_weights import SourceDamaged, apply_hf_shapes
from lclm.train.loop import Termination, handled_termination, train
from lclm.train.startup_checks import check_config, checked
from lclm.workdir.checkpoint import Checkpoints

log = logging.getLogger(__name__)


def validate_stages(config, device_count: int) -> list:
    """The stage configs, each as `checked` makes it (with the mesh it resolves to here);
    fails at start, with the stage named, if any of them is invalid."""
    return _each_stage(stage_configs(config), lambda c: checked(c, device_count).config)


def check_stages(config) -> None:
    """What `--print-config` refuses: each stage of `config` (or the config itself) checked as
    the run checks it at start (`startup_checks.check_config`, a stage named as
    `validate_stages` names it), on the devices its mesh asks for (an axis of -1 counted as
    1), so that a config the run would refuse on any machine is not printed as resolved. The
    workdir is not touched and no JAX backend starts."""

    def check(c) -> None:
        devices = math.prod(max(c.mesh[axis], 1) for axis in MESH_AXES)
        check_config(c, devices)

    stages = stage_configs(config)
    if stages:
        _each_stage(stages, check)
    else:
        check(config)


def _each_stage(configs: list, check) -> list:
    """`check(c)` of each stage config; its ConfigError names the stage."""
    found = []
    for i, c in enumerate(configs):
        try:
            found.append(check(c))
        except ConfigError as e:
            raise ConfigError(f"stage {i} (seq_len {c.data.seq_len}): {e}") from None
    return found


def check_ruler_gates(configs: list, records: list[dict]) -> None:
    """Every gate's RULER subset can be scored: known tasks whose first prompt fits its
    length with the stage's tokenizer; found at start, not after a stage of training."""
    for i, (c, record) in enumerate(zip(configs, records)):
        spec = gate_ruler(record.get("gate", {}), c.data.seq_len)
        if spec is None:
            continue
        where = f"stage {i} (seq_len {c.data.seq_len})'s gate"
        tasks = [t.strip() for t in spec["tasks"].split(",") if t.strip()]
        unknown = [t for t in tasks if t not in ruler.TASKS] or ([] if tasks else ["(none)"])
        if unknown:
            raise ConfigError(
                f"{where}: RULER task {unknown[0]!r} is unknown; use some of "
                f"{', '.join(ruler.TASKS)}"
            )
        tokenizer = Tokenizer(c.data.tokenizer)
        try:
            form = ruler.prompt_form(tokenizer, spec["chat"])
            for task in tasks:
                ruler.sample(task, tokenizer, form, spec["length"], spec["seed"], 0)
        except (ConfigError, ValueError) as e:
            raise ConfigError(f"{where}: {e}") from None


def _saved_step(workdir: str) -> int | None:
    checkpoints = Checkpoints(workdir, keep=1)
    try:
        return checkpoints.latest_step()
    finally:
        checkpoints.close()


def _set_aside_final(workdir: str, damaged: SourceDamaged) -> None:
    """Move a finished stage's unreadable final checkpoint aside, as a resume would, so that
    the stage resumes from its previous good step and saves its final step again."""
    checkpoints = Checkpoints(workdir, keep=1)
    try:
        step = damaged.step if damaged.step is not None else checkpoints.latest_step()
        if step is not None:
            checkpoints.set_aside(step, damaged.why)
    finally:
        checkpoints.close()


def run_stages(config, stop_after: int | None = None) -> list[list[dict]]:
    """Train every unfinished stage in order; returns each run stage's metric records.

    `stop_after` counts steps over all stages (stage 1's first step is stage 0's steps + 1)
    and stops there as a crash would (steps since the stage's last checkpoint are lost); the
    next call resumes. A stage whose predecessor's final checkpoint turns out damaged when it
    starts sends the run back to that predecessor, which resumes from its previous good step.
    A termination signal
    (SIGTERM, SIGINT) stops the run at the step it comes after, its checkpoint saved, however
    late in a stage it comes (during its final save and summary: the next stage does not
    start).
    """
    with handled_termination() as termination:
        return _run_stages(config, stop_after, termination)


def _run_stages(config, stop_after: int | None, termination: Termination) -> list[list[dict]]:
    if config.model.init_from_hf:
        config = apply_hf_shapes(config)  # every stage validates against the real model shape
    configs = validate_stages(config, len(jax.devices()))
    records = stage_records(config)
    check_ruler_gates(configs, records)
    # looked at only where it exists: opening Checkpoints would create the directory
    single = (
        _saved_step(config.workdir)
        if storage.isdir(storage.join(config.workdir, "checkpoints"))
        else None
    )
    if single is not None:  # the stages would be written beside it and never read it
        raise ConfigError(
            f"workdir={config.workdir!r} holds the checkpoints of a single run or a conversion "
            f"(step {single}), which a staged run would not read (its stages live in "
            f"stage<i>_<seq_len> subdirectories); use a new workdir with "
            f"model.init_from_checkpoint={config.workdir!r}"
        )
    results: list[list[dict]] = []
    sent_back: set[int] = set()  # stages already resumed for a damaged final checkpoint
    stages = [run_config(c) for c in configs]  # what is read here; `train` takes the config
    i = 0
    while i < len(configs):
        if termination.signalled():
            log.warning(
                "stopped before stage %d on a termination signal (the checkpoints are "
                "saved); run the same command to resume",
                i,
            )
            break
        c, s = configs[i], stages[i]
        steps_before = sum(t.train.steps for t in stages[:i])  # of all the earlier stages
        done = _saved_step(s.workdir)
        if done is not None and done >= s.train.steps:
            log.info("stage %d (seq_len %d) already finished at step %d", i, s.data.seq_len, done)
            _pass_gate(s, records[i], i)
            i += 1
            continue
        log.info(
            "stage %d: seq_len %d, rope_theta %g (scaling %s), %d steps of %d sequences "
            "at lr %g, %s optimizer, data %s, in %s",
            i,
            s.data.seq_len,
            s.model.rope_theta,
            s.model.rope_scaling,
            s.train.steps,
            s.data.batch_size,
            s.train.lr,
            "carried" if s.train.optimizer_from_checkpoint and i else "fresh",
            s.data.path,
            s.workdir,
        )
        if stop_after is not None and stop_after <= steps_before:
            break
        try:
            results.append(
                train(
                    c,
                    stop_after=None if stop_after is None else stop_after - steps_before,
                    termination=termination,
                )
            )
        except SourceDamaged as damaged:
            if i == 0 or damaged.workdir != stages[i - 1].workdir or i - 1 in sent_back:
                raise  # the user's init_from_checkpoint, or storage that damages it again
            sent_back.add(i - 1)
            _set_aside_final(damaged.workdir, damaged)
            log.warning(
                "stage %d's final checkpoint is damaged; stage %d resumes from its "
                "previous good step (or its start) before stage %d",
                i - 1,
                i - 1,
                i,
            )
            i -= 1
            continue
        reached = _saved_step(s.workdir)
        if reached is None or reached < s.train.steps:
            log.warning(
                "stage %d stopped at step %s of %d; run the same command to resume",
                i,
                reached,
                s.train.steps,
            )
            break
        _pass_gate(s, records[i], i)
        i += 1
    return results


def _pass_gate(stage: RunConfig, record: dict, index: int) -> None:
    """Evaluate a finished stage's gate, if it has one; a failed 'stop' gate halts the run
    (exit 3) before the next stage: re-running evaluates it again."""
    if "gate" not in record:
        return
    verdict = gates.evaluate(stage, record["gate"], stage_name(record, index))
    if not verdict.passed and verdict.stop:
        raise TrainingHalted(
            f"{verdict.line}; the next stage did not start (train this one "
            "longer, loosen its gate, or set its gate's on_fail='warn'), "
            "then run the same command"
        )

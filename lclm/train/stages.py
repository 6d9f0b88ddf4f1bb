"""Staged context extension: one run that trains at growing sequence lengths.

`config.stages.schedule` lists the stages as `seq_len:rope_theta:steps[:sp]` entries, e.g.
`"32k:1e6:400:8, 128k:1e7:200:16, 256k:1e7:100:32, 512k:2.5e7:100:32"` (k = 1024 tokens; the
optional sp sets `mesh.sp` for that stage, so short stages use a short ring and more FSDP:
checkpoints are layout-free, so the mesh may change between stages). Each stage is
an ordinary training run in `{workdir}/stage{i}_{seq_len}` with that sequence length, RoPE
theta and step count; the batch is `stages.tokens_per_batch // seq_len` sequences, so every
stage sees the same tokens per step. Stage 0 starts from `model.init_from_hf` (or from
scratch); stage i > 0 starts from stage i-1's final parameters (fresh optimizer state and
schedule, as a new fine-tuning phase, at `stages.extend_lr` where set: a fresh optimizer at a
from-scratch learning rate can wipe what the previous stage learned). Re-running the same
command resumes: finished stages are skipped, a stage with a checkpoint resumes from it (same
data order), the next one starts from its predecessor's final checkpoint.
"""

from __future__ import annotations

import copy
import logging
import os
from typing import NamedTuple

from lclm.config import ConfigError, parse_tokens

log = logging.getLogger(__name__)


class Stage(NamedTuple):
    seq_len: int
    rope_theta: float
    steps: int
    sp: int | None = None


def parse_schedule(schedule: str) -> list[Stage]:
    """`"32k:1e6:400,128k:1e7:200:8"` -> [Stage(32768, 1e6, 400), Stage(131072, 1e7, 200, 8)]."""
    stages = []
    for entry in filter(None, (e.strip() for e in schedule.split(","))):
        try:
            seq, theta, steps, *sp = entry.split(":")
            if len(sp) > 1:
                raise ValueError
            stage = Stage(parse_tokens(seq), float(theta), int(steps),
                          int(sp[0]) if sp else None)
        except ValueError:
            raise ConfigError(f"stages.schedule entry {entry!r} is not "
                              "seq_len:rope_theta:steps[:sp] (e.g. 32k:1e6:400:8)") from None
        if min(stage.seq_len, stage.steps, stage.rope_theta, stage.sp or 1) <= 0:
            raise ConfigError(f"stages.schedule entry {entry!r} needs positive values")
        stages.append(stage)
    return stages


def keys_set_by_stages(config) -> dict[str, str]:
    """{config key that a stage replaces: why, and what to change instead} of a staged config
    ({} without a schedule). A command-line override of one of these keys would be silently
    replaced by the stages (train.warmup is only clamped, so it is not one of them)."""
    stages = parse_schedule(config.stages.schedule)
    if not stages:
        return {}
    every = "set by every stage of stages.schedule"
    change = "change the schedule (stages.schedule=...) instead"
    keys = {k: f"{every}; {change}" for k in ("data.seq_len", "model.rope_theta", "train.steps")}
    with_sp = [str(i) for i, stage in enumerate(stages) if stage.sp]
    if with_sp:
        keys["mesh.sp"] = (f"set by stage{'s' if len(with_sp) > 1 else ''} {', '.join(with_sp)} "
                           f"of stages.schedule (seq_len:rope_theta:steps:sp); {change}")
    if config.stages.tokens_per_batch:
        keys["data.batch_size"] = (f"{every} (stages.tokens_per_batch // seq_len); change "
                                   "stages.tokens_per_batch instead")
    return keys


def stage_workdir(config, index: int, stage: Stage) -> str:
    return os.path.join(config.workdir, f"stage{index}_{stage.seq_len}")


def stage_configs(config) -> list:
    """One complete training config per stage (chained through `model.init_from_checkpoint`)."""
    stages = parse_schedule(config.stages.schedule)
    tokens = config.stages.tokens_per_batch
    configs, previous = [], None
    for i, stage in enumerate(stages):
        c = copy.deepcopy(config)
        c.stages.schedule = ""
        c.workdir = stage_workdir(config, i, stage)
        c.data.seq_len = stage.seq_len
        c.model.rope_theta = stage.rope_theta
        c.train.steps = stage.steps
        c.train.warmup = min(c.train.warmup, stage.steps - 1)
        if stage.sp:
            c.mesh.sp = stage.sp
        if tokens:
            if tokens % stage.seq_len:
                raise ConfigError(f"stages.tokens_per_batch={tokens} is not a multiple of stage "
                                  f"{i}'s seq_len={stage.seq_len}")
            c.data.batch_size = tokens // stage.seq_len
        if previous is not None:  # weights come from the previous stage, not from HF
            c.model.init_from_checkpoint = previous
            c.train.lr = config.stages.extend_lr or c.train.lr
        configs.append(c)
        previous = c.workdir
    return configs


def validate_stages(config, device_count: int) -> list:
    """The stage configs; fails at start, with the stage named, if any of them is invalid."""
    from lclm.config import validate
    configs = stage_configs(config)
    for i, c in enumerate(configs):
        try:
            validate(c, device_count)
        except ConfigError as e:
            raise ConfigError(f"stage {i} (seq_len {c.data.seq_len}): {e}") from None
    return configs


def _saved_step(workdir: str) -> int | None:
    from lclm.checkpoint import Checkpoints
    checkpoints = Checkpoints(workdir, every=0, keep=1)
    try:
        return checkpoints.latest_step()
    finally:
        checkpoints.close()


def run_stages(config, stop_after: int | None = None) -> list[list[dict]]:
    """Train every unfinished stage in order; returns each run stage's metric records.

    `stop_after` counts steps over all stages (stage 1's first step is stage 0's steps + 1)
    and stops there as a crash would (steps since the stage's last checkpoint are lost); the
    next call resumes.
    """
    import jax
    from lclm.train.loop import train

    if config.model.init_from_hf:
        from lclm.train.loop import apply_hf_shapes
        apply_hf_shapes(config)  # every stage validates against the real model shape
    results, steps_before = [], 0  # steps of all the stages before this one
    for i, c in enumerate(validate_stages(config, len(jax.devices()))):
        done = _saved_step(c.workdir)
        if done is not None and done >= c.train.steps:
            log.info("stage %d (seq_len %d) already finished at step %d", i, c.data.seq_len, done)
            steps_before += c.train.steps
            continue
        log.info("stage %d: seq_len %d, rope_theta %g, %d steps of %d sequences in %s", i,
                 c.data.seq_len, c.model.rope_theta, c.train.steps, c.data.batch_size,
                 c.workdir)
        if stop_after is not None and stop_after <= steps_before:
            break
        results.append(train(c, stop_after=None if stop_after is None
                             else stop_after - steps_before))
        reached = _saved_step(c.workdir)
        if reached is None or reached < c.train.steps:
            log.warning("stage %d stopped at step %s of %d; run the same command to resume",
                        i, reached, c.train.steps)
            break
        steps_before += c.train.steps
    return results

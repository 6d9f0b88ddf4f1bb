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

import logging

import jax

from lclm.checkpoint import Checkpoints
from lclm.config.stages import stage_configs
from lclm.errors import ConfigError
from lclm.train.loop import train
from lclm.train.setup import apply_hf_shapes, validate

log = logging.getLogger(__name__)


def validate_stages(config, device_count: int) -> list:
    """The stage configs; fails at start, with the stage named, if any of them is invalid."""
    configs = stage_configs(config)
    for i, c in enumerate(configs):
        try:
            validate(c, device_count)
        except ConfigError as e:
            raise ConfigError(f"stage {i} (seq_len {c.data.seq_len}): {e}") from None
    return configs


def _saved_step(workdir: str) -> int | None:
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
    if config.model.init_from_hf:
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

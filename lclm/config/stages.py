"""Staged context extension as configs: the complete training config of every stage of
`config.stages.schedule`, the keys the stages set (a command-line override of one would be
lost), and the lengths each stage validates at. Running the stages is lclm.train.stages'.
"""

from __future__ import annotations

import copy

from lclm import storage
from lclm.config.syntax import Stage, parse_schedule, parse_tokens
from lclm.errors import ConfigError


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
    return storage.join(config.workdir, f"stage{index}_{stage.seq_len}")


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
        # 'stages' names lengths only the schedule knows: this stage's and the earlier ones'
        c.validation.lengths = ",".join(
            ",".join(str(s.seq_len) for s in stages[:i + 1]) if item.strip() == STAGES else item
            for item in config.validation.lengths.split(","))
        if previous is not None:  # weights come from the previous stage, not from HF
            c.model.init_from_checkpoint = previous
            c.train.lr = config.stages.extend_lr or c.train.lr
        configs.append(c)
        previous = c.workdir
    return configs


STAGES = "stages"


def validation_lengths(config) -> list[int]:
    """The sequence lengths the held-out loss is measured at: `data.seq_len` and those of
    `validation.lengths` ('stages' outside a schedule is the run's own length), ascending.
    A bad entry is a ConfigError naming the key."""
    lengths = {config.data.seq_len}
    for item in filter(None, (i.strip() for i in config.validation.lengths.split(","))):
        if item == STAGES:
            continue
        try:
            lengths.add(parse_tokens(item))
        except ValueError as e:
            raise ConfigError(f"validation.lengths={config.validation.lengths!r}: {e}, or "
                              f"'{STAGES}' (this stage's and every earlier stage's)") from None
    return sorted(lengths)

"""A checked config as a frozen tree of its typed sections (`RunConfig`): what the training
loop hands its components, each the sections it reads, so that mypy checks every field they
read. ml_collections stays where it earns its place: config files, `--config.a.b=V`
overrides, FieldReferences and stages; `run_config` is taken once a stage's config is final
and checked. No JAX here."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from lclm.config.fields import from_saved
from lclm.config.model import AttentionConfig
from lclm.config.schema import (
    SECTIONS,
    Checkpoint,
    Data,
    Extension,
    Log,
    Mesh,
    Model,
    Run,
    Stages,
    Targets,
    Train,
    Validation,
)
from lclm.config.stages import validation_lengths


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Every section of one run's (or one stage's) config; `run` holds the top-level fields
    (workdir, seed, ...), which read as this tree's own (`sections.workdir`)."""

    run: Run
    mesh: Mesh
    model: Model
    attention: AttentionConfig
    data: Data
    train: Train
    log: Log
    checkpoint: Checkpoint
    validation: Validation
    stages: Stages
    extension: Extension
    targets: Targets

    # the top-level fields, read as `sections.workdir` (their section is `run`)
    @property
    def workdir(self) -> str:
        return self.run.workdir

    @property
    def workdir_lease_minutes(self) -> float:
        return self.run.workdir_lease_minutes

    @property
    def storage_patience_seconds(self) -> float:
        return self.run.storage_patience_seconds

    @property
    def seed(self) -> int:
        return self.run.seed

    @property
    def compile_cache(self) -> str:
        return self.run.compile_cache

    def to_dict(self) -> dict[str, Any]:
        """The plain dict of the config it was made from (top-level fields at the top, as
        `ConfigDict.to_dict`; what `secrets.public_config` cleans)."""
        out: dict[str, Any] = dataclasses.asdict(self.run)
        for name in SECTIONS:
            if name:
                out[name] = dataclasses.asdict(getattr(self, name))
        return out


def run_config(config) -> RunConfig:
    """The typed tree of a checked `ml_collections` config (references resolved). Each
    section takes the fields it declares; a field the config lacks keeps its default."""
    values = config.to_dict()
    return RunConfig(
        **{
            name or "run": from_saved(section, values if not name else values.get(name, {}))
            for name, section in SECTIONS.items()
        }
    )


def held_out_runs(config) -> dict[int, RunConfig]:
    """What the held-out loss reads at each of the run's validation lengths: the run's
    sections with `data.seq_len` that length and `data.path` its `validation.path` (copied
    with their references, so that a path that follows `data.seq_len` follows it here);
    {} without validation data."""
    if not config.validation.path:
        return {}
    runs = {}
    for length in validation_lengths(config.data.seq_len, config.validation.lengths):
        held_out = copy.deepcopy(config)
        held_out.data.seq_len = length
        held_out.data.path = held_out.validation.path
        runs[length] = run_config(held_out)
    return runs

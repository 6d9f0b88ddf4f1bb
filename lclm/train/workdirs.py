"""Which directory holds the checkpoints a tool reads when it is given a run's workdir.

A run keeps its checkpoints in `WORKDIR/checkpoints`; a staged run keeps none of its own:
each stage is a run in `WORKDIR/stage{i}_{seq_len}` (lclm.config.stages), and what the staged
run has trained is in its last stage with a checkpoint. `convert --to-hf`, `lclm.generate`
and the evaluations all read a workdir through `workdir_to_read`, so each of them takes a
staged run's directory the same way; `convert --to-checkpoint` refuses one (`stage_dirs`).
"""

from __future__ import annotations

import re

from lclm import storage
from lclm.checkpoint import path_problem
from lclm.errors import StartupError

STAGE_DIR = re.compile(r"stage(\d+)_(\d+)")


def stage_dirs(workdir: str) -> list[str]:
    """The stage workdirs in `workdir` (a staged run's directory) in stage order, with a
    checkpoint or not (a stage that has just started has none yet); [] for any other
    directory."""
    stages = sorted((int(m.group(1)), name) for name in storage.listdir(workdir)
                    if (m := STAGE_DIR.fullmatch(name))
                    and storage.isdir(storage.join(workdir, name)))
    return [storage.join(workdir, name) for _, name in stages]


def saved_steps(workdir: str) -> list[int]:
    """The steps saved in `workdir/checkpoints`, in order, read from the directory's names: a
    run creates the directory when it starts, and Orbax writes a step under a temporary name
    until it is complete (on GCS, which has no rename, under its own name, marked complete by
    a `commit_success.txt` object)."""
    directory = storage.join(workdir, "checkpoints")
    complete = (_committed if storage.is_remote(directory) else storage.isdir)
    return sorted(int(name) for name in storage.listdir(directory)
                  if name.isdigit() and complete(storage.join(directory, name)))


def _committed(step_dir: str) -> bool:
    return storage.exists(storage.join(step_dir, "commit_success.txt"))


def has_checkpoint(workdir: str) -> bool:
    """Whether `workdir/checkpoints` holds a saved step."""
    return bool(saved_steps(workdir))


def checkpointed_stages(workdir: str) -> list[str]:
    """The stage workdirs of the staged run in `workdir` that hold a checkpoint, in order."""
    return [stage for stage in stage_dirs(workdir) if has_checkpoint(stage)]


def workdir_to_read(workdir: str, flag: str = "--checkpoint") -> str:
    """The directory whose checkpoints stand for `workdir` (named by the command-line flag
    `flag`): itself, or for a staged run's directory its last stage with a checkpoint. One
    line (StartupError) for an object-store path, a staged run with no checkpoint yet, and a
    directory holding both a run's checkpoints and a staged run's stages (which of the two is
    meant cannot be told)."""
    problem = storage.client_problem(workdir) or path_problem(workdir)
    if problem:
        raise StartupError(f"{flag} {workdir!r} {problem}")
    stages = stage_dirs(workdir)
    if not stages:
        return workdir   # a run's workdir, or nothing: the reader says what is missing
    with_checkpoint = [stage for stage in stages if has_checkpoint(stage)]
    names = ", ".join(storage.basename(stage) for stage in stages)
    if has_checkpoint(workdir):
        last = (f"pass {with_checkpoint[-1]!r} for the staged run's last stage, or "
                if with_checkpoint else "")
        raise StartupError(f"{flag} {workdir!r} holds both a run's checkpoints and a staged "
                           f"run's stages ({names}); {last}move one of the runs to a "
                           "directory of its own")
    if not with_checkpoint:
        raise StartupError(f"{flag} {workdir!r} is a staged run's directory whose stages "
                           f"({names}) hold no checkpoint yet; wait for stage 0's first "
                           "checkpoint")
    return with_checkpoint[-1]

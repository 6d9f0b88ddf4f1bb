"""A run's workdir: the start-up check that the run can write it (`check_workdir`), and which
directory holds the checkpoints a tool reads when it is given a run's workdir.

A run keeps its checkpoints in `WORKDIR/checkpoints`; a staged run keeps none of its own:
each stage is a run in `WORKDIR/stage{i}_{seq_len}` (lclm.config.stages), and what the staged
run has trained is in its last stage with a checkpoint. `convert --to-hf`, `lclm.eval.generate`
and the evaluations all read a workdir through `workdir_to_read`, so each of them takes a
staged run's directory the same way; `convert --to-checkpoint` refuses one (`stage_dirs`).
"""

from __future__ import annotations

import os
import re
import tempfile

from lclm import storage
from lclm.errors import ConfigError, StartupError
from lclm.workdir.checkpoint import COMMITTED, path_problem
from lclm.writes import output_problem

STAGE_DIR = re.compile(r"stage(\d+)_(\d+)")


def stage_dirs(workdir: str) -> list[str]:
    """The stage workdirs in `workdir` (a staged run's directory) in stage order, with a
    checkpoint or not (a stage that has just started has none yet); [] for any other
    directory."""
    stages = sorted(
        (int(m.group(1)), name)
        for name in storage.listdir(workdir)
        if (m := STAGE_DIR.fullmatch(name)) and storage.isdir(storage.join(workdir, name))
    )
    return [storage.join(workdir, name) for _, name in stages]


def saved_steps(workdir: str) -> list[int]:
    """The steps saved in `workdir/checkpoints`, in order, read from the directory's names: a
    run creates the directory when it starts, and Orbax writes a step under a temporary name
    until it is complete (on GCS, which has no rename, under its own name, marked complete by
    a `commit_success.txt` object)."""
    directory = storage.join(workdir, "checkpoints")
    complete = _committed if storage.is_remote(directory) else storage.isdir
    return sorted(
        int(name)
        for name in storage.listdir(directory)
        if name.isdigit() and complete(storage.join(directory, name))
    )


def _committed(step_dir: str) -> bool:
    return storage.exists(storage.join(step_dir, COMMITTED))


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
        return workdir  # a run's workdir, or nothing: the reader says what is missing
    with_checkpoint = [stage for stage in stages if has_checkpoint(stage)]
    names = ", ".join(storage.basename(stage) for stage in stages)
    if has_checkpoint(workdir):
        last = (
            f"pass {with_checkpoint[-1]!r} for the staged run's last stage, or "
            if with_checkpoint
            else ""
        )
        raise StartupError(
            f"{flag} {workdir!r} holds both a run's checkpoints and a staged "
            f"run's stages ({names}); {last}move one of the runs to a "
            "directory of its own"
        )
    if not with_checkpoint:
        raise StartupError(
            f"{flag} {workdir!r} is a staged run's directory whose stages "
            f"({names}) hold no checkpoint yet; wait for stage 0's first "
            "checkpoint"
        )
    return with_checkpoint[-1]


def _refuse(msg: str):
    raise ConfigError(msg)


def _probe_dir(directory: str) -> str | None:
    """Why a new file cannot be made in `directory` (None: it can); leaves nothing behind."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            return None
    except OSError as e:
        return e.strerror or str(e)


# what a run writes in its workdir besides new files: found unwritable at start, not after
# a week of training at the final save
_OUTPUT_DIRS = ("", "checkpoints")
_OUTPUT_FILES = ("config.json", "metrics.jsonl", "wandb_id")


def check_workdir(workdir: str) -> None:
    """Fail at start, not at the first save, when the run cannot write its workdir, its
    checkpoint directory or the files it appends to. Leaves nothing behind: the probes are
    temporary files, and existing files are opened for appending without writing."""
    if not workdir:
        _refuse("workdir is empty; set config.workdir to the run's directory")
    if storage.is_remote(workdir):  # a bucket: that it exists and takes this host's writes
        problem = (
            storage.client_problem(workdir)
            or path_problem(workdir)
            or output_problem(workdir, remote=True)
        )
        if problem:
            _refuse(f"workdir={workdir!r} {problem}")
        return
    problem = path_problem(os.path.abspath(workdir))
    if problem:
        _refuse(f"workdir={workdir!r} {problem}")
    existing = os.path.abspath(workdir)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        _refuse(
            f"workdir={workdir!r}: {existing!r} is not a directory; set config.workdir to a "
            "directory path"
        )
    why = _probe_dir(existing)
    if why:
        _refuse(
            f"workdir={workdir!r}: cannot write in {existing!r} ({why}); set "
            "config.workdir to a writable directory"
        )
    for sub in _OUTPUT_DIRS:
        path = os.path.join(workdir, sub)
        why = _probe_dir(path) if sub and os.path.isdir(path) else None
        if why:
            _refuse(
                f"workdir={workdir!r}: cannot write in {path!r} ({why}); make it writable "
                "or use another workdir"
            )
    for name in _OUTPUT_FILES:
        path = os.path.join(workdir, name)
        if os.path.exists(path):
            try:
                with open(path, "a"):
                    pass
            except OSError as e:
                _refuse(
                    f"workdir={workdir!r}: cannot write {path!r} ({e.strerror}); make it "
                    "writable or use another workdir"
                )

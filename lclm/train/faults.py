"""What a training run does on each fault while it trains (docs/faults.md): non-finite steps,
failed metrics writes, failed checkpoint saves, and saves due by time. `FaultPolicy` holds the
counters the loop consults; a decision to stop raises `TrainingHalted` naming the last good
checkpoint (exit 3), so that no fault leaves a run in a state it cannot resume from.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import numpy as np
from jax.experimental import multihost_utils

from lclm.checkpoint import Checkpoints, SaveFailed
from lclm.errors import TrainingHalted
from lclm.train.metrics import MetricsFailed

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WritePatience:
    """How long a run rides out a storage fault (a disk full until a clean-up job runs, a
    network filesystem failing over) before it stops (exit 3) rather than lose work.

    `metrics_seconds`: how long writes of metrics.jsonl may fail, every one since the first,
    before the run saves a checkpoint and stops; meanwhile the records are held in memory and
    retried at each logged step. A time, not a count of failures: at a fast log rate a
    two-second hiccup is many failed writes. `save_retries`: the pauses (seconds) before each
    retry of a checkpoint save that failed; the save counts as failed once every retry has.
    """

    metrics_seconds: float = 300.0
    save_retries: tuple[float, ...] = (1.0, 4.0, 15.0)


def seconds_text(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:,.0f} s"


class FaultPolicy:
    """The run's answers to faults, one object per run.

    `checkpoints`: where the last good checkpoint is read from (for the halting message);
    `max_bad_steps`: non-finite steps in a row before the run stops; `every_seconds`: saves
    by time (0: none); `log_every` and `multi`: with several processes a time-based save is
    decided by process 0 at logging steps and broadcast (their clocks differ)."""

    def __init__(self, checkpoints: Checkpoints, patience: WritePatience, max_bad_steps: int,
                 every_seconds: float, log_every: int, multi: bool):
        self.checkpoints, self.patience = checkpoints, patience
        self.max_bad_steps, self.every_seconds = max_bad_steps, every_seconds
        self.log_every, self.multi = log_every, multi
        self.bad_in_a_row = self.skipped_steps = 0
        self.failing_since: float | None = None   # when metrics writes started failing
        self.failing_from = 0                      # the first logged step whose write failed
        self._reported = 0.0
        self.failed_saves = 0   # checkpoint saves in a row that failed, each after its retries
        self.last_saved = time.monotonic()

    def halt(self, why: str) -> TrainingHalted:
        """The error that stops the run, naming its last good checkpoint."""
        latest = self.checkpoints.latest_step()
        where = (f"step {latest} in {self.checkpoints.directory}" if latest is not None
                 else "none (this run has not saved one)")
        return TrainingHalted(f"{why}; last good checkpoint: {where}")

    # -- non-finite steps: their updates are skipped inside the step; here they are counted

    def check_step(self, step: int, skipped) -> None:
        """Count a non-finite step; stop after `max_bad_steps` in a row."""
        if not int(skipped):
            self.bad_in_a_row = 0
            return
        self.bad_in_a_row += 1
        self.skipped_steps += 1
        log.warning("step %d: non-finite loss or gradient norm, update skipped (%d in a "
                    "row, train.max_bad_steps=%d)", step, self.bad_in_a_row, self.max_bad_steps)
        if self.bad_in_a_row >= self.max_bad_steps:
            raise self.halt(f"stopped at step {step} after {self.bad_in_a_row} consecutive "
                            "steps with a non-finite loss or gradient norm (their updates were "
                            "skipped); lower train.lr or check the data")

    # -- metrics writes: ridden out for `patience.metrics_seconds`, reported at once

    def metrics_failed(self, step: int, error: MetricsFailed) -> bool:
        """Report a failed metrics.jsonl write (at once, then once a minute while it lasts);
        True once writes have failed for `patience.metrics_seconds`: the run then saves a
        checkpoint and stops, the held records in the log."""
        now = time.monotonic()
        if self.failing_since is None:
            self.failing_since, self.failing_from, self._reported = now, step, now
            log.error("%s; they are held in memory and written with the next logged step "
                      "that can (the run saves a checkpoint and stops if writes fail for %s)",
                      error, seconds_text(self.patience.metrics_seconds))
        elif now - self._reported >= 60:
            self._reported = now
            log.error("%s; failing since step %d, %s ago", error, self.failing_from,
                      seconds_text(now - self.failing_since))
        return now - self.failing_since >= self.patience.metrics_seconds

    def metrics_written(self, step: int) -> None:
        if self.failing_since is not None:
            log.warning("metrics.jsonl written again at step %d after %s of failed writes; "
                        "the records held since step %d are in it", step,
                        seconds_text(time.monotonic() - self.failing_since), self.failing_from)
            self.failing_since = None

    def metrics_stop_reason(self, step: int) -> str:
        """Why the run stops after `step` when its metrics could not be written."""
        if self.failing_since is None:
            return (f"stopped after step {step}: metrics.jsonl could not be written by "
                    "process 0; its log holds the records")
        return (f"stopped after step {step}: metrics.jsonl could not be written since step "
                f"{self.failing_from} ({seconds_text(time.monotonic() - self.failing_since)}); "
                "the records since are in the log")

    # -- checkpoint saves: retried, one failure ridden out, never two in a row

    def save(self, step: int, write: Callable[[], None], finite: bool,
             wait: bool) -> SaveFailed | None:
        """Save `step` with `write()`, retried after each pause of `patience.save_retries`
        while it fails; with `wait` a save counts only once written to the end. `finite`:
        whether the state to save is finite (else the run stops: no checkpoint of it).
        Returns the last try's failure, or None."""
        if not finite:
            raise self.halt(f"step {step}: parameters or optimizer state are not finite, so "
                            "no checkpoint was written")
        self.last_saved = time.monotonic()
        error = None
        for pause in (0.0, *self.patience.save_retries):
            if error is not None:
                log.error("%s; retrying in %g s", error, pause)
                time.sleep(pause)
            try:
                write()
                if wait:
                    self.checkpoints.wait()
                    self.save_written()
                return None
            except SaveFailed as e:
                error = e
        return error

    def save_written(self) -> None:
        """An asynchronous save reached the end."""
        self.failed_saves = 0

    def save_failed(self, error: SaveFailed, last_chance: bool) -> None:
        """A save that failed every retry: training goes on to the next checkpoint step,
        unless it is the second such save in a row or no later chance will come (a run that
        cannot save would lose its work): then the run stops with its earlier checkpoints
        intact."""
        self.failed_saves += 1
        if last_chance or self.failed_saves >= 2:
            raise self.halt(f"stopped: {error}")
        log.error("%s; training goes on and the save is retried at the next checkpoint step",
                  error)

    def due_by_time(self, step: int) -> bool:
        """Whether a time-based save is due at `step` (every process gets the same answer)."""
        if not self.every_seconds or (self.multi and step % self.log_every):
            return False
        due = time.monotonic() - self.last_saved >= self.every_seconds
        if self.multi:
            due = bool(multihost_utils.broadcast_one_to_all(np.int32(due)))
        return due

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

import jax
import numpy as np
from jax.experimental import multihost_utils

from lclm.checkpoint import Checkpoints, SaveFailed
from lclm.errors import TrainingHalted
from lclm.parallel.distributed import any_process
from lclm.training.cadence import StepPlan
from lclm.training.metrics import MetricsFailed

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WritePatience:
    """How long a run rides out a storage fault (a disk full until a clean-up job runs, a
    bucket unreachable while its network fails over) before it stops (exit 3) rather than
    lose work: `seconds` (the config's `storage_patience_seconds`), the same for checkpoint
    saves and metrics writes, and a time, not a count of failures (at a fast log rate or a
    small `checkpoint.every` a two-second hiccup is many failed writes).

    Meanwhile a failed save is tried again after `first_pause` seconds, each pause twice the
    last up to `max_pause`: training goes on between the tries, except for a final,
    preemption or stopping save, which waits for them. Failed metrics writes are held in
    memory and retried at each logged step."""

    seconds: float = 300.0
    first_pause: float = 1.0
    max_pause: float = 30.0

    def pause(self, tries: int) -> float:
        """The pause after the `tries`-th failed try (1, 2, ...)."""
        return min(self.max_pause, self.first_pause * 2 ** (tries - 1))


def seconds_text(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:,.0f} s"


class FaultPolicy:
    """The run's answers to faults, one object per run.

    `checkpoints`: where the last good checkpoint is read from (for the halting message);
    `max_bad_steps`: non-finite steps in a row before the run stops; `every_seconds`: saves
    by time (0: none); `multi`: with several processes a time-based save is decided by
    process 0 and broadcast (their clocks differ), at the steps the cadence names;
    `metrics`: where the metrics are written (`metrics.metrics_path`), for the messages."""

    def __init__(self, checkpoints: Checkpoints, patience: WritePatience, max_bad_steps: int,
                 every_seconds: float, multi: bool, metrics: str):
        self.checkpoints, self.patience, self.metrics = checkpoints, patience, metrics
        self.max_bad_steps, self.every_seconds = max_bad_steps, every_seconds
        self.multi = multi
        self.bad_in_a_row = self.skipped_steps = 0
        self._unchecked: tuple[int, jax.Array] | None = None   # (step, its skipped flag)
        self.unsaved = False   # a save failed: a later step is saved in its place
        self.failing_since: float | None = None   # when metrics writes started failing
        self.failing_from = 0                      # the first logged step whose write failed
        self._reported = 0.0
        self._metrics_tries = 0          # failed writes since then
        self._next_metrics_try = 0.0     # when the held records are tried again
        self.saves_failing_since: float | None = None   # when saves started failing
        self._save_tries = 0        # failed tries since then
        self._next_save_try = 0.0   # when the next try is due (time.monotonic())
        self._save_reported = 0.0
        self._save_error: SaveFailed | None = None   # the last failed try's
        self.last_saved = time.monotonic()

    def halt(self, why: str) -> TrainingHalted:
        """The error that stops the run, naming its last good checkpoint."""
        latest = self.checkpoints.latest_step()
        where = (f"step {latest} in {self.checkpoints.directory}" if latest is not None
                 else "none (this run has not saved one)")
        return TrainingHalted(f"{why}; last good checkpoint: {where}")

    # -- non-finite steps: their updates are skipped inside the step; here they are counted

    def step_ran(self, step: int, skipped: jax.Array) -> None:
        """`step` ran (`skipped`: its flag, on device): the previous step's flag is checked,
        this one's later, so that the host never waits for the step in flight."""
        self.check_pending()
        self._unchecked = (step, skipped)

    def check_pending(self) -> None:
        """Check the flag of the last step run now (the host waits for it anyway: it saves
        or logs that step, or the run ends)."""
        if self._unchecked is not None:
            self.check_step(*self._unchecked)
            self._unchecked = None

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

    # -- metrics writes: ridden out for `patience.seconds`, reported at once

    def metrics_due(self) -> bool:
        """Whether a logged step writes its record (and those held): always while writes
        succeed; while they fail, once the pause after the last failed try is over, so that
        an outage does not cost every logged step the storage's time to fail."""
        return self.failing_since is None or time.monotonic() >= self._next_metrics_try

    def metrics_failed(self, step: int, error: MetricsFailed, began: float) -> None:
        """Report a failed write of the metrics (at once, then once a minute while it lasts);
        `began`: when the write was started (`time.monotonic()`), so that the time a request
        waited on a silent store counts against the patience."""
        now = time.monotonic()
        if self.failing_since is None:
            self.failing_since, self.failing_from, self._reported = began, step, now
            self._metrics_tries = 0
            log.error("%s; they are held in memory and written with the next logged step "
                      "that can (the run saves a checkpoint and stops if writes fail for %s)",
                      error, seconds_text(self.patience.seconds))
        elif now - self._reported >= 60:
            self._reported = now
            log.error("%s; failing since step %d, %s ago", error, self.failing_from,
                      seconds_text(now - self.failing_since))
        self._metrics_tries += 1
        self._next_metrics_try = now + self.patience.pause(self._metrics_tries)

    def metrics_patience_spent(self) -> bool:
        """Whether writes of the metrics have failed for `patience.seconds`: the run then saves
        a checkpoint and stops, the held records in the log."""
        return (self.failing_since is not None
                and time.monotonic() - self.failing_since >= self.patience.seconds)

    def metrics_written(self, step: int) -> None:
        if self.failing_since is not None:
            log.warning("%s written again at step %d after %s of failed writes; the records "
                        "held since step %d are in it", self.metrics, step,
                        seconds_text(time.monotonic() - self.failing_since), self.failing_from)
            self.failing_since = None

    def flush_metrics(self, flush: Callable[[], None], step: int) -> None:
        """At the end of a run, write the records held back by failed writes (`flush()`
        raises `MetricsFailed`), tried again after each pause while the patience lasts; then
        the run stops (exit 3) naming the records lost to the metrics (they are in the
        log)."""
        while True:
            began = time.monotonic()
            try:
                flush()
                self.metrics_written(step)
                return
            except MetricsFailed as e:
                self.metrics_failed(step, e, began)
                if self.metrics_patience_spent():
                    raise self.halt(f"{self.metrics_stop_reason(step)} ({e})") from None
            assert self.failing_since is not None   # set by metrics_failed
            time.sleep(max(0.0, min(self._next_metrics_try,
                                    self.failing_since + self.patience.seconds)
                           - time.monotonic()))

    def metrics_stop_reason(self, step: int) -> str:
        """Why the run stops after `step` when its metrics could not be written."""
        if self.failing_since is None:
            return (f"stopped after step {step}: {self.metrics} could not be written by "
                    "process 0; its log holds the records")
        return (f"stopped after step {step}: {self.metrics} could not be written since step "
                f"{self.failing_from} ({seconds_text(time.monotonic() - self.failing_since)}); "
                "the records since are in the log")

    # -- checkpoint saves: retried for `patience.seconds` since the first failure

    def poll_saves(self) -> None:
        """After every step: report the asynchronous save that finished since, or failed (its
        step's state is gone: a later one is saved in its place, `unsaved`)."""
        try:
            saved = self.checkpoints.poll()
            if saved is not None:
                self.save_written(saved)
        except SaveFailed as e:
            self.save_trouble(e)
            self.save_failed(e, last_chance=False)
            self.unsaved = True

    def retry_now(self, plan: StepPlan) -> bool:
        """Whether a failed save is tried again at the step of `plan`: at a step the cadence
        allows, once the pause after the last try is over (with several processes they first
        agree at a logged step whether any has one to retry: every process saves, or none;
        process 0's clock decides)."""
        if self.multi and plan.log:
            self.unsaved = any_process(self.unsaved)
        if not (self.unsaved and plan.retry):
            return False
        if self.multi:
            return any_process(jax.process_index() == 0 and self.retry_due())
        return self.retry_due()

    def save_step(self, step: int, write: Callable[[], None], finite: bool, wait: bool,
                  last_chance: bool, stopping: str | None, terminated: bool = False) -> None:
        """`save` a step the loop saves; `stopping`: why the run stops after it (raised as
        `TrainingHalted`, with the save's failure if it failed). A failed save is tried again
        at a later step (`unsaved`) unless that was its last chance (`save_failed`).
        `terminated`: the save of a termination signal (a preemption leaves seconds), not
        tried again, and not tried at all while saves are failing."""
        error = self.save(step, write, finite=finite, wait=wait, last_chance=last_chance,
                          once=terminated)
        self.unsaved = error is not None
        if stopping is not None:
            raise self.halt(stopping if error is None else f"{stopping}; {error}")
        if error is not None and terminated:
            raise self.halt(f"stopped after step {step} on a termination signal: {error}")
        if error is not None:
            self.save_failed(error, last_chance)

    def wait_for_saves(self) -> None:
        """At the end of the run: the save in flight (where `stop_after` ended the loop)
        written to the end; the run stops if it fails (no later chance)."""
        try:
            self.checkpoints.wait()
        except SaveFailed as e:
            self.save_failed(e, last_chance=True)

    def save(self, step: int, write: Callable[[], None], finite: bool, wait: bool,
             last_chance: bool = False, once: bool = False) -> SaveFailed | None:
        """Save `step` with `write()`; with `wait` a save counts only once written to the end.
        `last_chance` (a final, preemption or stopping save): tried again after each pause
        while it fails and the patience lasts; otherwise one try, the next one at a later
        step (`retry_due`). `once`: one try at most, none while saves are failing. `finite`:
        whether the state to save is finite (else the run stops: no checkpoint of it).
        Returns the last try's failure, or None."""
        if not finite:
            raise self.halt(f"step {step}: parameters or optimizer state are not finite, so "
                            "no checkpoint was written")
        self.last_saved = time.monotonic()
        if self._save_error is not None and (once or (last_chance
                                                       and self.saves_patience_spent())):
            # saves are failing and the run stops: one more try (the storage clients' time to
            # fail during an outage) would only delay the stop
            return self._save_error
        while True:
            try:
                write()
                if wait:
                    self.checkpoints.wait()
                    self.save_written(step)
                return None
            except SaveFailed as e:
                self.save_trouble(e)
                if not last_chance or once or self.saves_patience_spent():
                    return e
            assert self.saves_failing_since is not None   # set by save_trouble
            time.sleep(max(0.0, min(self._next_save_try,
                                    self.saves_failing_since + self.patience.seconds)
                            - time.monotonic()))

    def save_trouble(self, error: SaveFailed) -> None:
        """A try of a save failed: logged when saves start failing, then once a minute while
        they fail; the next try is due after a pause."""
        now = time.monotonic()
        self._save_tries += 1
        self._save_error = error
        self._next_save_try = now + self.patience.pause(self._save_tries)
        if self.saves_failing_since is None:   # since the failed save began (a silent store)
            self.saves_failing_since, self._save_reported = error.began, now
            log.error("%s; retried for up to %s (storage_patience_seconds), training goes on",
                      error, seconds_text(self.patience.seconds))
        elif now - self._save_reported >= 60:
            self._save_reported = now
            log.error("%s; saves failing for %s", error,
                      seconds_text(now - self.saves_failing_since))
        else:
            log.debug("%s", error)

    def retry_due(self) -> bool:
        """Whether the pause after the last failed try of a save is over."""
        return time.monotonic() >= self._next_save_try

    def saves_patience_spent(self) -> bool:
        return (self.saves_failing_since is not None
                and time.monotonic() - self.saves_failing_since >= self.patience.seconds)

    def save_written(self, step: int) -> None:
        """A save reached the end (one line if saves had been failing)."""
        if self.saves_failing_since is not None:
            log.warning("checkpoint step %d saved, after %s of failed saves (%d failed "
                        "tries)", step, seconds_text(time.monotonic() - self.saves_failing_since),
                        self._save_tries)
        self.saves_failing_since, self._save_tries, self._next_save_try = None, 0, 0.0
        self._save_error = None

    def save_failed(self, error: SaveFailed, last_chance: bool) -> None:
        """A save that failed: training goes on and the save is tried again at a later step,
        unless saves have failed for `patience.seconds` or no later chance will come (a run
        that cannot save would lose its work): then the run stops with its earlier
        checkpoints intact."""
        if last_chance or self.saves_patience_spent():
            since = (seconds_text(time.monotonic() - self.saves_failing_since)
                     if self.saves_failing_since is not None else "")
            raise self.halt(f"stopped: {error}" + (f"; saves failed for {since} "
                            f"(storage_patience_seconds={self.patience.seconds:g})"
                            if since else ""))

    def due_by_time(self) -> bool:
        """Whether a time-based save is due (every process gets the same answer: with several,
        call it at the same steps on each, `StepPlan.by_time`)."""
        if not self.every_seconds:
            return False
        due = time.monotonic() - self.last_saved >= self.every_seconds
        if self.multi:
            due = bool(multihost_utils.broadcast_one_to_all(np.int32(due)))
        return due

"""What a training run does when a checkpoint save fails, and when a save is due by time
(docs/faults.md). A failed save is tried again at a later step once a pause is over (the
pauses and the patience are `WritePatience`'s); a final, preemption or stopping save is
retried before the run goes on.
When saves have failed for the patience, or a save that was the last chance fails, the run
stops with `TrainingHalted` naming its last good checkpoint (exit 3), so that no fault leaves
a run in a state it cannot resume from.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

from lclm.errors import TrainingHalted
from lclm.parallel.distributed import any_process
from lclm.train.cadence import StepPlan
from lclm.train.write_patience import WritePatience, seconds_text
from lclm.workdir.checkpoint import Checkpoints, SaveFailed

log = logging.getLogger(__name__)


class SaveFaults:
    """The run's answers to failed saves, one object per run; its `halt` is how any fault
    stops the run (`StepFaults` is given it).

    `checkpoints`: the run's, saved through it and where the last good checkpoint is read
    from (for the halting message); `every_seconds`: saves by time (0: none); `multi`: with
    several processes a time-based save is decided by process 0 and broadcast (their clocks
    differ), at the steps the cadence names."""

    def __init__(
        self, checkpoints: Checkpoints, patience: WritePatience, every_seconds: float, multi: bool
    ):
        self.checkpoints, self.patience = checkpoints, patience
        self.every_seconds, self.multi = every_seconds, multi
        self.unsaved = False  # a save failed: a later step is saved in its place
        self.saves_failing_since: float | None = None  # when saves started failing
        self._save_tries = 0  # failed tries since then
        self._next_save_try = 0.0  # when the next try is due (time.monotonic())
        self._save_reported = 0.0
        self._save_error: SaveFailed | None = None  # the last failed try's
        self.last_saved = time.monotonic()

    def halt(self, why: str) -> TrainingHalted:
        """The error that stops the run, naming its last good checkpoint."""
        latest = self.checkpoints.latest_step()
        where = (
            f"step {latest} in {self.checkpoints.directory}"
            if latest is not None
            else "none (this run has not saved one)"
        )
        return TrainingHalted(f"{why}; last good checkpoint: {where}")

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

    def save_step(
        self,
        step: int,
        write: Callable[[], None],
        finite: bool,
        wait: bool,
        last_chance: bool,
        stopping: str | None,
        terminated: bool = False,
    ) -> None:
        """`save` a step the loop saves; `stopping`: why the run stops after it (raised as
        `TrainingHalted`, with the save's failure if it failed). A failed save is tried again
        at a later step (`unsaved`) unless that was its last chance (`save_failed`).
        `terminated`: the save of a termination signal (a preemption leaves seconds), not
        tried again, and not tried at all while saves are failing."""
        error = self.save(
            step, write, finite=finite, wait=wait, last_chance=last_chance, once=terminated
        )
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

    def save(
        self,
        step: int,
        write: Callable[[], None],
        finite: bool,
        wait: bool,
        last_chance: bool = False,
        once: bool = False,
    ) -> SaveFailed | None:
        """Save `step` with `write()`; with `wait` a save counts only once written to the end.
        `last_chance` (a final, preemption or stopping save): tried again after each pause
        while it fails and the patience lasts; otherwise one try, the next one at a later
        step (`retry_due`). `once`: one try at most, none while saves are failing. `finite`:
        whether the state to save is finite (else the run stops: no checkpoint of it).
        Returns the last try's failure, or None."""
        if not finite:
            raise self.halt(
                f"step {step}: parameters or optimizer state are not finite, so "
                "no checkpoint was written"
            )
        self.last_saved = time.monotonic()
        if self._save_error is not None and (once or (last_chance and self.saves_patience_spent())):
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
            assert self.saves_failing_since is not None  # set by save_trouble
            time.sleep(
                max(
                    0.0,
                    min(self._next_save_try, self.saves_failing_since + self.patience.seconds)
                    - time.monotonic(),
                )
            )

    def save_trouble(self, error: SaveFailed) -> None:
        """A try of a save failed: logged when saves start failing, then once a minute while
        they fail; the next try is due after a pause."""
        now = time.monotonic()
        self._save_tries += 1
        self._save_error = error
        self._next_save_try = now + self.patience.pause(self._save_tries)
        if self.saves_failing_since is None:  # since the failed save began (a silent store)
            self.saves_failing_since, self._save_reported = error.began, now
            log.error(
                "%s; retried for up to %s (storage_patience_seconds), training goes on",
                error,
                seconds_text(self.patience.seconds),
            )
        elif now - self._save_reported >= 60:
            self._save_reported = now
            log.error(
                "%s; saves failing for %s", error, seconds_text(now - self.saves_failing_since)
            )
        else:
            log.debug("%s", error)

    def retry_due(self) -> bool:
        """Whether the pause after the last failed try of a save is over."""
        return time.monotonic() >= self._next_save_try

    def saves_patience_spent(self) -> bool:
        return (
            self.saves_failing_since is not None
            and time.monotonic() - self.saves_failing_since >= self.patience.seconds
        )

    def save_written(self, step: int) -> None:
        """A save reached the end (one line if saves had been failing)."""
        if self.saves_failing_since is not None:
            log.warning(
                "checkpoint step %d saved, after %s of failed saves (%d failed tries)",
                step,
                seconds_text(time.monotonic() - self.saves_failing_since),
                self._save_tries,
            )
        self.saves_failing_since, self._save_tries, self._next_save_try = None, 0, 0.0
        self._save_error = None

    def save_failed(self, error: SaveFailed, last_chance: bool) -> None:
        """A save that failed: training goes on and the save is tried again at a later step,
        unless saves have failed for `patience.seconds` or no later chance will come (a run
        that cannot save would lose its work): then the run stops with its earlier
        checkpoints intact."""
        if last_chance or self.saves_patience_spent():
            since = (
                seconds_text(time.monotonic() - self.saves_failing_since)
                if self.saves_failing_since is not None
                else ""
            )
            raise self.halt(
                f"stopped: {error}"
                + (
                    f"; saves failed for {since} "
                    f"(storage_patience_seconds={self.patience.seconds:g})"
                    if since
                    else ""
                )
            )

    def due_by_time(self) -> bool:
        """Whether a time-based save is due (every process gets the same answer: with several,
        call it at the same steps on each, `StepPlan.by_time`)."""
        if not self.every_seconds:
            return False
        due = time.monotonic() - self.last_saved >= self.every_seconds
        if self.multi:
            due = bool(multihost_utils.broadcast_one_to_all(np.int32(due)))
        return due

"""What a training run does on the faults of its steps (docs/faults.md): a non-finite step
(its update is skipped inside the step; here they are counted, and too many in a row stop the
run) and a failed write of a logged step's metrics (held in memory and retried for
`WritePatience.seconds`, then the run stops). A stop raises the `TrainingHalted` of
`SaveFaults.halt`, naming the last good checkpoint (exit 3).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import jax

from lclm.errors import TrainingHalted
from lclm.train.metrics import MetricsFailed
from lclm.train.write_patience import WritePatience, seconds_text

log = logging.getLogger(__name__)


class StepFaults:
    """The run's answers to non-finite steps and failed metrics writes, one object per run.

    `halt`: the error that stops the run for a reason, naming its last good checkpoint
    (`SaveFaults.halt`); `max_bad_steps`: non-finite steps in a row before the run stops;
    `metrics`: where the metrics are written (`metrics.metrics_path`), for the messages."""

    def __init__(
        self,
        halt: Callable[[str], TrainingHalted],
        patience: WritePatience,
        max_bad_steps: int,
        metrics: str,
    ):
        self.halt, self.patience, self.metrics = halt, patience, metrics
        self.max_bad_steps = max_bad_steps
        self.bad_in_a_row = self.skipped_steps = 0
        self._unchecked: tuple[int, jax.Array] | None = None  # (step, its skipped flag)
        self.failing_since: float | None = None  # when metrics writes started failing
        self.failing_from = 0  # the first logged step whose write failed
        self._reported = 0.0
        self._metrics_tries = 0  # failed writes since then
        self._next_metrics_try = 0.0  # when the held records are tried again

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
        log.warning(
            "step %d: non-finite loss or gradient norm, update skipped (%d in a "
            "row, train.max_bad_steps=%d)",
            step,
            self.bad_in_a_row,
            self.max_bad_steps,
        )
        if self.bad_in_a_row >= self.max_bad_steps:
            raise self.halt(
                f"stopped at step {step} after {self.bad_in_a_row} consecutive "
                "steps with a non-finite loss or gradient norm (their updates were "
                "skipped); lower train.lr or check the data"
            )

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
            log.error(
                "%s; they are held in memory and written with the next logged step "
                "that can (the run saves a checkpoint and stops if writes fail for %s)",
                error,
                seconds_text(self.patience.seconds),
            )
        elif now - self._reported >= 60:
            self._reported = now
            log.error(
                "%s; failing since step %d, %s ago",
                error,
                self.failing_from,
                seconds_text(now - self.failing_since),
            )
        self._metrics_tries += 1
        self._next_metrics_try = now + self.patience.pause(self._metrics_tries)

    def metrics_patience_spent(self) -> bool:
        """Whether writes of the metrics have failed for `patience.seconds`: the run then saves
        a checkpoint and stops, the held records in the log."""
        return (
            self.failing_since is not None
            and time.monotonic() - self.failing_since >= self.patience.seconds
        )

    def metrics_written(self, step: int) -> None:
        if self.failing_since is not None:
            log.warning(
                "%s written again at step %d after %s of failed writes; the records "
                "held since step %d are in it",
                self.metrics,
                step,
                seconds_text(time.monotonic() - self.failing_since),
                self.failing_from,
            )
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
            assert self.failing_since is not None  # set by metrics_failed
            time.sleep(
                max(
                    0.0,
                    min(self._next_metrics_try, self.failing_since + self.patience.seconds)
                    - time.monotonic(),
                )
            )

    def metrics_stop_reason(self, step: int) -> str:
        """Why the run stops after `step` when its metrics could not be written."""
        if self.failing_since is None:
            return (
                f"stopped after step {step}: {self.metrics} could not be written by "
                "process 0; its log holds the records"
            )
        return (
            f"stopped after step {step}: {self.metrics} could not be written since step "
            f"{self.failing_from} ({seconds_text(time.monotonic() - self.failing_since)}); "
            "the records since are in the log"
        )

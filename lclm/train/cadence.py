"""What each step of a run does besides training: log, validate, save, try a failed save
again, decide a save by time, stop. A pure function of the step number (and of whether a
termination was signalled), so that it is tested without devices; the loop asks it and
nothing else counts steps. What happens by time or on a fault (a save due by the clock, a
failed save's pause: `lclm.train.save_faults`; a non-finite step:
`lclm.train.step_faults`) is decided there.
"""

from __future__ import annotations

import dataclasses

from lclm.config.run_config import RunConfig


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What one step does after its update.

    `log`: a metric record (metrics.jsonl, the progress line); `validate`: with held-out
    losses in it; `save`: a checkpoint by step count (`checkpoint.every`), the final step or a
    termination; `last_chance`: that save is written to the end (and tried again while it
    fails) before the run goes on, as no later step will save; `retry`: a failed save may be
    tried again here (with several processes only at a logged step, where they agree);
    `by_time`: a save by time (`checkpoint.every_minutes`) may be decided here (with several
    processes process 0's clock decides, at a multiple of `log.every`); `stop`: the run stops
    after this step (a termination: the steps after it are left for the resume)."""

    log: bool
    validate: bool
    save: bool
    last_chance: bool
    retry: bool
    by_time: bool
    stop: bool


@dataclasses.dataclass(frozen=True)
class Cadence:
    """The steps of a run: `first` (the resumed step + 1) to `last`, which is `total`
    (`train.steps`) or earlier where the run stops as a crash would (`stop_after`).

    `log_every` (`log.every`), `validate_every` (`validation.every`; 0: no held-out data),
    `save_every` (`checkpoint.every`; 0: no saves by step count), `validate_at_start`
    (`validation.at_start`), `multi` (several processes)."""

    first: int
    last: int
    total: int
    log_every: int
    validate_every: int = 0
    save_every: int = 0
    validate_at_start: bool = False
    multi: bool = False

    @classmethod
    def of(cls, config: RunConfig, first: int, stop_after: int | None, multi: bool) -> Cadence:
        """The cadence of `config` (its train, log, validation and checkpoint sections) for a
        run that trains from step `first`."""
        total = config.train.steps
        return cls(
            first=first,
            last=total if stop_after is None else min(total, stop_after),
            total=total,
            log_every=config.log.every,
            validate_every=config.validation.every if config.validation.path else 0,
            save_every=config.checkpoint.every,
            validate_at_start=config.validation.at_start,
            multi=multi,
        )

    def steps(self) -> range:
        """The steps this run trains (empty when it is already trained to `total`)."""
        return range(self.first, self.last + 1)

    @property
    def trained(self) -> bool:
        """Whether the run is already trained to `total`: nothing to do."""
        return self.first > self.total

    @property
    def validates_at_start(self) -> bool:
        """Whether the first weights' held-out loss is measured (a step-0 record): a fresh
        run with held-out data and `validation.at_start`."""
        return bool(self.validate_every) and self.validate_at_start and self.first == 1

    def at(self, step: int, terminated: bool = False) -> StepPlan:
        """What `step` does; `terminated`: a termination was signalled (SIGTERM, SIGINT, a
        preemption notice): the step is logged and saved, and the run stops after it."""
        validate = bool(self.validate_every) and (
            step % self.validate_every == 0 or step == self.last
        )
        log = (
            step % self.log_every == 0 or step in (self.first, self.last) or terminated or validate
        )
        final = step == self.total
        return StepPlan(
            log=log,
            validate=validate,
            save=(bool(self.save_every) and step % self.save_every == 0) or final or terminated,
            last_chance=final or terminated,
            retry=log or not self.multi,
            by_time=not self.multi or step % self.log_every == 0,
            stop=terminated,
        )

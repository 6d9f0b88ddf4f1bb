"""What the training loop does around its steps besides saving them, as hooks it calls in
order: held-out losses (`Validation`), the records' throughput (`Throughput`), metrics.jsonl
and wandb with the check that the workdir is still the run's (`MetricsWriter`), and process
0's console (`Console`: "compiling", the progress bar or lines, the summary).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence

import jax

from lclm import storage
from lclm.config.run_config import RunConfig
from lclm.config.schema import Data
from lclm.data.loader import HostBatches, parse_sources
from lclm.data.sources import DataError, open_documents
from lclm.errors import ConfigError
from lclm.hardware import peak_flops
from lclm.parallel.distributed import any_process
from lclm.train.cadence import Cadence, StepPlan
from lclm.train.metrics import MetricsFailed, MetricsLogger, Progress, flops_per_token
from lclm.train.step import jit_eval_loss
from lclm.train.step_faults import StepFaults
from lclm.workdir.checkpoint import Checkpoints
from lclm.workdir.lock import WorkdirLock
from lclm.workdir.state import TrainState

log = logging.getLogger(__name__)


class Hook:
    """One concern of the loop; it does nothing where a method is not overridden. Hooks run
    in the order of the loop's list: each sees a record as the hooks before it left it."""

    def on_step(self, step: int) -> None:
        """After every step's update (cheap: no device values)."""

    def on_log(self, record: dict, state: TrainState, plan: StepPlan) -> str | None:
        """A logged step's `record` (`state`: after its update); returns why the run stops
        after this step (it is saved first), or None."""
        return None

    def on_end(self, summary: list[str]) -> None:
        """The run trained its steps; `summary`: what it did (empty where it trained none)."""


def log_record(
    hooks: Sequence[Hook], record: dict, state: TrainState, plan: StepPlan
) -> str | None:
    """Every hook's `on_log`, in order; the first reason to stop, or None."""
    reasons = [hook.on_log(record, state, plan) for hook in hooks]
    return next((why for why in reasons if why is not None), None)


class Validation(Hook):
    """Held-out losses in the records of the steps the cadence validates: `val_loss` at the
    run's own length and, where it measures several, `val_loss@LEN` for each (its own
    included). `losses(params) -> {length: mean token loss}`."""

    def __init__(self, seq_len: int, losses: Callable[[dict], dict[int, float]]):
        self.seq_len, self.losses = seq_len, losses

    @classmethod
    def of(
        cls, run: RunConfig, held_out: dict[int, RunConfig], mesh, tokenizer, model, param_sharding
    ) -> Validation | None:
        """The mean loss over the first `validation.batches` batches of `validation.path` at
        each length of `held_out` (`config.run_config.held_out_runs`: read once, so every
        evaluation sees the same tokens; `data.batch_size` rows of each length), or None
        when the run has no validation data."""
        if not held_out:
            return None
        batches_of = {}
        for length, sections in held_out.items():
            try:
                reader = HostBatches(sections, mesh, tokenizer, prefetch=0)
            except DataError:
                _check_validation_size(run, tokenizer)  # the loader's advice is for training
                raise
            try:
                batches_of[length] = [next(reader) for _ in range(run.validation.batches)]
            finally:
                reader.close()
        loss_fn = jit_eval_loss(
            model,
            run.attention,
            mesh,
            param_sharding,  # a program a length
            document_mask=run.data.document_mask,
        )

        def losses(params) -> dict[int, float]:
            means = {}
            for length, batches in batches_of.items():
                sums = [jax.device_get(loss_fn(params, batch)) for batch in batches]
                means[length] = float(sum(t for t, _ in sums)) / max(
                    float(sum(c for _, c in sums)), 1.0
                )
            return means

        return cls(run.data.seq_len, losses)

    def fields(self, params) -> dict:
        """A record's held-out losses under `params` (every process computes them)."""
        losses = self.losses(params)
        fields = dict(val_loss=losses[self.seq_len])
        if len(losses) > 1:
            fields.update({f"val_loss@{n}": x for n, x in losses.items()})
        return fields

    def on_log(self, record: dict, state: TrainState, plan: StepPlan) -> str | None:
        if plan.validate:
            record.update(self.fields(state.params))
        return None


def _check_validation_size(sections: RunConfig, tokenizer) -> None:
    """A ConfigError naming the validation keys when a source of `validation.path` holds
    fewer records than a batch has rows (each row reads its own records, as in training):
    the fix is more held-out data, not another `data.batch_size`, which would change the
    training run."""
    v, d = sections.validation, sections.data
    for kind, path, *_ in parse_sources(v.path, d.source, "validation.path"):
        found = len(
            open_documents(
                kind, path, tokenizer, text_field=d.text_field, chat_template=d.chat_template
            )
        )
        if found < d.batch_size:
            raise ConfigError(
                f"validation.path={v.path!r}: {path} has {found} usable record(s), fewer than "
                f"the data.batch_size={d.batch_size} rows of a validation batch (each row reads "
                f"its own records; validation.batches={v.batches} batches read "
                f"{v.batches * d.batch_size} rows of {d.seq_len} tokens); give "
                f"validation.path at least {d.batch_size} held-out records, or set "
                "validation.path='' to train without validation"
            )


class Throughput(Hook):
    """A logged step's record: its metrics, and tokens/s, step time and MFU as the mean over
    the steps since the previous logged one, with where the loop waited in that time: for
    its batches (`data_wait_time`) and on saves (`save_block_time`), seconds per step; the
    first record also has the compile time of the step (`compile_time`). Its `on_log`
    restarts that clock: the hooks before it in the list (validation) are not counted in the
    next steps' time."""

    def __init__(self, data: Data, model, devices: Sequence[jax.Device], first_step: int):
        self.tokens_per_step = data.batch_size * data.seq_len
        self.flops_per_step = flops_per_token(model, data.seq_len) * self.tokens_per_step
        self.peak, self.devices = peak_flops(devices[0].device_kind), len(devices)
        self.started = time.perf_counter()
        self.first_logged: float | None = None  # compilation excluded from the summary's rate
        self._t0, self._since = self.started, first_step - 1
        self.compile_seconds: float | None = None
        self.waits = {"data": 0.0, "save": 0.0}  # seconds, since the run's first step
        self._waits_then = dict(self.waits)  # ... at the previous record

    def compiled(self, seconds: float) -> None:
        """The first call of the step took `seconds`: tracing and compiling it (and with
        `_Loop.sync`, running it)."""
        self.compile_seconds = seconds

    def waited(self, what: str, seconds: float) -> None:
        """The loop waited `seconds` for a batch (`what`='data') or on a save ('save')."""
        self.waits[what] += seconds

    def record(self, step: int, metrics: dict, skipped_steps: int) -> dict:
        """`step`'s record from its `metrics` (on the host)."""
        now = time.perf_counter()
        steps = step - self._since
        seconds = (now - self._t0) / steps
        record = dict(
            step=step,
            loss=float(metrics["loss"]),
            lr=float(metrics["lr"]),
            grad_norm=float(metrics["grad_norm"]),
            tokens_per_sec=self.tokens_per_step / seconds,
            step_time=seconds,
            mfu=(
                (self.flops_per_step / seconds / (self.peak * self.devices)) if self.peak else None
            ),
            skipped_steps=skipped_steps,
            data_wait_time=(self.waits["data"] - self._waits_then["data"]) / steps,
            save_block_time=(self.waits["save"] - self._waits_then["save"]) / steps,
        )
        if self.first_logged is None and self.compile_seconds is not None:
            record["compile_time"] = self.compile_seconds
        self.first_logged = self.first_logged or now
        return record

    def on_log(self, record: dict, state: TrainState, plan: StepPlan) -> str | None:
        self._t0, self._since = time.perf_counter(), record["step"]
        self._waits_then = dict(self.waits)
        return None

    def where_time_went(self) -> str:
        """The summary's line of what held the run back: the compile, the data, the saves
        (shares of the time since the first step)."""
        total = max(time.perf_counter() - self.started, 1e-9)
        parts = (
            []
            if self.compile_seconds is None
            else [f"compiling the step {self.compile_seconds:,.1f} s"]
        )
        parts += [
            f"{label} {self.waits[what]:,.1f} s ({100 * self.waits[what] / total:.1f}%)"
            for what, label in (("data", "waiting for data"), ("save", "blocked by saves"))
        ]
        return f"time: {total:,.0f} s from the first step; " + ", ".join(parts)

    def summary(self, records: list[dict]) -> str:
        """What the run trained, in how long, and its throughput after the first logged
        step (compilation excluded)."""
        first, last = records[0], records[-1]
        now = time.perf_counter()

        def loss(record):
            return "nan" if not math.isfinite(record["loss"]) else f"{record['loss']:.4f}"

        line = (
            f"trained steps {first['step']}-{last['step']} in {now - self.started:,.0f} s; "
            f"loss {loss(first)} -> {loss(last)}"
        )
        if last["step"] > first["step"]:
            assert self.first_logged is not None  # set with the first record
            steady = (
                (last["step"] - first["step"]) * self.tokens_per_step / (now - self.first_logged)
            )
            line += f"; {steady:,.0f} tokens/s after compilation"
        return line


class MetricsWriter(Hook):
    """Each record to metrics.jsonl and wandb (`logger`: process 0's, None on the others), a
    failed write ridden out as `faults` decides; at each logged step, the check that the
    workdir is still this run's (`lock`): with several processes all stop with process 0."""

    def __init__(
        self, logger: MetricsLogger | None, lock: WorkdirLock, faults: StepFaults, multi: bool
    ):
        self.logger, self.lock, self.faults, self.multi = logger, lock, faults, multi
        self.last_step: int | None = None

    def on_log(self, record: dict, state: TrainState, plan: StepPlan) -> str | None:
        step = self.last_step = record["step"]
        give_up = False
        if self.logger:
            if self.faults.metrics_due():
                began = time.monotonic()
                try:
                    self.logger.log(record)
                    self.faults.metrics_written(step)
                except MetricsFailed as e:
                    self.faults.metrics_failed(step, e, began)
            else:  # writes are failing: held until the pause after the last try is over
                self.logger.log(record, write=False)
            give_up = self.faults.metrics_patience_spent()
        lost = self.lock.lost()  # None, or why another run now holds the workdir
        if self.multi:  # only process 0 writes metrics and holds the lock
            give_up = any_process(give_up)
            lost = lost or (
                "process 0 lost the workdir lock" if any_process(lost is not None) else None
            )
        if lost:  # the workdir is another run's now: write nothing more to it
            raise self.faults.halt(
                f"stopped after step {step}: {lost}; this run stops so "
                "that two runs never write one workdir"
            )
        return self.faults.metrics_stop_reason(step) if give_up else None

    def flush_held(self) -> None:
        """At the end of the run, before its summary: the records held back by failed
        writes."""
        if self.logger is not None and self.faults.failing_since is not None:
            # the last logged steps' records: retried while the patience lasts, else the run
            # stops naming them (they go to the log)
            assert self.last_step is not None  # writes failed at a logged step
            self.faults.flush_metrics(self.logger.flush, self.last_step)


class Console(Hook):
    """Process 0's console: "compiling" until the first step is done, then with
    `log.progress` a progress bar or line (`metrics.Progress`), else the log; the summary."""

    def __init__(self, sections: RunConfig, cadence: Cadence):
        self.progress = None
        if cadence.trained:
            log.info(
                "%s is already trained to step %d (train.steps); nothing to do: raise "
                "train.steps to train on",
                sections.workdir,
                cadence.total,
            )
        elif sections.log.progress:  # it says "compiling" itself
            self.progress = Progress(cadence.total, cadence.first)
        else:
            log.info("compiling the training step (step %d of %d)", cadence.first, cadence.total)

    def on_step(self, step: int) -> None:
        if self.progress:
            self.progress.step_done(step)

    def on_log(self, record: dict, state: TrainState, plan: StepPlan) -> str | None:
        if self.progress:
            self.progress.update(record)
        return None

    def on_end(self, summary: list[str]) -> None:
        if self.progress:
            self.progress.close(summary)
        else:
            for line in summary:
                log.info("%s", line)


def summary(
    records: list[dict],
    throughput: Throughput,
    checkpoints: Checkpoints,
    logger: MetricsLogger | None,
) -> list[str]:
    """What a finished (or stopped) run did and where its outputs are; empty where it
    trained no step."""
    if not records:
        return []
    latest = checkpoints.latest_step()
    lines = [
        throughput.summary(records),
        throughput.where_time_went(),
        "final checkpoint: "
        + (storage.join(checkpoints.directory, str(latest)) if latest is not None else "none"),
    ]
    return lines + (logger.outputs() if logger is not None else [])

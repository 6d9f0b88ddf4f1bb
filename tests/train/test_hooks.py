"""What a logged step does besides saving (lclm.train.hooks), hook by hook and without a model:
held-out losses, the records' throughput, metrics.jsonl, the console, and the order the loop
calls them in."""

import json
import logging
import os
import time

import jax
import pytest
from support import small_train_config

from lclm.config.model import ModelConfig
from lclm.config.run_config import run_config
from lclm.train.cadence import Cadence
from lclm.train.hooks import (
    Console,
    Hook,
    MetricsWriter,
    Throughput,
    Validation,
    log_record,
    summary,
)
from lclm.train.metrics import MetricsLogger
from lclm.train.save_faults import SaveFaults
from lclm.train.step_faults import StepFaults
from lclm.train.write_patience import WritePatience
from lclm.workdir.checkpoint import Checkpoints
from lclm.workdir.lock import WorkdirLock
from lclm.workdir.state import TrainState

_METRICS = dict(loss=2.5, lr=1e-3, grad_norm=0.5)


class _Stops(Hook):
    def __init__(self, why, seen):
        self.why, self.seen = why, seen

    def on_log(self, record, state, plan):
        self.seen.append((self.why, dict(record)))
        record[f"by {self.why}"] = True
        return self.why


def test_every_hook_sees_the_record_as_the_earlier_ones_left_it_and_the_first_stop_wins():
    seen = []
    plan = Cadence(first=1, last=4, total=4, log_every=1).at(2)
    record = dict(step=2)
    assert log_record([_Stops("a", seen), Hook(), _Stops("b", seen)], record, None, plan) == "a"
    assert seen == [("a", dict(step=2)), ("b", {"step": 2, "by a": True})]


def test_validation_adds_held_out_losses_at_the_steps_the_cadence_validates():
    cadence = Cadence(first=1, last=6, total=6, log_every=1, validate_every=3)
    one = Validation(64, lambda params: {64: 2.0})
    several = Validation(64, lambda params: {32: 1.5, 64: 2.0})
    state = TrainState(2, {}, None)  # the losses above read no parameters
    records = {s: dict(step=s) for s in (2, 3)}
    for step, record in records.items():
        one.on_log(record, state, cadence.at(step))
    assert records == {2: dict(step=2), 3: dict(step=3, val_loss=2.0)}
    assert several.fields(None) == {"val_loss": 2.0, "val_loss@32": 1.5, "val_loss@64": 2.0}


def test_throughput_counts_the_steps_since_the_last_logged_one_and_restarts_after_validation(
    tmp_path,
):
    config = small_train_config(tmp_path, mesh={}, attention={})
    clock = Throughput(
        run_config(config).data, ModelConfig.from_config(config.model), jax.devices(), 1
    )
    plan = Cadence(first=1, last=8, total=8, log_every=4).at(4)
    first = clock.record(1, _METRICS, skipped_steps=0)
    clock.on_log(first, None, plan)
    time.sleep(0.3)  # steps 2 to 4
    record = clock.record(4, _METRICS, skipped_steps=1)
    assert record["step_time"] >= 0.1  # the mean over 3 steps
    assert record["step_time"] * record["tokens_per_sec"] == pytest.approx(4 * 64)  # batch x len
    assert (record["loss"], record["skipped_steps"], record["mfu"]) == (2.5, 1, None)  # CPU
    time.sleep(0.3)  # validation: a hook before the clock in the loop's list
    clock.on_log(record, None, plan)
    assert clock.record(5, _METRICS, 0)["step_time"] < 0.3
    line = clock.summary([first, record])
    assert line.startswith("trained steps 1-4 in ") and "loss 2.5000 -> 2.5000" in line
    assert "tokens/s after compilation" in line


def test_throughput_says_how_long_the_steps_waited_for_data_and_saves_and_the_compile(tmp_path):
    """Issue 77 item 4: each record holds the mean wait per step for data and on saves since
    the previous record, the first one the compile; the summary says what each cost in all."""
    config = small_train_config(tmp_path, mesh={}, attention={})
    clock = Throughput(
        run_config(config).data, ModelConfig.from_config(config.model), jax.devices(), 1
    )
    plan = Cadence(first=1, last=8, total=8, log_every=4).at(4)
    clock.waited("data", 0.5)
    clock.compiled(12.0)
    first = clock.record(1, _METRICS, 0)
    assert (first["compile_time"], first["data_wait_time"], first["save_block_time"]) == (
        12.0,
        0.5,
        0.0,
    )
    clock.on_log(first, None, plan)
    for _ in range(3):  # steps 2 to 4: one waits for data, the last one's save blocks
        clock.waited("data", 0.1)
    clock.waited("save", 0.6)
    record = clock.record(4, _METRICS, 0)
    assert "compile_time" not in record
    assert record["data_wait_time"] == pytest.approx(0.1)
    assert record["save_block_time"] == pytest.approx(0.2)
    line = clock.where_time_went()
    assert line.startswith("time: ") and "compiling the step 12.0 s" in line
    assert "waiting for data 0.8 s (" in line and "blocked by saves 0.6 s (" in line


def test_the_console_shows_what_held_the_steps_back_where_it_is_a_share_worth_a_look():
    import io

    from lclm.train.metrics import Progress

    out = io.StringIO()
    progress = Progress(8, 1, stream=out)
    base = dict(step=4, loss=2.5, lr=1e-3, tokens_per_sec=100.0, step_time=1.0)
    progress.update(dict(base, data_wait_time=0.25, save_block_time=0.001))
    progress.update(dict(base, step=8, data_wait_time=0.0, save_block_time=0.5))
    lines = out.getvalue().splitlines()
    assert "data wait 25%" in lines[-2] and "save" not in lines[-2]
    assert "save 50%" in lines[-1] and "data wait" not in lines[-1]


def test_metrics_writer_writes_each_record_and_the_summary_names_the_outputs(tmp_path):
    lock = WorkdirLock(str(tmp_path))
    lock.acquire()
    checkpoints = Checkpoints(str(tmp_path), keep=1)
    try:
        saves = SaveFaults(checkpoints, WritePatience(5), every_seconds=0, multi=False)
        faults = StepFaults(
            saves.halt, WritePatience(5), max_bad_steps=3, metrics=str(tmp_path / "metrics.jsonl")
        )
        logger = MetricsLogger(str(tmp_path))
        writer = MetricsWriter(logger, lock, faults, multi=False)
        plan = Cadence(first=1, last=2, total=2, log_every=1).at(1)
        assert writer.on_log(dict(step=1, loss=float("nan")), None, plan) is None
        config = small_train_config(tmp_path, mesh={}, attention={})
        clock = Throughput(
            run_config(config).data, ModelConfig.from_config(config.model), jax.devices(), 1
        )
        lines = summary([clock.record(1, _METRICS, 0)], clock, checkpoints, logger)
        logger.close()
    finally:
        checkpoints.close()
        lock.release()
    with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
        assert [json.loads(line) for line in f] == [dict(step=1, loss=None)]
    assert lines[1].startswith("time: ")
    assert lines[2:] == ["final checkpoint: none", f"metrics: {tmp_path}/metrics.jsonl"]
    assert summary([], clock, checkpoints, logger) == []


def test_console_without_progress_logs_compiling_and_the_summary(tmp_path, caplog):
    config = small_train_config(tmp_path, mesh={}, attention={})
    with caplog.at_level(logging.INFO, logger="lclm.train.hooks"):
        console = Console(run_config(config), Cadence(first=3, last=8, total=8, log_every=1))
        console.on_step(3)
        console.on_end(["trained steps 3-8", "final checkpoint: none"])
        Console(run_config(config), Cadence(first=9, last=8, total=8, log_every=1))
    assert [r.getMessage() for r in caplog.records] == [
        "compiling the training step (step 3 of 8)",
        "trained steps 3-8",
        "final checkpoint: none",
        f"{tmp_path} is already trained to step 8 (train.steps); nothing to do: raise "
        "train.steps to train on",
    ]

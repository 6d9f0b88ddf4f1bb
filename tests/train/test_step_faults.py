"""What a run does on the faults of its steps (lclm.train.step_faults): non-finite steps
counted, checked one step late, and a stop after too many in a row; failed metrics writes
reported, paused between tries and ridden out for the patience. No model, no training: the
flags and the failing writes are given by hand (test_faults trains through real ones)."""

import logging
import time

import numpy as np
import pytest

from lclm.errors import TrainingHalted
from lclm.train.metrics import MetricsFailed
from lclm.train.step_faults import StepFaults
from lclm.train.write_patience import WritePatience

# short pauses and patience: a lasting fault's test takes a fraction of a second
_PATIENCE = WritePatience(seconds=0.3, first_pause=0.05, max_pause=0.1)


def _faults(max_bad_steps=3):
    return StepFaults(TrainingHalted, _PATIENCE, max_bad_steps, metrics="run/metrics.jsonl")


def test_non_finite_steps_are_counted_and_a_finite_one_ends_the_row(caplog):
    faults = _faults()
    with caplog.at_level(logging.WARNING):
        for skipped in (1, 1, 0, 1):
            faults.check_step(7, np.int32(skipped))
    assert (faults.bad_in_a_row, faults.skipped_steps) == (1, 3)
    assert caplog.text.count("step 7: non-finite loss or gradient norm, update skipped") == 3


def test_max_bad_steps_in_a_row_stop_the_run_with_why():
    faults = _faults(max_bad_steps=2)
    faults.check_step(4, True)
    with pytest.raises(TrainingHalted, match="stopped at step 5 after 2 consecutive steps"):
        faults.check_step(5, True)


def test_a_steps_flag_is_checked_when_the_next_step_ran_or_when_asked():
    faults = _faults()
    faults.step_ran(1, np.int32(1))
    assert faults.skipped_steps == 0  # the host did not wait for step 1
    faults.step_ran(2, np.int32(1))
    assert faults.skipped_steps == 1
    faults.check_pending()
    faults.check_pending()  # once checked, a flag is not counted again
    assert (faults.skipped_steps, faults.bad_in_a_row) == (2, 2)


def test_a_failed_metrics_write_is_reported_once_and_tried_again_after_a_pause(caplog):
    faults = _faults()
    assert faults.metrics_due() and not faults.metrics_patience_spent()
    with caplog.at_level(logging.INFO):
        faults.metrics_failed(3, MetricsFailed("could not write 1 record(s)"), time.monotonic())
        assert not faults.metrics_due()  # the pause after the failed try
        faults.metrics_failed(4, MetricsFailed("could not write 2 record(s)"), time.monotonic())
        time.sleep(_PATIENCE.pause(2))
        assert faults.metrics_due()
        faults.metrics_written(5)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "held in memory" in errors[0]
    assert "run/metrics.jsonl written again at step 5" in caplog.text
    assert "held since step 3" in caplog.text
    assert faults.failing_since is None and faults.metrics_due()


def test_metrics_failing_for_the_patience_name_the_steps_since():
    faults = _faults()
    began = time.monotonic() - _PATIENCE.seconds  # a write that waited on a silent store
    faults.metrics_failed(6, MetricsFailed("could not write 1 record(s)"), began)
    assert faults.metrics_patience_spent()
    assert faults.metrics_stop_reason(8).startswith(
        "stopped after step 8: run/metrics.jsonl could not be written since step 6 ("
    )
    faults.metrics_written(9)
    assert "could not be written by process 0" in faults.metrics_stop_reason(9)


def test_flush_retries_the_held_records_until_they_are_written():
    faults, tries = _faults(), []

    def flush():
        tries.append(time.monotonic())
        if len(tries) < 3:
            raise MetricsFailed("could not write 2 record(s)")

    faults.flush_metrics(flush, 10)
    assert len(tries) == 3 and faults.failing_since is None
    assert tries[1] - tries[0] >= _PATIENCE.pause(1)  # paused between the tries


def test_flush_that_keeps_failing_stops_the_run_once_the_patience_is_spent():
    faults, tries = _faults(), []

    def flush():
        tries.append(time.monotonic())
        raise MetricsFailed("could not write 2 record(s)")

    with pytest.raises(TrainingHalted) as e:
        faults.flush_metrics(flush, 10)
    assert str(e.value).startswith(
        "stopped after step 10: run/metrics.jsonl could not be written since step 10"
    )
    assert "(could not write 2 record(s))" in str(e.value)
    assert tries[-1] - tries[0] >= _PATIENCE.seconds - 0.01 and len(tries) < 10

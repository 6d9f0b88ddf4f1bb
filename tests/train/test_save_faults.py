"""What a run does when a checkpoint save fails, and when a save is due by time
(lclm.train.save_faults): a failed save reported once and tried again at a later step after
a pause, a last-chance save retried while the patience lasts, the stop naming the last good
checkpoint. Real checkpoints in a temporary workdir; the failing writes are given by hand
(test_faults and test_bucket_outage train through real storage faults)."""

import logging
import time

import jax.numpy as jnp
import pytest

from lclm.errors import TrainingHalted
from lclm.train.cadence import Cadence
from lclm.train.save_faults import SaveFaults
from lclm.train.write_patience import WritePatience
from lclm.workdir.checkpoint import Checkpoints, SaveFailed
from lclm.workdir.state import TrainState

# short pauses and patience: a lasting fault's test takes a fraction of a second
_PATIENCE = WritePatience(seconds=0.3, first_pause=0.05, max_pause=0.1)


@pytest.fixture
def checkpoints(tmp_path):
    checkpoints = Checkpoints(str(tmp_path), keep=2)
    yield checkpoints
    checkpoints.close()


def _write(checkpoints, step):
    """A save of a tiny state at `step` (returns once started, as the loop's)."""
    state = TrainState(step=jnp.int32(step), params={"w": jnp.ones(4)}, opt_state={})
    return lambda: checkpoints.save(step, state, None, {})


def _failing(tries, fail=1_000):
    """A write that fails its first `fail` tries, each try's time appended to `tries`."""

    def write():
        tries.append(time.monotonic())
        if len(tries) <= fail:
            raise SaveFailed(
                f"checkpoint step 9 could not be saved (try {len(tries)})", began=tries[-1]
            )

    return write


def test_patience_pauses_double_up_to_the_longest():
    assert [WritePatience(first_pause=1, max_pause=5).pause(t) for t in (1, 2, 3, 4)] == [
        1,
        2,
        4,
        5,
    ]


def test_the_halt_names_the_last_good_checkpoint(checkpoints):
    faults = SaveFaults(checkpoints, _PATIENCE, every_seconds=0, multi=False)
    assert str(faults.halt("stopped")) == (
        "stopped; last good checkpoint: none (this run has not saved one)"
    )
    faults.save_step(
        2, _write(checkpoints, 2), finite=True, wait=True, last_chance=False, stopping=None
    )
    assert str(faults.halt("stopped")) == (
        f"stopped; last good checkpoint: step 2 in {checkpoints.directory}"
    )


def test_a_failed_save_is_reported_once_and_a_later_step_saved_in_its_place(checkpoints, caplog):
    faults, tries = SaveFaults(checkpoints, _PATIENCE, every_seconds=0, multi=False), []
    plan = Cadence(first=1, last=20, total=20, log_every=1).at(5)
    with caplog.at_level(logging.INFO):
        faults.save_step(
            4, _failing(tries), finite=True, wait=False, last_chance=False, stopping=None
        )
        assert faults.unsaved and not faults.retry_now(plan)  # the pause after the try
        time.sleep(_PATIENCE.pause(1))
        assert faults.retry_now(plan)
        faults.save_step(
            5, _write(checkpoints, 5), finite=True, wait=True, last_chance=False, stopping=None
        )
    assert not faults.unsaved and checkpoints.latest_step() == 5
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [
        "checkpoint step 9 could not be saved (try 1); retried for up to 0.3 s "
        "(storage_patience_seconds), training goes on"
    ]
    assert "checkpoint step 5 saved, after" in caplog.text and "(1 failed tries)" in caplog.text


def test_a_last_chance_save_is_retried_after_each_pause_until_written(checkpoints):
    faults, tries = SaveFaults(checkpoints, _PATIENCE, every_seconds=0, multi=False), []
    faults.save_step(
        9, _failing(tries, fail=2), finite=True, wait=True, last_chance=True, stopping=None
    )
    assert len(tries) == 3 and not faults.unsaved
    assert tries[1] - tries[0] >= _PATIENCE.pause(1)
    assert tries[2] - tries[1] >= _PATIENCE.pause(2)


def test_a_last_chance_save_that_keeps_failing_stops_the_run_once_the_patience_is_spent(
    checkpoints,
):
    faults, tries = SaveFaults(checkpoints, _PATIENCE, every_seconds=0, multi=False), []
    with pytest.raises(TrainingHalted) as e:
        faults.save_step(
            9, _failing(tries), finite=True, wait=True, last_chance=True, stopping=None
        )
    assert str(e.value).startswith("stopped: checkpoint step 9 could not be saved (try ")
    assert "storage_patience_seconds=0.3" in str(e.value)
    assert str(e.value).endswith("last good checkpoint: none (this run has not saved one)")
    assert tries[-1] - tries[0] >= _PATIENCE.seconds - 0.01 and len(tries) < 10


def test_saves_failing_for_the_patience_stop_the_run_at_a_later_failure(checkpoints):
    faults, tries = SaveFaults(checkpoints, _PATIENCE, every_seconds=0, multi=False), []
    faults.save_step(3, _failing(tries), finite=True, wait=False, last_chance=False, stopping=None)
    time.sleep(_PATIENCE.seconds)
    with pytest.raises(TrainingHalted, match="saves failed for"):
        faults.save_step(
            4, _failing(tries), finite=True, wait=False, last_chance=False, stopping=None
        )


def test_a_stopping_save_stops_the_run_with_why_and_its_failure(checkpoints):
    faults = SaveFaults(checkpoints, _PATIENCE, every_seconds=0, multi=False)
    with pytest.raises(TrainingHalted, match=r"^metrics lost; last good checkpoint: step 2 "):
        faults.save_step(
            2,
            _write(checkpoints, 2),
            finite=True,
            wait=True,
            last_chance=True,
            stopping="metrics lost",
        )
    faults = SaveFaults(checkpoints, WritePatience(seconds=0), every_seconds=0, multi=False)
    with pytest.raises(TrainingHalted, match=r"^metrics lost; checkpoint step 9 could not be "):
        faults.save_step(
            3, _failing([]), finite=True, wait=True, last_chance=True, stopping="metrics lost"
        )


def test_a_termination_save_is_tried_once_and_not_at_all_while_saves_fail(checkpoints):
    faults, tries = SaveFaults(checkpoints, _PATIENCE, every_seconds=0, multi=False), []
    faults.save_step(3, _failing(tries), finite=True, wait=False, last_chance=False, stopping=None)
    with pytest.raises(TrainingHalted, match="stopped after step 4 on a termination signal"):
        faults.save_step(
            4,
            _failing(tries),
            finite=True,
            wait=True,
            last_chance=True,
            stopping=None,
            terminated=True,
        )
    assert len(tries) == 1  # a preemption leaves seconds: no try bound to fail


def test_a_non_finite_state_is_never_saved(checkpoints):
    faults, tries = SaveFaults(checkpoints, _PATIENCE, every_seconds=0, multi=False), []
    with pytest.raises(
        TrainingHalted,
        match="step 6: parameters or optimizer state are not finite, so no checkpoint was written",
    ):
        faults.save_step(
            6, _failing(tries), finite=False, wait=True, last_chance=True, stopping=None
        )
    assert tries == []


def test_a_save_is_due_by_time_every_seconds_after_the_last(checkpoints):
    assert not SaveFaults(checkpoints, _PATIENCE, every_seconds=0, multi=False).due_by_time()
    faults = SaveFaults(checkpoints, _PATIENCE, every_seconds=0.1, multi=False)
    assert not faults.due_by_time()
    time.sleep(0.1)
    assert faults.due_by_time()
    faults.save_step(
        2, _write(checkpoints, 2), finite=True, wait=False, last_chance=False, stopping=None
    )
    assert not faults.due_by_time()  # the clock restarts at each save
    faults.wait_for_saves()
    assert checkpoints.latest_step() == 2


def test_an_asynchronous_save_that_completes_after_failed_ones_is_reported_by_poll(
    checkpoints, caplog
):
    faults = SaveFaults(checkpoints, _PATIENCE, every_seconds=0, multi=False)
    faults.save_step(2, _failing([]), finite=True, wait=False, last_chance=False, stopping=None)
    with caplog.at_level(logging.WARNING):
        faults.save_step(
            3, _write(checkpoints, 3), finite=True, wait=False, last_chance=False, stopping=None
        )
        assert faults.saves_failing_since is not None  # not written to the end yet
        checkpoints.wait()
        faults.poll_saves()
    assert faults.saves_failing_since is None and faults.retry_due()
    assert "checkpoint step 3 saved, after" in caplog.text

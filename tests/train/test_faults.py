"""Faults a week-long run meets: damaged checkpoints, failed saves, a second run on the same
workdir, non-finite steps, re-run steps in metrics.jsonl. Every fault is real (damaged files
on disk, a read-only or full filesystem, a live second process), never a mock."""

import contextlib
import glob
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
from support import DAMAGE, DEMO_CONFIG, ROOT, damage_checkpoint, small_train_config

from lclm import hf
from lclm.config import ModelConfig, load_config
from lclm.config.run_config import run_config
from lclm.errors import ConfigError, TrainingHalted
from lclm.models.decoder import init_params
from lclm.parallel import make_mesh
from lclm.train.loop import train
from lclm.train.metrics import truncate_metrics
from lclm.train.step import make_optimizer
from lclm.workdir.checkpoint import Checkpoints
from lclm.workdir.lock import WorkdirBusy, WorkdirLock
from lclm.workdir.state import init_state

pytestmark = pytest.mark.slow  # trains models or starts processes: left out by -m 'not slow'


def _config(workdir, patience=None, **train):
    """`patience`: storage_patience_seconds (short ones keep a lasting fault's test short)."""
    config = small_train_config(
        workdir,
        mesh=dict(dp=1, fsdp=2, tp=1, sp=2),
        attention=dict(q_chunk=16, kv_chunk=16),
        train=train,
    )
    if patience is not None:
        config.storage_patience_seconds = patience
    return config


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """A 2-step run with a checkpoint at step 2 (copied by each test that resumes it)."""
    workdir = tmp_path_factory.mktemp("base") / "run"
    train(_config(workdir, steps=2))
    return workdir


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A 4-step run with checkpoints at steps 2 and 4 (copied by each test that damages it)."""
    workdir = tmp_path_factory.mktemp("base") / "run"
    train(_config(workdir))
    return workdir


# -- damaged checkpoints --------------------------------------------------------------------


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_latest_checkpoint_is_set_aside_and_the_previous_one_used(
    finished_run, tmp_path, kind, caplog
):
    workdir = tmp_path / "run"
    shutil.copytree(finished_run, workdir)
    damage_checkpoint(str(workdir / "checkpoints" / "4"), kind)
    config = _config(workdir)
    template = init_state(
        ModelConfig.from_config(config.model),
        make_optimizer(run_config(config).train),
        make_mesh(fsdp=2, sp=2),
        seed=7,
    )
    checkpoints = Checkpoints(str(workdir), keep=3)
    with caplog.at_level(logging.ERROR):
        state, data = checkpoints.restore(template)
    checkpoints.close()
    assert int(state.step) == 2 and data[0]["batches"] == 2
    assert "checkpoint step 4" in caplog.text and "moved it to" in caplog.text
    assert sorted(os.listdir(workdir / "checkpoints")) == ["2"]
    (aside,) = os.listdir(workdir / "checkpoints_damaged")  # kept, not deleted
    assert aside.startswith("4-")


def test_after_falling_back_the_run_goes_on_and_saves_that_step_again(finished_run, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(finished_run, workdir)
    damage_checkpoint(str(workdir / "checkpoints" / "4"), "truncated chunks")
    records = train(_config(workdir, steps=6))
    assert [r["step"] for r in records] == [3, 4, 5, 6]
    assert sorted(os.listdir(workdir / "checkpoints"), key=int) == ["2", "4", "6"]
    # the re-run step 3 reproduces the original one (same data, same restored state)
    original = {r["step"]: r["loss"] for r in map(json.loads, open(finished_run / "metrics.jsonl"))}
    assert records[0]["loss"] == pytest.approx(original[3], rel=1e-6)


def test_no_readable_checkpoint_is_one_clear_error(finished_run, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(finished_run, workdir)
    for step in ("2", "4"):
        damage_checkpoint(str(workdir / "checkpoints" / step), "garbage _METADATA")
    with pytest.raises(Exception, match="no readable checkpoint") as e:
        train(_config(workdir, steps=6))
    assert "\n" not in str(e.value)
    assert len(os.listdir(workdir / "checkpoints_damaged")) == 2


# -- failed saves ---------------------------------------------------------------------------


def _refuse_writes(path):
    """Make `path` (a directory: new entries; a file: writes, even through open files) refuse
    writes for real: immutable for root, mode 555 otherwise; returns the undo command."""
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i", str(path)], check=True)
        return ["chattr", "-i", str(path)]
    os.chmod(path, 0o555)
    return ["chmod", "755" if os.path.isdir(path) else "644", str(path)]


@contextlib.contextmanager
def _when_logged(text, action):
    """Run `action` once, when the run logs a message containing `text` (a fault that
    appears after the start-up checks have passed)."""

    class Trigger(logging.Handler):
        def emit(self, record):
            if text in record.getMessage() and not self.done:
                self.done = True
                action()

    handler, logger = Trigger(), logging.getLogger("lclm")
    handler.done, level = False, logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@contextlib.contextmanager
def _read_only(path, when=None):
    """`path` refuses writes inside the block: from its start, or from when the run logs
    `when`; yields a function that ends the fault early."""
    if (
        os.geteuid() == 0
        and subprocess.run(["lsattr", "-d", str(path)], capture_output=True).returncode
    ):
        pytest.skip("chattr +i is not available here")
    undo = []

    def end():
        while undo:
            subprocess.run(undo.pop(), check=True)

    def start():
        undo.append(_refuse_writes(path))

    if when is None:
        start()
    try:
        with _when_logged(when, start) if when else contextlib.nullcontext():
            yield end
    finally:
        end()


def test_an_unwritable_checkpoint_directory_fails_at_start(two_steps, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(two_steps, workdir)
    metrics = (workdir / "metrics.jsonl").read_text()
    with _read_only(workdir / "checkpoints"), pytest.raises(ConfigError) as e:
        train(_config(workdir, steps=6))
    assert str(e.value).startswith(f"workdir={str(workdir)!r}: cannot write in ")
    assert (workdir / "metrics.jsonl").read_text() == metrics


def test_a_failed_save_is_reported_at_once_retried_then_stops_with_earlier_ones_intact(
    two_steps, tmp_path, caplog
):
    workdir = tmp_path / "run"
    shutil.copytree(two_steps, workdir)
    with (
        _read_only(workdir / "checkpoints", when="restored checkpoint step 2"),
        caplog.at_level(logging.ERROR),
        pytest.raises(TrainingHalted) as e,
    ):
        train(_config(workdir, steps=6, patience=1.5))
    message = str(e.value)
    assert "\n" not in message
    assert "checkpoint step 6 could not be saved" in message
    assert "intact checkpoints: [2]" in message
    assert re.search(r"saves failed for [\d.]+ s \(storage_patience_seconds=1.5\)", message)
    assert "last good checkpoint: step 2" in message
    # step 4's failure was reported when it happened, once, and training went on to step 6,
    # whose final save was tried again until the patience was spent
    assert "checkpoint step 4 could not be saved" in caplog.text
    assert caplog.text.count("retried for up to 1.5 s (storage_patience_seconds)") == 1
    assert "Traceback" not in caplog.text
    assert os.listdir(workdir / "checkpoints") == ["2"]
    steps = [json.loads(l)["step"] for l in open(workdir / "metrics.jsonl")]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_a_save_that_fails_once_is_retried_and_the_run_completes(two_steps, tmp_path, caplog):
    workdir = tmp_path / "run"
    shutil.copytree(two_steps, workdir)
    # the fault goes away once it has been reported: the retry saves that same step
    with (
        _read_only(workdir / "checkpoints", when="restored checkpoint step 2") as end,
        _when_logged("retried for up to", lambda: end()),
        caplog.at_level(logging.INFO),
    ):
        records = train(_config(workdir, steps=6))
    assert records[-1]["step"] == 6
    assert re.search(r"checkpoint step [56] saved, after [\d.]+ s of failed saves", caplog.text), (
        caplog.text
    )
    saved = sorted(os.listdir(workdir / "checkpoints"), key=int)
    assert saved[0] == "2" and saved[-1] == "6" and "4" not in saved


def test_a_failed_final_save_is_retried_before_the_run_stops(two_steps, tmp_path, caplog):
    workdir = tmp_path / "run"
    shutil.copytree(two_steps, workdir)
    config = _config(workdir, steps=3)  # step 3: the final save, no periodic one before it
    with (
        _read_only(workdir / "checkpoints", when="restored checkpoint step 2") as end,
        _when_logged("retried for up to", lambda: end()),
        caplog.at_level(logging.INFO),
    ):
        records = train(config)
    assert [r["step"] for r in records] == [3]
    assert "checkpoint step 3 could not be saved" in caplog.text
    assert "checkpoint step 3 saved, after" in caplog.text
    assert sorted(os.listdir(workdir / "checkpoints"), key=int) == ["2", "3"]


def test_metrics_that_cannot_be_written_for_a_while_are_held_then_the_run_saves_and_stops(
    two_steps, tmp_path, caplog
):
    """A failed metrics.jsonl write is held and retried at logged steps (after pauses of 1 s,
    doubling); once writes have failed for `storage_patience_seconds` the run saves a
    checkpoint and stops (exit 3) with the held records in the log (named by their path)."""
    workdir = tmp_path / "run"
    shutil.copytree(two_steps, workdir)
    config = _config(workdir, steps=10_000)  # it stops long before
    config.checkpoint.every = 0  # only the save before it stops
    config.storage_patience_seconds = 1.0
    with (
        _read_only(workdir / "metrics.jsonl", when="compiling the training step"),
        caplog.at_level(logging.ERROR),
        pytest.raises(TrainingHalted) as e,
    ):
        train(config)
    message = str(e.value)
    match = re.fullmatch(
        rf"stopped after step (\d+): {workdir}/metrics.jsonl could not be "
        r"written since "
        r"step 3 \(([\d.]+) s\); the records since are in the log; last good "
        r"checkpoint: step (\d+) in (.*)",
        message,
    )
    assert match, message
    stopped, seconds = int(match[1]), float(match[2])
    assert stopped > 3 and seconds >= 1.0  # not the second failure in a row: a time
    assert int(match[3]) == stopped and match[4] == str(workdir / "checkpoints")
    assert "\n" not in message and "Traceback" not in caplog.text
    # reported at once, not once a logged step; the held records are in the log
    assert caplog.text.count("could not write 1 record(s)") == 1
    assert f"{stopped - 2} record(s) not written" in caplog.text
    for step in range(3, stopped + 1):
        assert f'"step": {step},' in caplog.text
    assert sorted(os.listdir(workdir / "checkpoints"), key=int) == ["2", str(stopped)]
    # the disk is back: it resumes after the saved step
    records = train(_config(workdir, steps=stopped + 2))
    assert [r["step"] for r in records] == [stopped + 1, stopped + 2]


def _ends_after(seconds, end):
    """A thread that ends a fault `seconds` after it is started."""
    return threading.Timer(seconds, end)


def _errors(caplog):
    return [r for r in caplog.records if r.levelno >= logging.ERROR]


# steps that each save (about 0.3 s a step on 2 cores): many times the 3 s of the fault
STEPS_WHILE_SAVES_FAIL = 150


@pytest.mark.parametrize("patience, survives", [(10.0, True), (1.0, False)])
def test_how_long_failing_saves_are_ridden_out_is_one_patience_whatever_checkpoint_every(
    two_steps, tmp_path, caplog, patience, survives
):
    """A 3 s fault while every step saves (checkpoint.every=1): within a 10 s patience the run
    goes on (many failed saves in a row: not a count, a time), says in one line when a retry
    succeeds, and logs one ERROR for the whole fault; against a 1 s patience it stops (exit
    3) with its checkpoints intact and every trained step's metrics written (issue 62)."""
    workdir = tmp_path / "run"
    shutil.copytree(two_steps, workdir)
    config = _config(workdir, steps=STEPS_WHILE_SAVES_FAIL, patience=patience)
    config.checkpoint.update(every=1, keep=2)
    timers = []

    def start(end):  # once the fault is on: it ends 3 s later
        timers.append(_ends_after(3.0, end))
        timers[-1].start()

    with (
        _read_only(workdir / "checkpoints", when="restored checkpoint step 2") as end,
        _when_logged("retried for up to", lambda: start(end)),
        caplog.at_level(logging.INFO),
    ):
        if survives:
            records = train(config)
        else:
            with pytest.raises(TrainingHalted) as e:
                train(config)
    for timer in timers:
        timer.join()
    steps = [json.loads(line)["step"] for line in open(workdir / "metrics.jsonl")]
    if survives:
        last = STEPS_WHILE_SAVES_FAIL
        assert records[-1]["step"] == last and steps == list(range(1, last + 1))
        assert re.search(
            r"checkpoint step \d+ saved, after [\d.]+ s of failed saves \(\d+ "
            r"failed tries\)",
            caplog.text,
        ), caplog.text
        assert len(_errors(caplog)) == 1, [r.getMessage() for r in _errors(caplog)]
        assert sorted(os.listdir(workdir / "checkpoints"), key=int) == [str(last - 1), str(last)]
    else:
        message = str(e.value)
        assert "\n" not in message
        assert re.search(
            r"saves failed for [\d.]+ s \(storage_patience_seconds=1\); last good "
            r"checkpoint: step 2 in ",
            message,
        ), message
        assert sorted(os.listdir(workdir / "checkpoints"), key=int) == ["2"]
        assert steps == list(range(1, steps[-1] + 1)) and steps[-1] > 3
    assert "Traceback" not in caplog.text


@pytest.mark.parametrize("fault_seconds", [1.5, None])
def test_a_run_that_ends_while_metrics_cannot_be_written_retries_then_names_the_loss(
    two_steps, tmp_path, caplog, fault_seconds
):
    """The last records of a run whose metrics.jsonl cannot be written at its end are written
    once the fault ends within the patience (3 s); a fault that outlasts it stops the run
    (exit 3) naming the records metrics.jsonl lacks, instead of exit 0 with them lost."""
    workdir = tmp_path / "run"
    shutil.copytree(two_steps, workdir)
    config = _config(workdir, steps=4, patience=3.0)
    timers = []

    def start(end):
        if fault_seconds is not None:
            timers.append(_ends_after(fault_seconds, end))
            timers[-1].start()

    with (
        _read_only(workdir / "metrics.jsonl", when="compiling the training step") as end,
        _when_logged("held in memory", lambda: start(end)),
        caplog.at_level(logging.INFO),
    ):
        if fault_seconds is not None:
            train(config)
        else:
            with pytest.raises(TrainingHalted) as e:
                train(config)
    for timer in timers:
        timer.join()
    steps = [json.loads(line)["step"] for line in open(workdir / "metrics.jsonl")]
    assert sorted(os.listdir(workdir / "checkpoints"), key=int) == ["2", "4"]
    if fault_seconds is not None:
        assert steps == [1, 2, 3, 4]
        assert f"{workdir}/metrics.jsonl written again at step 4" in caplog.text
    else:
        assert steps == [1, 2]
        message = str(e.value)
        assert message.startswith(
            f"stopped after step 4: {workdir}/metrics.jsonl could not be written since step 3 ("
        ), message
        assert "the records since are in the log" in message and "\n" not in message
        assert '"step": 4,' in caplog.text  # the records: in the log


def test_metrics_write_that_fails_once_loses_nothing(two_steps, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(two_steps, workdir)
    with (
        _read_only(workdir / "metrics.jsonl", when="compiling the training step") as end,
        _when_logged("held in memory and written with the next logged step", lambda: end()),
    ):
        train(_config(workdir, steps=6))
    steps = [json.loads(line)["step"] for line in open(workdir / "metrics.jsonl")]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_time_based_checkpoints(tmp_path):
    """checkpoint.every_minutes saves on time alone (checkpoint.every=0)."""
    config = _config(tmp_path / "run", steps=4)
    config.checkpoint.update(every=0, every_minutes=1e-9)  # due after every step
    train(config)
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints"), key=int) == ["2", "3", "4"]


# -- a full disk ----------------------------------------------------------------------------


@contextlib.contextmanager
def _small_disk(tmp_path, size: str):
    """A real filesystem of `size` (a tmpfs: root only, else the test skips)."""
    mount = tmp_path / "small_disk"
    mount.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        yield mount
    finally:
        # lazily: Orbax's background threads may still hold a file of a failed save
        subprocess.run(["umount", "-l", str(mount)], check=True)


def _fill(mount, after_lines: int, until):
    """A thread that fills the filesystem at `mount` once `<mount>/run/metrics.jsonl` holds
    `after_lines` lines, and empties it again once `until(time it became full)` is true."""

    def run():
        metrics = mount / "run" / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_bytes().count(b"\n") >= after_lines):
            time.sleep(0.005)
        with open(mount / "filler", "wb") as f:
            with contextlib.suppress(OSError):  # until no space is left
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
        full_since = time.monotonic()
        while not until(full_since):
            time.sleep(0.005)
        os.remove(mount / "filler")

    return threading.Thread(target=run, daemon=True)


# tensorstore's writes still in flight when a save fails must not print tracebacks either
no_unraisable_tracebacks = pytest.mark.filterwarnings(
    "error::pytest.PytestUnraisableExceptionWarning"
)


@no_unraisable_tracebacks
def test_a_full_disk_fails_the_asynchronous_save_and_is_reported(tmp_path, caplog):
    # a real filesystem with room for one checkpoint of this model (1.8 MB, uncompressed) but
    # not two
    with _small_disk(tmp_path, "2600k") as mount:
        workdir = mount / "run"
        with caplog.at_level(logging.ERROR), pytest.raises(TrainingHalted) as e:
            train(_config(workdir, steps=6, patience=1.0))
        assert "No space left on device" in caplog.text or "RESOURCE_EXHAUSTED" in caplog.text
        assert "intact checkpoints: [2]" in str(e.value)
        assert sorted(s for s in os.listdir(workdir / "checkpoints") if s.isdigit()) == ["2"]
        # Orbax's save threads report the failure too: in one line each, like lclm
        assert "Traceback" not in caplog.text
        assert "retried for up to 1.0 s" in caplog.text


@no_unraisable_tracebacks
def test_a_two_second_full_disk_loses_nothing_and_prints_no_traceback(tmp_path, caplog, capfd):
    """The workdir's filesystem is full for 2 s while no save is due, at a fast log rate:
    the run rides it out, finishes, and metrics.jsonl holds every step (issue 40)."""
    with _small_disk(tmp_path, "4m") as mount:
        config = _config(mount / "run", steps=150)
        config.checkpoint.every = 0  # only the final save
        filler = _fill(mount, 3, until=lambda full_since: time.monotonic() - full_since >= 2)
        with (
            _when_logged("compiling the training step", filler.start),
            caplog.at_level(logging.INFO),
        ):
            records = train(config)
        filler.join(timeout=60)
        assert records[-1]["step"] == 150
        assert "No space left on device" in caplog.text  # the fault did hit the run
        assert "metrics.jsonl written again at step" in caplog.text
        steps = [json.loads(line)["step"] for line in open(mount / "run" / "metrics.jsonl")]
        assert steps == list(range(1, 151))
        assert os.listdir(mount / "run" / "checkpoints") == ["150"]
        assert "Traceback" not in caplog.text + capfd.readouterr().err


@no_unraisable_tracebacks
def test_an_asynchronous_save_that_fails_is_retried_soon_at_a_later_step(tmp_path, caplog):
    """A save that fails (the disk filled up) is tried again at the first step after its pause
    (1 s; here the run's last step comes first), one line saying when a save succeeds."""
    with _small_disk(tmp_path, "16m") as mount:  # room for 3 checkpoints
        config = _config(mount / "run", steps=60)
        config.checkpoint.every = 20
        failed = threading.Event()
        filler = _fill(mount, 5, until=lambda _: failed.is_set())  # full from step 6 on
        with (
            _when_logged("compiling the training step", filler.start),
            _when_logged("retried for up to", failed.set),
            caplog.at_level(logging.INFO),
        ):
            records = train(config)
        filler.join(timeout=60)
        assert records[-1]["step"] == 60
        assert "checkpoint step 20 could not be saved" in caplog.text
        assert re.search(r"checkpoint step \d+ saved, after [\d.]+ s of failed saves", caplog.text)
        saved = sorted(int(s) for s in os.listdir(mount / "run" / "checkpoints") if s.isdigit())
        assert saved[-1] == 60 and 20 not in saved, saved
        assert "Traceback" not in caplog.text
        steps = [json.loads(line)["step"] for line in open(mount / "run" / "metrics.jsonl")]
        assert steps == list(range(1, 61))


# -- one live run per workdir ---------------------------------------------------------------


def test_a_second_run_on_a_live_workdir_is_refused(tmp_path):
    workdir = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from lclm.workdir.lock import WorkdirLock; "
            f"WorkdirLock({str(workdir)!r}).acquire(); print('held', flush=True); time.sleep(60)",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(WorkdirBusy, match=f"in use by a live run \\(pid {holder.pid} on "):
            train(_config(workdir))
        assert not (workdir / "config.json").exists() and not (workdir / "checkpoints").exists()
    finally:
        holder.kill()
        holder.wait()
    # the holder died without releasing: the next run takes the lock over
    lock = WorkdirLock(str(workdir))
    lock.acquire()
    assert json.load(open(workdir / "lock"))["pid"] == os.getpid()
    lock.release()
    assert not (workdir / "lock").exists()


def test_a_run_whose_lock_was_taken_over_stops_and_writes_nothing_more(tmp_path):
    """A run whose renewals did not reach the filesystem may find its lease taken over by a
    requeued copy of itself: it stops at its next logged step instead of writing on."""
    workdir = tmp_path / "run"
    config = _config(workdir, steps=20)
    config.workdir_lease_minutes = 0.005  # renewed (and checked) every 0.06 s

    def take_over():
        # as a run taking a lock over writes it: whole, by a rename, so that the lock is never
        # seen missing (a missing lock is another stop, "was deleted")
        (workdir / "lock.other").write_text(
            json.dumps(dict(host="node-7", pid=4242, token="other"))
        )
        os.replace(workdir / "lock.other", workdir / "lock")

    with _when_logged("compiling the training step", take_over), pytest.raises(TrainingHalted) as e:
        train(config)
    message = str(e.value)
    assert re.fullmatch(
        r"stopped after step \d+: the lock .* was taken over by pid 4242 on "
        r"node-7 .*; this run stops so that two runs never write one workdir; "
        r"last good checkpoint: .*",
        message,
    ), message
    assert json.loads((workdir / "lock").read_text())["token"] == "other"  # left alone


# -- refused resumes -------------------------------------------------------------------------


def _command_line(config) -> list[str]:
    """train.py's arguments for `config`: configs/demo.py and an override per field that
    differs from it."""

    def leaves(tree, prefix=""):
        for key, value in tree.items():
            if isinstance(value, dict):
                yield from leaves(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}", value

    demo = dict(leaves(load_config(DEMO_CONFIG).to_dict()))
    return ["--config", DEMO_CONFIG] + [
        f"--config.{key}={value}" for key, value in leaves(config.to_dict()) if demo[key] != value
    ]


@pytest.mark.parametrize("allowed", ["", "model.vocab_size"])
def test_a_refused_resume_initialises_nothing_and_leaves_config_json_alone(
    two_steps, tmp_path, allowed
):
    """A resume that changes the model is refused (exit 2, one line) before the model is
    initialised, and config.json still describes the workdir's checkpoints (issue 40); so is
    one whose change checkpoint.allow_changed lets through but whose parameter shapes differ
    from the checkpoint's metadata (issue 62)."""
    workdir = tmp_path / "run"
    shutil.copytree(two_steps, workdir)
    before = (workdir / "config.json").read_bytes()
    config = _config(workdir, steps=4)
    # 2**21 x 64 embeddings and output projection: 268M parameters, 3.2 GB with Adam's
    # moments, that the refused run must never allocate
    config.model.vocab_size = 2**21
    config.checkpoint.allow_changed = allowed
    # The run's own peak resident memory, VmHWM of its process image, written as it exits.
    # Not wait4's ru_maxrss: Linux carries a forked child's maxrss over its exec, so that
    # reports this pytest worker's size (4.6 GB in CI) rather than the run's.
    peak = tmp_path / "peak_kib"
    measured = (
        "import atexit, runpy, sys\n"
        "def peak():\n"
        "    status = open('/proc/self/status').read().split('VmHWM:')[1]\n"
        f"    open({str(peak)!r}, 'w').write(status.split()[0])\n"
        "atexit.register(peak)\n"
        "sys.argv = sys.argv[1:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", measured, os.path.join(ROOT, "train.py"), *_command_line(config)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    stderr = run.stderr
    assert run.returncode == 2, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert errors == [stderr.splitlines()[-1]] and "Traceback" not in stderr, stderr
    assert errors[0].startswith(
        "error: checkpoint step 2 parameter ['embed'] has shape (512, 64) but the model "
        "expects (2097152, 64); "
        if allowed
        else "error: the checkpoint (step 2) was written "
        "with another config: model.vocab_size 512 -> 2097152; "
    ), errors[0]
    assert (workdir / "config.json").read_bytes() == before
    peak_gb = int(peak.read_text()) / 2**20
    assert peak_gb < 1.5, f"the refused run peaked at {peak_gb:.1f} GB"


# -- non-finite steps -----------------------------------------------------------------------


def test_non_finite_steps_are_skipped_then_the_run_stops(tmp_path, caplog):
    # an absurd learning rate: step 1's update makes every later loss overflow
    config = _config(tmp_path / "run", steps=10, lr=1e30, warmup=0, max_bad_steps=3)
    config.checkpoint.every = 1
    with caplog.at_level(logging.WARNING), pytest.raises(TrainingHalted) as e:
        train(config)
    message = str(e.value)
    assert "\n" not in message
    assert "stopped at step 4 after 3 consecutive steps with a non-finite" in message
    # step 4 is found bad before its save: the checkpoints are steps 1-3
    assert "last good checkpoint: step 3" in message
    assert caplog.text.count("update skipped") == 3
    records = [json.loads(l) for l in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["skipped_steps"] for r in records] == [0, 1, 2]
    assert records[0]["loss"] is not None and records[1]["loss"] is None
    # skipped updates left the parameters of step 1 untouched: every checkpoint has them
    config.train.steps = 1
    template = init_state(
        ModelConfig.from_config(config.model),
        make_optimizer(run_config(config).train),
        make_mesh(fsdp=2, sp=2),
        seed=7,
    )
    checkpoints = Checkpoints(config.workdir, keep=9)
    first = checkpoints.manager.restore(1)["state"]["params"]
    state, _ = checkpoints.restore(template)
    checkpoints.close()
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_checkpoint_with_non_finite_parameters_is_never_written(tmp_path):
    model = ModelConfig.from_config(_config(tmp_path).model)
    params = jax.device_get(init_params(model, jax.random.key(0)))
    params["layers"]["w_up"] = np.asarray(params["layers"]["w_up"]).copy()
    params["layers"]["w_up"][0, 0, 0] = np.nan
    hf.save(str(tmp_path / "hf"), model, params)
    config = _config(tmp_path / "run", steps=2, max_bad_steps=5)
    config.model.init_from_hf = str(tmp_path / "hf")
    with pytest.raises(TrainingHalted, match="not finite, so no checkpoint was written"):
        train(config)
    assert not glob.glob(str(tmp_path / "run" / "checkpoints" / "[0-9]*"))


# -- metrics after a resume -----------------------------------------------------------------


def test_metrics_hold_each_step_once_after_a_resume(tmp_path):
    workdir = tmp_path / "run"
    train(_config(workdir, steps=4), stop_after=3)  # a crash after step 3 (checkpoint: 2)
    assert [json.loads(l)["step"] for l in open(workdir / "metrics.jsonl")] == [1, 2, 3]
    with open(workdir / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "lo')  # and a line cut short by the crash
    train(_config(workdir, steps=4))
    steps = [json.loads(l)["step"] for l in open(workdir / "metrics.jsonl")]
    assert steps == [1, 2, 3, 4]


def test_damaged_bytes_in_metrics_do_not_block_the_resume(two_steps, tmp_path, caplog):
    """A torn block of a network filesystem: bytes that are not UTF-8 after the last record."""
    workdir = tmp_path / "run"
    shutil.copytree(two_steps, workdir)
    with open(workdir / "metrics.jsonl", "ab") as f:
        f.write(b"\xff\xfe\x80\x00\x00garbage\xc3\x28\n\x9f" + bytes(range(256)) + b"\xf0\x28")
    with caplog.at_level(logging.WARNING):
        records = train(_config(workdir, steps=4))
    assert [r["step"] for r in records] == [3, 4]
    text = (workdir / "metrics.jsonl").read_bytes().decode("utf-8")  # all of it UTF-8
    assert [json.loads(line)["step"] for line in text.splitlines()] == [1, 2, 3, 4]
    # bytes(range(256)) holds a newline: two damaged lines before it, one after
    assert "metrics.jsonl: dropped 3 unreadable line(s)" in caplog.text


def test_truncate_metrics(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\nnot json\n{"step": 3}\n{"no": 1}\n{"step": 2')
    assert truncate_metrics(str(path), 2) == 4
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    assert truncate_metrics(str(tmp_path / "absent.jsonl"), 5) == 0
    # whatever the bytes of a line: not UTF-8, UTF-16, other JSON, a step that is no number
    path.write_bytes(
        b'{"step": 1}\n\xff{"step": 2}\n'
        + '{"step": 2}'.encode("utf-16")
        + b'\n[1]\n"step"\n{"step": 1e999}\n{"step": null}\n\n{"step": 2}\n'
    )
    assert truncate_metrics(str(path), 2) == 7
    assert path.read_bytes() == b'{"step": 1}\n{"step": 2}\n'


def test_a_run_that_fails_on_its_data_leaves_no_workdir_behind(tmp_path):
    config = _config(tmp_path / "run")
    config.data.path = str(tmp_path / "empty.jsonl")
    (tmp_path / "empty.jsonl").write_text('{"other": "field"}\n')  # no usable record
    with pytest.raises(Exception, match="empty.jsonl") as e:
        train(config)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()

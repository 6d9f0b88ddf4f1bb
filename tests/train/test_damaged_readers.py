"""The tools that read a run's parameters (`lclm.eval generate`, `lclm.convert --to-hf`) on a
workdir whose latest step is damaged (issue 62): the damaged step is named in one line and
the previous good one read, as a resumed run falls back
(lclm.workdir.checkpoint.first_readable), and nothing of the run is moved; convert takes
`--step`, and a damaged step asked for is one line."""

import logging
import os
import shutil

import pytest
from support import DAMAGE, damage_checkpoint, small_train_config

from lclm.convert import main as convert
from lclm.eval.generate import main as generate
from lclm.train.loop import train

pytestmark = pytest.mark.slow  # trains a model


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A 4-step run with checkpoints at steps 2 and 4."""
    workdir = tmp_path_factory.mktemp("base") / "run"
    train(small_train_config(workdir, mesh=dict(fsdp=2), attention=dict(q_chunk=16, kv_chunk=16)))
    return workdir


@pytest.fixture(params=DAMAGE[1:4])
def damaged(finished_run, tmp_path, request):
    workdir = tmp_path / "run"
    shutil.copytree(finished_run, workdir)
    damage_checkpoint(str(workdir / "checkpoints" / "4"), request.param)
    return workdir


def _no_traceback(err):
    assert "Traceback" not in err and "Event loop is closed" not in err, err[-3000:]


def test_convert_exports_the_previous_good_step_and_names_the_damaged_one(
    damaged, tmp_path, capfd, caplog
):
    assert convert(["--from-checkpoint", str(damaged), "--to-hf", str(tmp_path / "hf")]) == 0
    out, err = capfd.readouterr()
    assert f"exported {damaged} step 2 to " in out
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warning.startswith(f"checkpoint step 4 of {damaged} is damaged (")
    assert "\n" not in warning and len(warning) < 500
    _no_traceback(err + caplog.text)
    assert sorted(os.listdir(damaged / "checkpoints")) == ["2", "4"]  # left where it is


def test_convert_step_reads_the_step_asked_for_in_one_line(damaged, tmp_path, capfd):
    assert (
        convert(
            ["--from-checkpoint", str(damaged), "--to-hf", str(tmp_path / "hf2"), "--step", "2"]
        )
        == 0
    )
    assert f"exported {damaged} step 2 to " in capfd.readouterr().out
    assert (
        convert(
            ["--from-checkpoint", str(damaged), "--to-hf", str(tmp_path / "hf4"), "--step", "4"]
        )
        == 2
    )
    err = capfd.readouterr().err
    assert err.startswith(f"error: checkpoint step 4 of {damaged} cannot be read ("), err
    assert err.rstrip().endswith("pass another --step (saved: [2, 4])") and err.count("\n") == 1
    assert (
        convert(
            ["--from-checkpoint", str(damaged), "--to-hf", str(tmp_path / "hf3"), "--step", "3"]
        )
        == 2
    )
    assert "has no checkpoint step 3 (saved: [2, 4])" in capfd.readouterr().err


def test_generate_decodes_with_the_previous_good_step(damaged, capfd, caplog):
    assert (
        generate(
            ["--checkpoint", str(damaged), "--prompt", "Once upon a time", "--max-new-tokens", "4"]
        )
        == 0
    )
    out, err = capfd.readouterr()
    assert f"checkpoint step 4 of {damaged} is damaged (" in caplog.text
    _no_traceback(err + caplog.text)
    assert "step 2" in out + err + caplog.text

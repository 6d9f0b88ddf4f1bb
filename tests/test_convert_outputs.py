"""lclm.convert finds an output it cannot write, or a workdir it must not write into, before it
reads any weights, and says so in one line (exit 2) leaving nothing behind: a file where a
folder goes, a path on a scheme lclm does not write (once written as a local './gs:/...'
folder, or a traceback), a bucket that is not there, a workdir a live run holds. Inputs on a
scheme lclm does not read are one line too (gs:// and s3:// are read and written:
tests/test_object_store_hf.py)."""

import os
import subprocess
import sys

import jax
import pytest
from support import DEMO_TOKENIZER, ROOT

from lclm import hf
from lclm.config import ModelConfig
from lclm.convert import main
from lclm.models.decoder import init_params
from lclm.workdir.lock import WorkdirLock

MODEL = ModelConfig(
    vocab_size=512, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64, dtype="float32"
)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """(a tiny HuggingFace directory, an lclm workdir converted from it)."""
    tmp = tmp_path_factory.mktemp("sources")
    hf.save(str(tmp / "hf"), MODEL, init_params(MODEL, jax.random.key(0)))
    hf.save_tokenizer(DEMO_TOKENIZER, str(tmp / "hf"), MODEL)
    assert main(["--from-hf", str(tmp / "hf"), "--to-checkpoint", str(tmp / "run")]) == 0
    return str(tmp / "hf"), str(tmp / "run")


def _tree(path):
    return sorted(
        os.path.relpath(os.path.join(d, f), path) for d, _, files in os.walk(path) for f in files
    )


def _one_line(capsys, start):
    err = capsys.readouterr().err
    assert err.startswith(f"error: {start}") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("direction", ["--to-checkpoint", "--to-hf"])
def test_an_output_that_is_a_file_is_found_before_the_input_is_read(tmp_path, capsys, direction):
    (tmp_path / "taken").write_text("a file")
    # the input does not exist: the output's problem is what is found first
    source = [
        "--from-hf" if direction == "--to-checkpoint" else "--from-checkpoint",
        str(tmp_path / "missing"),
    ]
    for output, problem in (
        (tmp_path / "taken", "is a file; pass a folder"),
        (tmp_path / "taken" / "out", "cannot be made: "),
    ):
        assert main([*source, direction, str(output)]) == 2
        _one_line(capsys, f"{direction} {str(output)!r} {problem}")
    assert sorted(os.listdir(tmp_path)) == ["taken"]


@pytest.mark.parametrize("direction", ["--to-checkpoint", "--to-hf"])
def test_an_output_on_an_unknown_scheme_is_one_line_and_writes_no_local_folder(
    tmp_path, monkeypatch, capsys, sources, direction
):
    hf_dir, run = sources
    monkeypatch.chdir(tmp_path)  # where a 'hdfs:' folder would be written
    source = ["--from-hf", hf_dir] if direction == "--to-checkpoint" else ["--from-checkpoint", run]
    assert main([*source, direction, "hdfs://bucket/out"]) == 2
    _one_line(
        capsys, f"{direction} 'hdfs://bucket/out' uses hdfs://, which lclm does not read or write"
    )
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "flags",
    [
        ["--from-checkpoint", "hdfs://bucket/run", "--to-hf", "out"],
        ["--from-hf", "hdfs://bucket/llama", "--to-checkpoint", "out"],
        ["--from-checkpoint", "RUN", "--to-hf", "out", "--tokenizer", "hdfs://bucket/tok.model"],
    ],
)
def test_an_object_store_input_is_one_line(tmp_path, monkeypatch, capsys, sources, flags):
    monkeypatch.chdir(tmp_path)
    flags = [sources[1] if f == "RUN" else f for f in flags]
    assert main(flags) == 2
    flag, path = next((f, p) for f, p in zip(flags, flags[1:]) if "://" in p)
    _one_line(capsys, f"{flag} {path!r} uses hdfs://, which lclm does not read or write")
    assert os.listdir(tmp_path) == []


def test_a_workdir_held_by_a_live_run_is_refused_before_the_weights_are_read(tmp_path, capsys):
    workdir = tmp_path / "busy"
    lock = WorkdirLock(str(workdir))
    lock.acquire()  # a run that has started and saved nothing yet
    try:
        # the source does not exist: the workdir's lock is what is found first
        assert main(["--from-hf", str(tmp_path / "missing"), "--to-checkpoint", str(workdir)]) == 2
        _one_line(capsys, f"workdir {workdir} is in use by a live run (pid {os.getpid()} ")
        # the lock's own files only (a refused run's takeover guard among them)
        assert set(os.listdir(workdir)) <= {"lock", "lock.takeover"}
    finally:
        lock.release()


def test_the_cli_refuses_a_missing_bucket_in_one_line(tmp_path, sources, gcs):
    """As a user runs it: a subprocess, where the old code printed a traceback (exit 1). The
    bucket is looked up on the local GCS server."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "lclm.convert",
            "--from-hf",
            sources[0],
            "--to-checkpoint",
            "gs://lclm-no-such-bucket/run",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert (
        r.stderr.strip()
        .splitlines()[-1]
        .startswith("error: --to-checkpoint 'gs://lclm-no-such-bucket/run' cannot be written (")
    )
    assert "Traceback" not in r.stderr and os.listdir(tmp_path) == []

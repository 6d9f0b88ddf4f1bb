"""Exact resume with real processes: SIGKILL after a checkpoint, SIGTERM saves and stops."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from support import ROOT

pytestmark = pytest.mark.slow  # trains models or starts processes: left out by -m 'not slow'

SMALL = [
    "--config",
    "configs/demo.py",
    "--config.model.dim=64",
    "--config.model.n_layers=2",
    "--config.model.ffn_dim=128",
    "--config.model.ffn_chunk=32",
    "--config.model.loss_chunk=32",
    "--config.data.seq_len=128",
    "--config.data.batch_size=4",
    "--config.attention.q_chunk=16",
    "--config.attention.kv_chunk=16",
    "--config.mesh.fsdp=2",
    "--config.mesh.sp=2",
    "--config.train.steps=10",
    "--config.train.warmup=2",
    "--config.log.every=1",
    "--config.log.progress=False",
    "--config.checkpoint.every=3",
]


def _start(workdir):
    env = dict(os.environ, JAX_PLATFORMS="cpu", WANDB_MODE="disabled")
    env.pop("XLA_FLAGS", None)
    return subprocess.Popen(
        [sys.executable, "train.py", *SMALL, f"--config.workdir={workdir}"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def _wait_for(predicate, proc, timeout=240):
    deadline = time.time() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"train.py exited early:\n{proc.stdout.read()}")
        if time.time() > deadline:
            proc.kill()
            raise AssertionError("timed out")
        time.sleep(0.02)


def _committed(workdir, step):
    return os.path.isfile(os.path.join(workdir, "checkpoints", str(step), "_CHECKPOINT_METADATA"))


def test_sigkill_after_a_checkpoint_then_resume_repeats_the_same_losses(tmp_path):
    full = _start(tmp_path / "full")
    assert full.wait(timeout=300) == 0, full.stdout.read()
    want = _losses(tmp_path / "full")
    assert sorted(want) == list(range(1, 11))

    run = tmp_path / "killed"
    proc = _start(run)
    _wait_for(lambda: _committed(run, 3), proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = _losses(run)
    killed_at = max(before)
    assert killed_at < 10, "the run finished before it could be killed"

    proc = _start(run)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    resumed_from = int(re.search(r"restored checkpoint step (\d+)", out).group(1))
    assert resumed_from % 3 == 0 and resumed_from >= 3
    # the records past the checkpoint were dropped before the re-run: each step appears once
    with open(run / "metrics.jsonl") as f:
        steps = [json.loads(l)["step"] for l in f]
    assert steps == list(range(1, 11))
    for step, loss in _losses(run).items():
        assert loss == pytest.approx(want[step], rel=1e-6, abs=1e-6), step
    for step, loss in before.items():
        assert loss == pytest.approx(want[step], rel=1e-6, abs=1e-6), step


def test_sigterm_saves_a_checkpoint_and_stops(tmp_path):
    run = tmp_path / "term"
    proc = _start(run)
    metrics = run / "metrics.jsonl"
    _wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    last = max(_losses(run))
    assert last < 10 and "termination signal" in out
    assert _committed(run, last)

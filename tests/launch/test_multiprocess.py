"""Real multi-process training: 2 processes x 4 CPU devices joined by jax.distributed."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from support import ROOT

pytestmark = pytest.mark.slow  # trains models or starts processes: left out by -m 'not slow'

ARGS = [
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
    "--config.mesh.sp=4",
    "--config.train.warmup=2",
    "--config.log.every=1",
    "--config.log.progress=False",
    "--config.checkpoint.every=2",
]


def _env():
    env = dict(os.environ, JAX_PLATFORMS="cpu", WANDB_MODE="disabled", PYTHON=sys.executable)
    env.pop("XLA_FLAGS", None)
    return env


def _single(workdir, steps):
    r = subprocess.run(
        [
            sys.executable,
            "train.py",
            *ARGS,
            f"--config.train.steps={steps}",
            f"--config.workdir={workdir}",
        ],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def _losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [(r["step"], r["loss"]) for r in map(json.loads, f)]


def _two_processes(env, port, args):
    """Processes 0 and 1 of one run, joined at 127.0.0.1:`port` (+ this pid's share, so
    that parallel test sessions do not meet), each running train.py with ARGS + `args`."""
    port += os.getpid() % 1000
    return [
        subprocess.Popen(
            [sys.executable, "train.py", *ARGS, *args],
            cwd=ROOT,
            env=dict(
                env,
                LCLM_COORDINATOR=f"127.0.0.1:{port}",
                LCLM_NUM_PROCESSES="2",
                LCLM_PROCESS_ID=str(i),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]


def test_two_processes_train_like_one_and_their_checkpoint_resumes_in_one(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    _single(one, 4)
    env = dict(_env(), LCLM_LOG_DIR=str(tmp_path / "logs"))
    # time-based saves after every logged step: process 0 decides, both processes save
    r = subprocess.run(
        [
            "bash",
            "launch/local.sh",
            "2",
            *ARGS,
            "--config.train.steps=4",
            "--config.checkpoint.every_minutes=1e-9",
            f"--config.workdir={two}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    log1 = (tmp_path / "logs" / "process_1.log").read_text()
    assert "process 1 of 2" not in r.stdout  # process 1 writes to its own log only
    assert "[Gloo]" not in r.stdout + log1 and "peer ranks" not in r.stdout + log1
    saved = sorted(int(s) for s in os.listdir(two / "checkpoints") if s.isdigit())
    assert saved == [2, 3, 4], log1  # 3: saved on time alone (checkpoint.every=2)
    assert os.path.isfile(two / "checkpoints" / "4" / "_CHECKPOINT_METADATA"), log1
    assert [s for s, _ in _losses(two)] == [1, 2, 3, 4]  # one metrics file, by process 0
    # the 2-process checkpoint (params, optimizer, both processes' data state) resumes in one
    _single(one, 6)
    _single(two, 6)
    for (s1, a), (s2, b) in zip(_losses(one), _losses(two)):
        assert s1 == s2 and a == pytest.approx(b, rel=1e-6, abs=1e-6)
    assert len(_losses(two)) == 6


def test_processes_with_different_configs_are_refused(tmp_path):
    env = dict(_env(), LCLM_LOG_DIR=str(tmp_path / "logs"))
    # process 1 gets a different learning rate through its own command line
    procs = []
    port = 23456 + os.getpid() % 1000
    for i in range(2):
        e = dict(
            env,
            LCLM_COORDINATOR=f"127.0.0.1:{port}",
            LCLM_NUM_PROCESSES="2",
            LCLM_PROCESS_ID=str(i),
        )
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "train.py",
                    *ARGS,
                    "--config.train.steps=2",
                    f"--config.train.lr={1e-3 * (i + 1)}",
                    f"--config.workdir={tmp_path / 'run'}",
                ],
                cwd=ROOT,
                env=e,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 2 for p in procs), outs
    assert "different config than process 0" in outs[0]


def test_sigterm_to_one_process_saves_every_process_at_the_agreed_step(tmp_path):
    """JAX's preemption sync point: the notice reaches one process, all save the same step."""
    env = dict(_env(), LCLM_LOG_DIR=str(tmp_path / "logs"))
    workdir = tmp_path / "run"
    procs = _two_processes(
        env,
        24567,
        ["--config.train.steps=400", "--config.checkpoint.every=0", f"--config.workdir={workdir}"],
    )
    metrics = workdir / "metrics.jsonl"
    deadline = time.time() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert time.time() < deadline and all(p.poll() is None for p in procs), [
            p.communicate()[0] for p in procs
        ]
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGTERM)  # the notice reaches process 1 only
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    saved = [s for s in os.listdir(workdir / "checkpoints") if s.isdigit()]
    assert len(saved) == 1 and int(saved[0]) < 400, saved
    assert "stopped after step" in outs[0]
    assert _losses(workdir)[-1][0] == int(saved[0])


def test_two_processes_share_a_gs_workdir_and_both_save_at_a_preemption(gcs, tmp_path):
    """A pod slice has no shared disk: both processes write their shards of one checkpoint
    into the bucket (a local GCS server), process 0 the lease, config and metrics; a SIGTERM
    to one process saves every process at the agreed step, and one process resumes it."""
    from lclm import storage
    from lclm.train.metrics import read_metrics

    env = dict(_env(), LCLM_LOG_DIR=str(tmp_path / "logs"), **gcs.env)
    workdir = gcs.bucket() + "/runs/pod"
    procs = _two_processes(
        env,
        25678,
        ["--config.train.steps=400", "--config.checkpoint.every=2", f"--config.workdir={workdir}"],
    )
    deadline = time.time() + 240
    while len(read_metrics(workdir)) < 3:
        assert time.time() < deadline and all(p.poll() is None for p in procs), [
            p.communicate()[0] for p in procs
        ]
        time.sleep(0.1)
    procs[1].send_signal(signal.SIGTERM)  # the notice reaches process 1 only
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    saved = max(int(s) for s in storage.listdir(workdir + "/checkpoints") if s.isdigit())
    steps = [r["step"] for r in read_metrics(workdir)]
    assert saved < 400 and steps[-1] == saved and steps == list(range(1, saved + 1)), outs[0]
    assert not storage.exists(workdir + "/lock")
    r = subprocess.run(
        [
            sys.executable,
            "train.py",
            *ARGS,
            f"--config.train.steps={saved + 2}",
            f"--config.workdir={workdir}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert [r["step"] for r in read_metrics(workdir)] == list(range(1, saved + 3))

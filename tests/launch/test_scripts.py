"""Launch scripts in dry-run mode with the environment their launchers would set."""

import os
import subprocess

import pytest

from lclm.parallel import distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SLURM = dict(SLURM_JOB_ID="4242", SLURM_NNODES="2", SLURM_JOB_NODELIST="gpu[01-02]",
             SLURM_NTASKS_PER_NODE="8", SLURM_GPUS_PER_NODE="8", SLURM_SUBMIT_DIR="/shared/lclm")


def _bash(args, **env):
    e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "LCLM_", "TPU_"))}
    e.update(env)
    return subprocess.run(["bash", *args], cwd=ROOT, env=e, capture_output=True, text=True,
                          timeout=60)


def test_slurm_dry_run_shows_every_task_with_its_environment():
    r = _bash(["launch/slurm_gpu.sbatch", "--config", "configs/llama7b_256k.py",
               "--config.workdir=/shared/runs/7b"], LCLM_DRY_RUN="1", **SLURM)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith("srun --nodes=2 --ntasks=16 --ntasks-per-node=8")
    tasks = lines[1:]
    assert len(tasks) == 16
    assert "SLURM_PROCID=9 SLURM_LOCALID=1 SLURM_NODEID=1" in tasks[9]
    port = 61440 + 4242 % 4096
    assert all(f"JAX_COORDINATOR_PORT={port}" in t for t in tasks)
    assert all("/shared/lclm/train.py --config configs/llama7b_256k.py" in t for t in tasks)
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in tasks[0]
    # one process per node
    r = _bash(["launch/slurm_gpu.sbatch", "--config", "configs/demo.py"], LCLM_DRY_RUN="1",
              LCLM_PROCS_PER_NODE="1", **SLURM)
    assert r.stdout.splitlines()[0].startswith("srun --nodes=2 --ntasks=2 --ntasks-per-node=1")
    assert len(r.stdout.strip().splitlines()) == 3


def test_submit_wrapper_and_tpu_dry_runs():
    r = _bash(["launch/submit_slurm.sh", "--nodes", "4", "--gpus-per-node", "8", "--per-node",
               "--dry-run", "--", "--config", "configs/llama7b_256k.py"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("sbatch --nodes=4 --gpus-per-node=8 --ntasks-per-node=1 "
                               "--export=ALL,LCLM_PROCS_PER_NODE=1")
    assert r.stdout.strip().endswith("slurm_gpu.sbatch --config configs/llama7b_256k.py")

    r = _bash(["launch/tpu_pod.sh", "--name", "pod", "--zone", "us-central2-b", "--type",
               "v4-64", "--create", "--dry-run", "--", "--config", "configs/llama7b_256k.py"])
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "tpu-vm create pod --zone=us-central2-b --accelerator-type=v4-64" in out
    assert out.count("--worker=all") == 5  # copy, unpack, install, train, collect logs
    assert "train.py\\ --config\\ configs/llama7b_256k.py" in out
    assert "scp pod:lclm/logs/\\* logs/pod/" in out
    assert _bash(["launch/tpu_pod.sh", "--dry-run"]).returncode == 2
    assert _bash(["launch/local.sh"]).returncode == 2


@pytest.mark.parametrize("env,kind", [
    (dict(SLURM_JOB_ID="1", SLURM_NTASKS="16"), "slurm"),
    (dict(SLURM_JOB_ID="1", SLURM_NTASKS="1"), "single"),
    (dict(LCLM_COORDINATOR="127.0.0.1:1234", LCLM_NUM_PROCESSES="2"), "local"),
    (dict(TPU_WORKER_HOSTNAMES="t0,t1,t2,t3"), "tpu"),
    ({}, "single"),
])
def test_launcher_detection(monkeypatch, env, kind):
    for k in list(os.environ):
        if k.startswith(("SLURM_", "LCLM_", "TPU_")):
            monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert distributed.launcher() == kind
    assert distributed.local_process_count() == (2 if kind == "local" else 1)

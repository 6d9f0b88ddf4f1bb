"""Launch scripts in dry-run mode with the environment their launchers would set."""

import os
import subprocess

import pytest
from support import ROOT

from lclm.parallel import distributed

SLURM = dict(
    SLURM_JOB_ID="4242",
    SLURM_NNODES="2",
    SLURM_JOB_NODELIST="gpu[01-02]",
    SLURM_NTASKS_PER_NODE="8",
    SLURM_GPUS_PER_NODE="8",
    SLURM_SUBMIT_DIR="/shared/lclm",
)


def _bash(args, **env):
    e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "LCLM_", "TPU_"))}
    e.update(env)
    return subprocess.run(
        ["bash", *args], cwd=ROOT, env=e, capture_output=True, text=True, timeout=60
    )


def test_slurm_dry_run_shows_every_task_with_its_environment():
    r = _bash(
        [
            "launch/slurm_gpu.sbatch",
            "--config",
            "configs/llama7b_256k.py",
            "--config.workdir=/shared/runs/7b",
        ],
        LCLM_DRY_RUN="1",
        **SLURM,
    )
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
    r = _bash(
        ["launch/slurm_gpu.sbatch", "--config", "configs/demo.py"],
        LCLM_DRY_RUN="1",
        LCLM_PROCS_PER_NODE="1",
        **SLURM,
    )
    assert r.stdout.splitlines()[0].startswith("srun --nodes=2 --ntasks=2 --ntasks-per-node=1")
    assert len(r.stdout.strip().splitlines()) == 3


def test_submit_wrapper_and_tpu_dry_runs():
    r = _bash(
        [
            "launch/submit_slurm.sh",
            "--nodes",
            "4",
            "--gpus-per-node",
            "8",
            "--per-node",
            "--dry-run",
            "--",
            "--config",
            "configs/llama7b_256k.py",
        ]
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(
        "sbatch --nodes=4 --gpus-per-node=8 --ntasks-per-node=1 --export=ALL,LCLM_PROCS_PER_NODE=1"
    )
    assert r.stdout.strip().endswith("slurm_gpu.sbatch --config configs/llama7b_256k.py")

    # the usage line of the script's header, as written: the workdir in a bucket
    r = _bash(
        [
            "launch/tpu_pod.sh",
            "--name",
            "pod",
            "--zone",
            "us-central2-b",
            "--type",
            "v4-64",
            "--create",
            "--dry-run",
            "--",
            "--config",
            "configs/llama7b_256k.py",
            "--config.workdir=gs://bucket/runs/7b",
        ]
    )
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert (
        "tpu-vm create pod --zone=us-central2-b --accelerator-type=v4-64 "
        "--version=tpu-ubuntu2204-base"
    ) in out
    assert out.count("--worker=all") == 5  # copy, unpack, install, train, collect logs
    # the image's python3 (3.10 on Ubuntu 22.04) is too old: uv brings CPython 3.12
    assert "# python: CPython 3.12 from uv on every worker" in out
    assert "uv python install 3.12" in out and "uv venv -q --python 3.12 .venv" in out
    assert (
        ".venv/bin/python\\ train.py\\ --config\\ configs/llama7b_256k.py\\ "
        "--config.workdir=gs://bucket/runs/7b"
    ) in out
    assert "-e \\'.[tpu,cloud]\\'" in out  # gcsfs on every worker, for the gs:// workdir
    assert "python3 train.py" not in out
    # what is shipped: the working tree, as a tar of tracked + untracked-not-ignored files
    assert f"# shipping: the working tree of {ROOT}: " in out
    assert "tracked + untracked not ignored" in out
    assert "git archive" not in out
    assert "scp pod:lclm/logs/\\* logs/pod/" in out
    assert _bash(["launch/tpu_pod.sh", "--dry-run"]).returncode == 2
    assert _bash(["launch/local.sh"]).returncode == 2


def test_local_launcher_drops_gloo_connection_reports_even_interleaved():
    """The lines a CI run printed when two of Gloo's collective groups connected at once, among
    lines that must survive: a log record, an empty line and a real connection failure."""
    gloo = [
        "[Gloo] Rank 0 is connected to 3 peer ranks. Expected number of connected peer ranks"
        " is : 3",
        "[Gloo] Rank [Gloo] Rank 2 is connected to 7 peer ranks. Expected number of connected"
        " peer ranks is : 7",
        "1 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7",
        "[Gloo] Rank [Gloo] Rank 3 is connected to 1 is connected to 3 peer ranks. Expected"
        " number of connected peer ranks is : 3",
        "3 peer ranks. Expected number of connected peer ranks is : 3",
        "7",
    ]
    kept = [
        "2026-11-25 16:54:30,262 INFO trained steps 1-4 in 17 s; loss 6.2530 -> 5.8605",
        "",
        "[Gloo] Rank 1 is NOT connected to: [3]",
        "step 7 of 10",
    ]
    lines = [gloo[0], kept[0], *gloo[1:3], kept[1], *gloo[3:], *kept[2:]]
    r = subprocess.run(
        ["bash", "launch/quiet_gloo.sh"],
        cwd=ROOT,
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == kept
    r = subprocess.run(
        ["bash", "launch/quiet_gloo.sh"],
        cwd=ROOT,
        input="\n".join(gloo),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (r.returncode, r.stdout) == (0, "")  # nothing left is not an error


@pytest.mark.parametrize(
    "tpu_type,image",
    [
        ("v6e-16", "v2-alpha-tpuv6e"),
        ("v5p-32", "v2-alpha-tpuv5"),
        ("v5litepod-16", "v2-alpha-tpuv5-lite"),
        ("v3-32", "tpu-ubuntu2204-base"),
    ],
)
def test_tpu_image_follows_the_generation(tpu_type, image):
    r = _bash(
        [
            "launch/tpu_pod.sh",
            "--name",
            "p",
            "--zone",
            "z",
            "--type",
            tpu_type,
            "--create",
            "--dry-run",
        ]
    )
    assert r.returncode == 0, r.stderr
    assert f"--accelerator-type={tpu_type} --version={image}" in r.stdout
    r = _bash(
        [
            "launch/tpu_pod.sh",
            "--name",
            "p",
            "--zone",
            "z",
            "--type",
            tpu_type,
            "--create",
            "--version",
            "my-image",
            "--dry-run",
        ]
    )
    assert "--version=my-image" in r.stdout


def test_tpu_python_choice_and_repo_mode():
    r = _bash(
        [
            "launch/tpu_pod.sh",
            "--name",
            "p",
            "--zone",
            "z",
            "--python",
            "3.11",
            "--repo",
            "https://example.com/lclm.git",
            "--dry-run",
        ]
    )
    assert r.returncode == 0, r.stderr
    assert "# python: CPython 3.11 from uv" in r.stdout and "uv python install 3.11" in r.stdout
    assert (
        "# shipping: nothing from here; every worker clones or fast-forwards "
        "https://example.com/lclm.git" in r.stdout
    )
    assert "tar " not in r.stdout.split("--command=")[0]
    for bad in ("3.10", "2.7", "3", "latest"):
        r = _bash(["launch/tpu_pod.sh", "--name", "p", "--zone", "z", "--python", bad, "--dry-run"])
        assert r.returncode == 2 and "3.11 or newer" in r.stderr, bad
    r = _bash(["launch/tpu_pod.sh", "--name", "p", "--zone", "z", "--dry-run"], LCLM_PYTHON="3.13")
    assert "# python: CPython 3.13 from uv" in r.stdout


# A stand-in for gcloud: records each call, keeps the shipped tar, and runs the unpack command
# in a simulated worker's home ($SIM_HOME).
FAKE_GCLOUD = r"""#!/usr/bin/env bash
printf '%s\n' "$*" >> "$SIM_LOG"
if [[ "$4" == scp && "$6" == *:lclm-src.tgz ]]; then cp "$5" "$SIM_HOME/lclm-src.tgz"; fi
if [[ "$4" == ssh ]]; then
  for a in "$@"; do [[ "$a" == --command=* ]] && cmd=${a#--command=}; done
  if [[ "$cmd" == *"tar -xzf ../lclm-src.tgz"* ]]; then (cd "$SIM_HOME" && bash -c "$cmd"); fi
fi
"""


def _git(repo, *args):
    subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        check=True,
        capture_output=True,
    )


def test_tpu_ships_the_working_tree_with_uncommitted_edits(tmp_path):
    """Uncommitted edits and new files reach the workers; ignored and deleted files do not; a
    file an earlier launch shipped that is gone from the tree is removed on the worker, files
    the workers made themselves (venv, logs, runs) are kept."""
    repo, home, bin_dir = tmp_path / "repo", tmp_path / "home", tmp_path / "bin"
    for d in (repo / "launch", bin_dir):
        d.mkdir(parents=True)
    with open(os.path.join(ROOT, "launch", "tpu_pod.sh")) as f:
        (repo / "launch" / "tpu_pod.sh").write_text(f.read())
    (repo / ".gitignore").write_text("ignored.txt\n")
    (repo / "train.py").write_text("committed\n")
    (repo / "gone.py").write_text("deleted after the commit\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "init")
    (bin_dir / "gcloud").write_text(FAKE_GCLOUD)
    (bin_dir / "gcloud").chmod(0o755)
    env = dict(
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        SIM_HOME=str(home),
        SIM_LOG=str(tmp_path / "gcloud.log"),
    )

    def launch(*args):
        home.mkdir(exist_ok=True)
        return subprocess.run(
            ["bash", str(repo / "launch" / "tpu_pod.sh"), "--name", "p", "--zone", "z", *args],
            cwd=tmp_path,
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=60,
        )

    r = launch("--", "--config", "configs/demo.py")  # the committed tree
    assert r.returncode == 0, r.stderr
    assert "(clean; HEAD " in r.stdout
    worker = home / "lclm"
    assert (worker / "gone.py").is_file() and (worker / "train.py").read_text() == "committed\n"
    for made_there in (
        worker / "logs" / "old.log",
        worker / ".venv" / "marker",
        worker / "runs" / "ckpt",
    ):
        made_there.parent.mkdir(exist_ok=True)
        made_there.write_text("kept\n")

    (repo / "train.py").write_text("edited, not committed\n")
    (repo / "new_module.py").write_text("untracked\n")
    (repo / "ignored.txt").write_text("ignored\n")
    (repo / "gone.py").unlink()
    (tmp_path / "gcloud.log").unlink()
    r = launch("--dry-run")
    assert r.returncode == 0, r.stderr
    assert "(3 uncommitted change(s) included; HEAD " in r.stdout  # M, D and ?? (new file)
    assert not (tmp_path / "gcloud.log").exists()  # a dry run calls nothing

    r = launch("--", "--config", "configs/demo.py")
    assert r.returncode == 0, r.stderr
    assert f"# shipping: the working tree of {repo}: 4 files" in r.stdout
    assert (worker / "train.py").read_text() == "edited, not committed\n"
    assert (worker / "new_module.py").read_text() == "untracked\n"
    assert (worker / "launch" / "tpu_pod.sh").is_file() and (worker / ".gitignore").is_file()
    assert not (worker / "ignored.txt").exists() and not (worker / "gone.py").exists()
    assert not (home / "lclm-src.tgz").exists()
    for made_there in ("logs/old.log", ".venv/marker", "runs/ckpt"):
        assert (worker / made_there).read_text() == "kept\n", made_there
    calls = (tmp_path / "gcloud.log").read_text()
    assert calls.count("--worker=all") == 5 and ".venv/bin/python train.py" in calls

    # outside a git checkout there is no working tree to ship: one line, exit 2
    plain = tmp_path / "plain" / "launch"
    plain.mkdir(parents=True)
    (plain / "tpu_pod.sh").write_text((repo / "launch" / "tpu_pod.sh").read_text())
    r = _bash(
        [str(plain / "tpu_pod.sh"), "--name", "p", "--zone", "z", "--dry-run"],
        GIT_CEILING_DIRECTORIES=str(tmp_path),
        **env,
    )
    assert r.returncode == 2 and "not a git checkout: pass --repo" in r.stderr


@pytest.mark.parametrize(
    "env,kind",
    [
        (dict(SLURM_JOB_ID="1", SLURM_NTASKS="16"), "slurm"),
        (dict(SLURM_JOB_ID="1", SLURM_NTASKS="1"), "single"),
        (dict(LCLM_COORDINATOR="127.0.0.1:1234", LCLM_NUM_PROCESSES="2"), "local"),
        (dict(TPU_WORKER_HOSTNAMES="t0,t1,t2,t3"), "tpu"),
        ({}, "single"),
    ],
)
def test_launcher_detection(monkeypatch, env, kind):
    for k in list(os.environ):
        if k.startswith(("SLURM_", "LCLM_", "TPU_")):
            monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert distributed.launcher() == kind
    assert distributed.local_process_count() == (2 if kind == "local" else 1)

"""A workdir on gs:// works like a local one, against a local GCS server (fake-gcs-server):
a run killed with SIGKILL resumes to the local run's losses, the lease refuses a second run
and is taken over once stale, a damaged checkpoint is set aside, a staged run trains its
stages there, two processes of one run share it, and a missing bucket is found at start."""

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from support import (
    ROOT,
    TINY_DEMO_ARGS,
    damage_checkpoint,
    small_train_config,
    write_text,
)

from lclm import storage
from lclm.train.metrics import read_metrics
from lclm.workdir.layout import saved_steps
from lclm.workdir.lock import WorkdirBusy
from lclm.workdir.object_lock import ObjectLock

ARGS = [*TINY_DEMO_ARGS, "--config.checkpoint.keep=2", "--config.train.steps=6"]
LEASE = 0.002  # minutes: 0.12 s


def _env(server, devices=2):
    env = dict(os.environ, JAX_PLATFORMS="cpu", WANDB_MODE="disabled", **server.env)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return env


def _losses(workdir):
    return [(r["step"], r["loss"]) for r in read_metrics(str(workdir))]


@pytest.mark.slow
def test_a_gs_run_killed_and_resumed_ends_with_the_local_runs_losses(gcs, tmp_path):
    local, remote = tmp_path / "run", gcs.bucket() + "/runs/demo"
    r = subprocess.run(
        [sys.executable, "train.py", *ARGS, f"--config.workdir={local}"],
        cwd=ROOT,
        env=_env(gcs),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    run = subprocess.Popen(
        [sys.executable, "train.py", *ARGS, f"--config.workdir={remote}"],
        cwd=ROOT,
        env=_env(gcs),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 240
    while time.time() < deadline and run.poll() is None:
        if max((s for s, _ in _losses(remote)), default=0) >= 3:  # saved step 2, then logged 3
            break
        time.sleep(0.05)
    run.send_signal(signal.SIGKILL)
    run.wait()
    assert run.returncode == -signal.SIGKILL, run.stderr.read()
    assert storage.exists(remote + "/lock")  # a killed run cannot remove it
    r = subprocess.run(
        [sys.executable, "train.py", *ARGS, f"--config.workdir={remote}"],
        cwd=ROOT,
        env=_env(gcs),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "taking over the lock of a run that is gone" in r.stderr
    assert [s for s, _ in _losses(remote)] == [1, 2, 3, 4, 5, 6]  # re-run steps once
    for (s, a), (_, b) in zip(_losses(local), _losses(remote)):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6), s
    assert not storage.exists(remote + "/lock")
    assert saved_steps(remote) == [4, 6]  # checkpoint.keep=2: step 2 deleted from the bucket
    saved = json.loads(storage.read_text(remote + "/config.json"))
    assert saved["workdir"] == remote


def _holder(bucket_path):
    return json.loads(storage.read_text(bucket_path + "/lock"))


def test_the_lease_on_gs_refuses_a_second_run_and_a_stale_one_is_taken_over(gcs, caplog):
    workdir = gcs.bucket() + "/run"
    first = ObjectLock(workdir, lease_minutes=10.0)
    first.acquire()
    with pytest.raises(WorkdirBusy, match="is in use by a live run"):  # same host, live pid
        ObjectLock(workdir).acquire()
    first.release()
    assert not storage.exists(workdir + "/lock")
    # another host's fresh lease is refused; once it has not been renewed for longer than the
    # lease, it is taken over in one conditional write
    other = dict(host="other-host", pid=1, since=time.time(), lease_minutes=LEASE, token="x")
    write_text(workdir + "/lock", json.dumps(dict(other, lease_minutes=10.0)))
    with pytest.raises(WorkdirBusy, match=r"held by pid 1 on other-host .* lease renewed"):
        ObjectLock(workdir, lease_minutes=LEASE).acquire()
    write_text(workdir + "/lock", json.dumps(other))
    time.sleep(0.5)
    with caplog.at_level(logging.WARNING):
        lock = ObjectLock(workdir, lease_minutes=LEASE)
        lock.acquire()
    assert "taking over the lock of pid 1 on other-host" in caplog.text
    assert _holder(workdir)["token"] == lock.mine["token"]
    # the holder renews its lease: its lock's write time moves on
    written = storage.stat(workdir + "/lock")[1].updated
    time.sleep(0.4)
    assert storage.stat(workdir + "/lock")[1].updated > written and lock.lost() is None
    # a run that takes it over (this one's renewals lost, say) is seen at the next renewal
    write_text(workdir + "/lock", json.dumps(dict(other, lease_minutes=10.0)))
    deadline = time.time() + 5
    while lock.lost() is None and time.time() < deadline:
        time.sleep(0.05)
    assert "was taken over by pid 1 on other-host" in (lock.lost() or "")
    lock.release()
    assert _holder(workdir)["host"] == "other-host"  # not ours: left alone


def test_two_lock_takeovers_of_one_stale_lease_let_one_run_win(gcs):
    workdir = gcs.bucket() + "/run"
    stale = json.dumps(dict(host="other-host", pid=1, since=0, lease_minutes=LEASE, token="x"))
    write_text(workdir + "/lock", stale)
    time.sleep(0.3)
    a, b = ObjectLock(workdir, lease_minutes=LEASE), ObjectLock(workdir, lease_minutes=LEASE)
    version = storage.stat(workdir + "/lock")[1]
    # both judged the same version stale; only the first conditional replace lands
    assert storage.replace_if(a.path, a._data, version) is not None
    assert storage.replace_if(b.path, b._data, version) is None
    assert _holder(workdir)["token"] == a.mine["token"]


def test_a_missing_bucket_is_found_at_start(gcs):
    from lclm.errors import ConfigError
    from lclm.workdir.layout import check_workdir

    with pytest.raises(
        ConfigError,
        match=r"workdir='gs://no-such-bucket-lclm/run' cannot be "
        r"written \(.*\); check the bucket's name and this machine's access",
    ):
        check_workdir("gs://no-such-bucket-lclm/run")
    check_workdir(gcs.bucket() + "/run")  # an existing bucket: fine, and nothing is left
    assert storage.listdir(gcs.bucket()) == []


@pytest.mark.slow
def test_a_damaged_checkpoint_on_gs_is_set_aside_and_the_previous_one_resumes(gcs, caplog):
    from lclm.train.loop import train

    bucket = gcs.bucket()
    c = small_train_config(bucket + "/run", mesh=dict(fsdp=2), attention={})
    train(c)  # checkpoints 2 and 4
    step_dir = os.path.join(gcs.root, bucket[len("gs://") :], "run", "checkpoints", "4")
    damage_checkpoint(step_dir, "deleted manifest.ocdbt")  # the server's own files
    c.train.steps = 5
    with caplog.at_level(logging.ERROR):
        records = train(c)
    assert [r["step"] for r in records] == [3, 4, 5]
    assert "checkpoint step 4 in " + bucket + "/run/checkpoints is damaged" in caplog.text
    aside = storage.listdir(bucket + "/run/checkpoints_damaged")
    assert len(aside) == 1 and aside[0].startswith("4-")
    assert [s for s, _ in _losses(bucket + "/run")] == [1, 2, 3, 4, 5]


@pytest.mark.slow
def test_prepare_to_gs_then_a_staged_run_there_and_generate_from_it(gcs, capsys):
    """The pod workflow with nothing on local disk: data prepared into a bucket, a staged
    run (two stages) with its workdir in the bucket reading it, then generation from the
    staged run's directory (its last stage)."""
    from lclm.config import load_config
    from lclm.data.prepare import main as prepare
    from lclm.eval import generate
    from lclm.train.stages import run_stages
    from lclm.workdir.layout import workdir_to_read

    bucket = gcs.bucket()
    demo = os.path.join(ROOT, "data", "demo")
    assert (
        prepare(
            [
                "--source",
                "sharegpt",
                "--input",
                os.path.join(demo, "sharegpt.jsonl"),
                "--tokenizer",
                os.path.join(demo, "tokenizer.model"),
                "--out",
                bucket + "/data/sharegpt",
            ]
        )
        == 0
    )
    c = load_config(os.path.join(ROOT, "configs", "demo_stages.py"))
    c.workdir = bucket + "/runs/staged"
    c.data.update(path=bucket + "/data/sharegpt", source="tokenized")
    c.model.update(dim=32, n_heads=2, n_kv_heads=1, ffn_dim=64, ffn_chunk=32, loss_chunk=32)
    c.attention.update(q_chunk=16, kv_chunk=16)
    c.stages.update(schedule="64:1e4:2:2, 128:1e5:2:2", tokens_per_batch=512)
    c.train.update(warmup=1)
    c.log.update(every=1, progress=False)
    c.checkpoint.every = 1
    runs = run_stages(c)
    assert [len(r) for r in runs] == [2, 2]
    last = workdir_to_read(c.workdir)
    assert last == c.workdir + "/stage1_128"
    assert [s for s, _ in _losses(last)] == [1, 2]
    capsys.readouterr()
    assert (
        generate.main(["--checkpoint", c.workdir, "--prompt", "Hello", "--max-new-tokens", "4"])
        == 0
    )
    assert capsys.readouterr().out.strip()


def test_an_s3_workdir_is_refused_at_start_in_one_line(s3):
    from lclm.errors import ConfigError, StartupError
    from lclm.workdir.layout import check_workdir, workdir_to_read

    workdir = s3.bucket() + "/run"
    why = (
        "is on s3://, where Orbax (0.12, lclm's checkpoint writer) cannot keep checkpoints: "
        "it writes arrays to gs:// or a file path; use a gs:// workdir, or mount the bucket"
    )
    with pytest.raises(ConfigError, match=re.escape(f"workdir='{workdir}' {why}")):
        check_workdir(workdir)
    with pytest.raises(StartupError, match=re.escape(f"--checkpoint '{workdir}' {why}")):
        workdir_to_read(workdir)


@pytest.mark.slow
def test_a_step_set_aside_on_gs_is_saved_again_by_the_same_run(gcs, caplog):
    """The damaged step is the final one: the resumed run trains it again and must save it
    where the damaged one was (the storage client's listing of the checkpoint folder, read
    before the move, still held it: 'Checkpoint for step 4 already exists')."""
    from lclm.train.loop import train

    bucket = gcs.bucket()
    c = small_train_config(bucket + "/run", mesh=dict(fsdp=2), attention={})
    train(c)  # checkpoints 2 and 4
    step_dir = os.path.join(gcs.root, bucket[len("gs://") :], "run", "checkpoints", "4")
    damage_checkpoint(step_dir, "deleted manifest.ocdbt")
    c.storage_patience_seconds = 3.0  # the refused saves, before: a stop 3 s on, not 300
    with caplog.at_level(logging.WARNING):
        records = train(c)
    assert [r["step"] for r in records] == [3, 4]
    assert "checkpoint step 4 in " + bucket + "/run/checkpoints is damaged" in caplog.text
    assert "already exists" not in caplog.text
    assert saved_steps(bucket + "/run") == [2, 4]
    assert len(storage.listdir(bucket + "/run/checkpoints_damaged")) == 1
    assert [s for s, _ in _losses(bucket + "/run")] == [1, 2, 3, 4]

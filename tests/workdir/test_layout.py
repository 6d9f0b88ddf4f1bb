"""A staged run's directory, as the tools that read a run take it (lclm.workdir.layout): its
last stage with a checkpoint for `convert --to-hf` and `lclm.eval.generate` alike, never a target
for `convert --to-checkpoint`; a machine with fewer devices than the training mesh is told
generate's own mesh flags."""

import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from support import DEMO_CORPUS, ROOT

from lclm import hf
from lclm.config import ModelConfig, load_config
from lclm.convert import main as convert
from lclm.errors import StartupError
from lclm.eval import generate
from lclm.eval.model import restore_params
from lclm.models.decoder import init_params
from lclm.parallel import make_mesh
from lclm.train.stages import run_stages
from lclm.workdir.layout import workdir_to_read
from lclm.workdir.lock import WorkdirLock

pytestmark = pytest.mark.slow  # trains a staged run, starts processes

PROMPT = "She counted 39 plus 15 and wrote"


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    """The directory of a finished two-stage run: stage 0 on one device (64 tokens), stage 1
    on sp=2 (128 tokens), one step each."""
    c = load_config(os.path.join(ROOT, "configs", "demo_stages.py"))
    c.workdir = str(tmp_path_factory.mktemp("staged") / "run")
    c.mesh.update(fsdp=1)
    c.model.update(dim=32, n_heads=2, n_kv_heads=1, ffn_dim=64, ffn_chunk=32, loss_chunk=32)
    c.attention.update(q_chunk=16, kv_chunk=16)
    c.data.update(source="text", path=DEMO_CORPUS)
    c.stages.update(schedule="64:1e4:1:1, 128:1e5:1:2", tokens_per_batch=256)
    c.train.update(warmup=0)
    c.log.update(every=1, progress=False)
    c.validation.path = ""
    assert [len(records) for records in run_stages(c)] == [1, 1]
    assert sorted(os.listdir(c.workdir)) == ["stage0_64", "stage1_128"]
    return c.workdir


def _generate(*flags, devices=None):
    """`python -m lclm.eval.generate` as a user runs it: devices simulated as the run's config.json
    asks, or `devices` of them (a machine that has that many)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    if devices:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "lclm.eval.generate",
            "--prompt",
            PROMPT,
            "--max-new-tokens",
            "6",
            *flags,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_convert_and_generate_read_a_staged_runs_directory_as_its_last_stage(
    staged, tmp_path, capsys
):
    last = os.path.join(staged, "stage1_128")
    assert workdir_to_read(staged) == last
    r = _generate("--checkpoint", staged)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "stage1_128 step 1 on mesh {'dp': 1, 'fsdp': 1, 'tp': 1, 'sp': 2}" in r.stderr
    assert generate.main(["--checkpoint", last, "--prompt", PROMPT, "--max-new-tokens", "6"]) == 0
    assert r.stdout == capsys.readouterr().out  # the last stage's continuation

    assert convert(["--from-checkpoint", staged, "--to-hf", str(tmp_path / "hf")]) == 0
    assert "exporting its last stage with a checkpoint, stage1_128" in capsys.readouterr().out
    model, exported = hf.load(str(tmp_path / "hf"))
    trained = restore_params(last, 1, model, make_mesh())
    for a, b in zip(jax.tree.leaves(exported), jax.tree.leaves(trained)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_training_mesh_larger_than_the_machine_is_told_generates_own_flags(staged):
    last = os.path.join(staged, "stage1_128")
    r = _generate("--checkpoint", last, devices=1)
    assert r.returncode == 2, r.stderr[-3000:]
    err = r.stderr.strip().splitlines()[-1]
    assert err == (
        "error: the mesh {'dp': 1, 'fsdp': 1, 'tp': 1, 'sp': 2} (stage1_128 step "
        "1's training mesh) needs 2 devices but lclm simulates 1 CPU device on this "
        f"machine ({os.cpu_count()} cores; at most 16 are simulated on any); pass "
        "--dp/--fsdp/--tp/--sp sizes whose product is at most 1 (e.g. --sp 1); the "
        "parameters load onto any mesh"
    ), err
    assert "config.mesh" not in r.stderr and "Traceback" not in r.stderr
    r = _generate("--checkpoint", last, "--sp", "1", devices=1)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "stage1_128 step 1 on mesh {'dp': 1, 'fsdp': 1, 'tp': 1, 'sp': 1}" in r.stderr


def _tree(path):
    return sorted(
        os.path.join(os.path.relpath(d, path), f) for d, _, files in os.walk(path) for f in files
    )


def test_convert_refuses_a_staged_runs_directory_finished_or_starting(staged, tmp_path, capsys):
    model = ModelConfig(
        vocab_size=512, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64, dtype="float32"
    )
    hf.save(str(tmp_path / "hf"), model, init_params(model, jax.random.key(0)))
    before = _tree(staged)
    assert convert(["--from-hf", str(tmp_path / "hf"), "--to-checkpoint", staged]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(
            f"error: --to-checkpoint {staged!r} is a staged run's directory (it "
            "holds stage0_64, stage1_128), whose stages are runs of their own "
            "that never read a step 0 beside them; convert into a new "
            "directory"
        )
        and err.count("\n") == 1
    ), err
    assert _tree(staged) == before

    # a staged run that has just started: stage 0 holds its lock and nothing else yet
    starting = tmp_path / "starting"
    lock = WorkdirLock(str(starting / "stage0_64"))
    lock.acquire()
    try:
        assert convert(["--from-hf", str(tmp_path / "hf"), "--to-checkpoint", str(starting)]) == 2
        assert "is a staged run's directory (it holds stage0_64)" in capsys.readouterr().err
        assert os.listdir(starting) == ["stage0_64"]
    finally:
        lock.release()


def test_a_directory_that_cannot_be_read_as_one_run_is_one_line(staged, tmp_path):
    # a run's checkpoints beside a staged run's stages: which one is meant cannot be told
    both = tmp_path / "both"
    shutil.copytree(os.path.join(staged, "stage0_64"), both)
    shutil.copytree(os.path.join(staged, "stage1_128"), both / "stage0_128")
    with pytest.raises(StartupError) as e:
        workdir_to_read(str(both))
    assert str(e.value) == (
        f"--checkpoint {str(both)!r} holds both a run's checkpoints and a "
        "staged run's stages (stage0_128); pass "
        f"{str(both / 'stage0_128')!r} for the staged run's last stage, or "
        "move one of the runs to a directory of its own"
    )
    # stages that have saved nothing yet (a run creates checkpoints/ when it starts)
    os.makedirs(tmp_path / "new" / "stage0_64" / "checkpoints")
    with pytest.raises(
        StartupError,
        match=r"is a staged run's directory whose stages "
        r"\(stage0_64\) hold no checkpoint yet",
    ):
        workdir_to_read(str(tmp_path / "new"))
    with pytest.raises(
        StartupError,
        match=r"^--checkpoint 'hdfs://b/run' uses hdfs://, which "
        r"lclm does not read or write",
    ):
        workdir_to_read("hdfs://b/run")

"""`lclm.convert` as an operator meets it (issue 62): a gs:// workdir that a live run holds is
refused by the bucket's own lock (not a local './gs:/...' folder's), the export states null
token ids as 'none', a checkpoint path that does not exist is named as missing."""

import os

import jax
import pytest
from support import DEMO_TOKENIZER

from lclm import hf, storage
from lclm.config import ModelConfig
from lclm.convert import main
from lclm.models.decoder import init_params
from lclm.workdir.lock import WorkdirLock
from lclm.workdir.object_lock import ObjectLock, workdir_lock

MODEL = ModelConfig(
    vocab_size=512,
    dim=32,
    n_layers=2,
    n_heads=2,
    n_kv_heads=1,
    ffn_dim=64,
    dtype="float32",
    bos_id=-1,
    eos_ids=(),
)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny HuggingFace directory whose config names no bos nor eos token."""
    path = str(tmp_path_factory.mktemp("sources") / "hf")
    hf.save(path, MODEL, init_params(MODEL, jax.random.key(0)))
    hf.save_tokenizer(DEMO_TOKENIZER, path, MODEL)
    return path


def test_converting_into_a_gs_workdir_a_live_run_holds_is_refused(
    gcs, hf_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)  # where a './gs:/...' lock folder would be made
    workdir = gcs.bucket() + "/run"
    holder = ObjectLock(workdir)
    holder.acquire()  # a run that has started and saved nothing yet
    try:
        assert main(["--from-hf", hf_dir, "--to-checkpoint", workdir]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: workdir {workdir} is in use by a live run"), err
        assert not storage.exists(workdir + "/checkpoints")
    finally:
        holder.release()
    assert os.listdir(tmp_path) == []


def test_a_lock_is_chosen_by_its_path_and_no_class_takes_the_others(tmp_path):
    assert type(workdir_lock("gs://bucket/run")) is ObjectLock
    assert type(workdir_lock(str(tmp_path))) is WorkdirLock
    with pytest.raises(TypeError, match="workdir_lock"):
        WorkdirLock("gs://bucket/run")
    with pytest.raises(TypeError, match="workdir_lock"):
        ObjectLock(str(tmp_path))


def test_an_export_states_null_token_ids_as_none(hf_dir, tmp_path, capsys):
    run = str(tmp_path / "run")
    assert main(["--from-hf", hf_dir, "--to-checkpoint", run]) == 0
    assert main(["--from-checkpoint", run, "--to-hf", str(tmp_path / "out")]) == 0
    (line,) = [l for l in capsys.readouterr().out.splitlines() if "bos " in l]
    assert line.endswith("bos none, eos none"), line


def test_a_checkpoint_path_that_does_not_exist_is_named_missing(tmp_path, capsys):
    missing = str(tmp_path / "no_such_run")
    assert main(["--from-checkpoint", missing, "--to-hf", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {missing!r} does not exist; pass the workdir of an lclm run\n", err

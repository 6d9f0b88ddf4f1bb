"""HuggingFace directories and evaluation reports on object storage, against the local GCS
and S3 servers: `convert --to-hf gs://` uploads what a local export writes, `--from-hf` reads
a bucket's directory as it reads a local one, a checkpoint in a bucket converts both ways,
eval reads its data and tokenizer from a bucket and writes its report into one, and a bucket
that does not exist is one line before any work."""

import json
import os
import uuid

import jax
import numpy as np
import pytest
from support import DEMO_TOKENIZER, write_text

from lclm import hf, storage
from lclm.config import ModelConfig
from lclm.convert import main as convert
from lclm.eval import line_retrieval, perplexity
from lclm.models.decoder import init_params
from lclm.workdir.checkpoint import saved_config

MODEL = ModelConfig(
    vocab_size=512,
    dim=32,
    n_layers=1,
    n_heads=2,
    n_kv_heads=1,
    ffn_dim=64,
    dtype="float32",
    ffn_chunk=32,
)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """(a tiny HuggingFace directory with a tokenizer, an lclm workdir converted from it, its
    local export)."""
    tmp = tmp_path_factory.mktemp("sources")
    hf.save(str(tmp / "hf"), MODEL, init_params(MODEL, jax.random.key(0)))
    hf.save_tokenizer(DEMO_TOKENIZER, str(tmp / "hf"), MODEL)
    assert convert(["--from-hf", str(tmp / "hf"), "--to-checkpoint", str(tmp / "run")]) == 0
    assert convert(["--from-checkpoint", str(tmp / "run"), "--to-hf", str(tmp / "out")]) == 0
    return str(tmp / "hf"), str(tmp / "run"), str(tmp / "out")


def _same_files(remote: str, local: str) -> None:
    names = sorted(os.listdir(local))
    assert storage.listdir(remote) == names
    for name in names:
        with open(os.path.join(local, name), "rb") as f:
            assert storage.read_bytes(storage.join(remote, name)) == f.read(), name


def _same_weights(a: str, b: str) -> None:
    (ca, pa), (cb, pb) = hf.load(a), hf.load(b)
    assert ca == cb
    for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_to_hf_on_gcs_uploads_the_local_export(gcs, sources, capsys):
    _, run, exported = sources
    out = storage.join(gcs.bucket(), "hf")
    # an earlier sharded export's weights: the new export (one file) must not be read with them
    write_text(storage.join(out, "model.safetensors.index.json"), "{}")
    storage.write_bytes(storage.join(out, "model-00001-of-00002.safetensors"), b"old")
    assert convert(["--from-checkpoint", run, "--to-hf", out]) == 0
    assert f"to {out}:" in capsys.readouterr().out
    _same_files(out, exported)
    _same_weights(out, exported)


def test_from_hf_on_gcs_converts_as_the_local_directory(gcs, sources, tmp_path):
    source, _, exported = sources
    remote = storage.join(gcs.bucket(), "llama")
    storage.upload(source, remote)
    assert convert(["--from-hf", remote, "--to-checkpoint", str(tmp_path / "run")]) == 0
    saved = saved_config(str(tmp_path / "run"))[1]
    assert saved["data"]["tokenizer"] == storage.join(remote, "tokenizer.model")
    # exported back (its tokenizer read from the bucket): what the local source's run exports
    assert (
        convert(["--from-checkpoint", str(tmp_path / "run"), "--to-hf", str(tmp_path / "out")]) == 0
    )
    assert sorted(os.listdir(tmp_path / "out")) == sorted(os.listdir(exported))
    for name in os.listdir(exported):
        assert (tmp_path / "out" / name).read_bytes() == open(
            os.path.join(exported, name), "rb"
        ).read(), name


def test_an_s3_round_trip(s3, sources, tmp_path):
    source, run, _ = sources
    out = storage.join(s3.bucket(), "hf")
    assert convert(["--from-checkpoint", run, "--to-hf", out]) == 0
    assert convert(["--from-hf", out, "--to-checkpoint", str(tmp_path / "run")]) == 0
    assert (
        convert(["--from-checkpoint", str(tmp_path / "run"), "--to-hf", str(tmp_path / "back")])
        == 0
    )
    _same_weights(str(tmp_path / "back"), source)


def test_a_checkpoint_on_gcs_converts_both_ways(gcs, sources, tmp_path):
    source, _, exported = sources
    run = storage.join(gcs.bucket(), "run")
    assert convert(["--from-hf", source, "--to-checkpoint", run]) == 0
    assert convert(["--from-checkpoint", run, "--to-hf", str(tmp_path / "out")]) == 0
    _same_weights(str(tmp_path / "out"), exported)


def test_eval_reads_hf_from_and_writes_its_report_to_gcs(gcs, sources, capsys):
    source, _, _ = sources
    bucket = gcs.bucket()
    storage.upload(source, storage.join(bucket, "llama"))
    out = storage.join(bucket, "eval")
    assert (
        line_retrieval.main(
            [
                "--hf",
                storage.join(bucket, "llama"),
                "--format",
                "paper",
                "--digits",
                "2",
                "--lengths",
                "100",
                "--samples",
                "1",
                "--depths",
                "1",
                "--q-chunk",
                "32",
                "--kv-chunk",
                "32",
                "--out",
                out,
            ]
        )
        == 0
    )
    assert f"wrote {out}/line_retrieval.{{md,json,png}}" in capsys.readouterr().out
    assert storage.listdir(out) == [
        "line_retrieval.json",
        "line_retrieval.md",
        "line_retrieval.png",
    ]
    assert (
        json.loads(storage.read_text(storage.join(out, "line_retrieval.json")))["model"] == "llama"
    )
    assert storage.read_bytes(storage.join(out, "line_retrieval.png"))[:4] == b"\x89PNG"


def test_perplexity_reads_data_and_tokenizer_from_s3(s3, sources, capsys):
    source, _, _ = sources
    bucket = s3.bucket()
    data, tokenizer = storage.join(bucket, "heldout.jsonl"), storage.join(bucket, "t.model")
    write_text(
        data,
        "".join(json.dumps({"text": f"document {i}: " + "words " * 60}) + "\n" for i in range(3)),
    )
    storage.upload(DEMO_TOKENIZER, tokenizer)
    out = storage.join(bucket, "ppl")
    assert (
        perplexity.main(
            [
                "--hf",
                source,
                "--tokenizer",
                tokenizer,
                "--data",
                data,
                "--lengths",
                "32",
                "--buckets",
                "2",
                "--documents",
                "2",
                "--q-chunk",
                "32",
                "--kv-chunk",
                "32",
                "--out",
                out,
            ]
        )
        == 0
    )
    report = json.loads(storage.read_text(storage.join(out, "perplexity.json")))
    assert report["data"] == data, report


@pytest.mark.parametrize(
    "flags",
    [
        ["--from-checkpoint", "RUN", "--to-hf", "OUT"],
        ["--from-hf", "HF", "--to-checkpoint", "OUT"],
        ["--hf", "HF", "--lengths", "100", "--out", "OUT"],  # eval line_retrieval
    ],
)
def test_a_bucket_that_does_not_exist_is_one_line_at_start(
    gcs, sources, capsys, tmp_path, monkeypatch, flags
):
    monkeypatch.chdir(tmp_path)  # where a local 'gs:' folder would appear
    out = f"gs://lclm-missing-{uuid.uuid4().hex[:12]}/out"
    values = {"RUN": sources[1], "HF": sources[0], "OUT": out}
    flags = [values.get(f, f) for f in flags]
    command = line_retrieval.main if "--hf" in flags else convert
    assert command(flags) == 2
    err = capsys.readouterr().err
    flag = flags[flags.index(out) - 1]
    assert err.startswith(f"error: {flag} {out!r} cannot be written (") and err.count("\n") == 1, (
        err
    )
    assert os.listdir(tmp_path) == []

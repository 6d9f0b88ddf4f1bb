"""End to end: train a tiny line-retrieval model for a few steps, then run the eval CLI."""

import json
import os
import re

import pytest
from support import DEMO_TOKENIZER, ROOT

from lclm.config import load_config
from lclm.eval import line_retrieval
from lclm.train.loop import train

pytestmark = pytest.mark.slow  # trains models or starts processes: left out by -m 'not slow'


def tiny_config(tmp_path):
    c = load_config(os.path.join(ROOT, "configs", "tiny_line_retrieval.py"))
    c.workdir = str(tmp_path / "run")
    c.mesh.update(dp=1, fsdp=2, tp=1, sp=2)
    c.model.update(
        dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, ffn_chunk=32, loss_chunk=32
    )
    c.attention.update(q_chunk=32, kv_chunk=32)
    c.data.update(path="line_retrieval:tokens=128;digits=2;seed=1", seq_len=128, batch_size=4)
    c.train.update(steps=2, warmup=1)
    c.stages.list = ()  # one short run, not the config's context-extension stages
    c.log.update(every=1, progress=False)
    c.checkpoint.update(every=0)
    return c


def test_eval_cli_on_a_freshly_trained_checkpoint(tmp_path, capsys):
    config = tiny_config(tmp_path)
    records = train(config)
    assert len(records) == 2
    out = tmp_path / "eval"
    # the saved mesh is fsdp=2 x sp=2; evaluate on a longer ring than training used
    rc = line_retrieval.main(
        [
            "--checkpoint",
            config.workdir,
            "--lengths",
            "128,200",
            "--samples",
            "2",
            "--depths",
            "2",
            "--sp",
            "4",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| length | prompt tokens | 0-50% | 50-100% | all |" in printed
    assert (out / "line_retrieval.md").read_text().strip() in printed
    assert (out / "line_retrieval.png").read_bytes()[:4] == b"\x89PNG"
    report = json.loads((out / "line_retrieval.json").read_text())
    assert report["mesh"]["sp"] == 4 and report["mesh"]["fsdp"] == 2
    assert report["format"]["digits"] == 2  # taken from the run's line_retrieval data
    assert len(report["cells"]) == 4 and len(report["samples"]) == 8
    for cell in report["cells"]:
        assert 0.0 <= cell["accuracy"] <= 1.0 and cell["n"] == 2
        assert cell["length"] - 10 < cell["prompt_tokens"] <= cell["length"]
        assert cell["prompt_tokens"] <= cell["padded_to"]
        assert cell["padded_to"] % 4 == 0


def test_eval_cli_reports_a_missing_checkpoint(tmp_path, capsys):
    assert (
        line_retrieval.main(
            [
                "--checkpoint",
                str(tmp_path / "none"),
                "--lengths",
                "128",
                "--out",
                str(tmp_path / "eval"),
            ]
        )
        == 2
    )
    assert "does not exist; pass the workdir of an lclm run" in capsys.readouterr().err


def test_eval_cli_on_a_huggingface_directory(tmp_path, capsys):
    import jax

    from lclm import hf
    from lclm.config import ModelConfig
    from lclm.models.decoder import init_params

    model = ModelConfig(
        vocab_size=512,
        dim=32,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        ffn_dim=64,
        dtype="float32",
        ffn_chunk=32,
    )
    hf.save(str(tmp_path / "hf"), model, init_params(model, jax.random.key(0)))
    rc = line_retrieval.main(
        [
            "--hf",
            str(tmp_path / "hf"),
            "--tokenizer",
            DEMO_TOKENIZER,
            "--format",
            "paper",
            "--digits",
            "2",
            "--lengths",
            "200",
            "--samples",
            "1",
            "--depths",
            "2",
            "--sp",
            "2",
            "--q-chunk",
            "32",
            "--kv-chunk",
            "32",
            "--out",
            str(tmp_path / "eval"),
        ]
    )
    assert rc == 0
    report = json.loads((tmp_path / "eval" / "line_retrieval.json").read_text())
    assert report["model"] == "hf" and report["mesh"]["sp"] == 2
    assert report["format"]["line"].startswith("line {key}: REGISTER_CONTENT")
    assert all(0.0 <= c["accuracy"] <= 1.0 for c in report["cells"])


def test_results_go_beside_what_was_evaluated_not_into_the_current_directory():
    """In a new <date-time> folder: a second run does not replace the first's report."""
    from lclm.eval.line_retrieval import parse_args

    stamp = r"/\d{8}-\d{6}$"
    assert re.match(
        re.escape(os.path.join("runs/demo", "line_retrieval_eval")) + stamp,
        parse_args(["--checkpoint", "runs/demo"]).out,
    )
    assert re.match(
        re.escape(os.path.join("runs", "line_retrieval_eval", "Llama-2-7b-hf")) + stamp,
        parse_args(["--hf", "/models/Llama-2-7b-hf/"]).out,
    )
    assert parse_args(["--hf", "x", "--out", "elsewhere"]).out == "elsewhere"


def _evaluated(monkeypatch, tmp_path, out, fallback_dir):
    """Runs the eval CLI with the model and its evaluation replaced by a fixed result (no
    model is needed to test what happens to one), and with `out` made a file while it
    evaluates: a fault that appears after the start-up checks passed, like a disk that fills.
    The fallback folder goes under `fallback_dir`. Returns (exit status, the result)."""
    import tempfile
    from types import SimpleNamespace

    records = [
        dict(length=128, depth_bin=b, correct=b == 0, prompt_tokens=120, padded_to=128)
        for b in (0, 1)
    ]
    result = dict(cells=[line_retrieval._cell(records, 128, b, 2) for b in (0, 1)], samples=records)
    model = SimpleNamespace(
        name="fake",
        mesh=SimpleNamespace(shape={"sp": 1}),
        attention=SimpleNamespace(layout="striped", strategy="ring"),
        config=SimpleNamespace(max_position_embeddings=128),
    )

    def evaluate(*args, **kwargs):
        out.write_text("")
        return result

    monkeypatch.setattr(line_retrieval, "load_model", lambda args: (model, None))
    monkeypatch.setattr(line_retrieval, "evaluate", evaluate)
    monkeypatch.setattr(tempfile, "tempdir", str(fallback_dir))
    rc = line_retrieval.main(
        ["--hf", str(tmp_path / "hf"), "--lengths", "128", "--depths", "2", "--out", str(out)]
    )
    return rc, result


def test_results_are_kept_when_the_output_fails_after_the_evaluation(tmp_path, monkeypatch, capsys):
    out, fallback_dir = tmp_path / "eval", tmp_path / "tmp"
    fallback_dir.mkdir()
    rc, result = _evaluated(monkeypatch, tmp_path, out, fallback_dir)
    assert rc == 1
    captured = capsys.readouterr()
    table = line_retrieval.markdown_table(result["cells"], [128], 2)
    assert table in captured.out  # printed before the files were tried
    [fallback] = os.listdir(fallback_dir)
    fallback = fallback_dir / fallback
    assert captured.err == (
        f"error: could not write the report into --out {str(out)!r} (File "
        "exists); the table is printed above and the report was written "
        f"to {fallback}\n"
    )
    assert (fallback / "line_retrieval.md").read_text() == table + "\n"
    assert (
        json.loads((fallback / "line_retrieval.json").read_text())["samples"] == result["samples"]
    )
    assert (fallback / "line_retrieval.png").is_file()


def test_the_table_survives_when_no_report_can_be_written(tmp_path, monkeypatch, capsys):
    out, afile = tmp_path / "eval", tmp_path / "afile"
    afile.write_text("")
    rc, result = _evaluated(monkeypatch, tmp_path, out, afile / "tmp")  # no temporary folder
    assert rc == 1
    captured = capsys.readouterr()
    assert line_retrieval.markdown_table(result["cells"], [128], 2) in captured.out
    assert captured.err.startswith(f"error: could not write the report into --out {str(out)!r}")
    assert (
        captured.err.endswith(
            "; the table is printed above; the per-sample answers and the heatmap are lost\n"
        )
        and captured.err.count("\n") == 1
    )

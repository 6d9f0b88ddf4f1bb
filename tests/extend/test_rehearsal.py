"""The CPU rehearsal of the real extension (configs/smollm2_rehearsal.py: the real SmolLM2
weights, the same code data and command as configs/smollm2_64k.py, at 512 -> 1K -> 2K), run
as a user runs it, as a process: the report's structure and its verdicts. Measured a little
lighter than the committed rehearsal (one held-out document per length, two lengths, one
RULER task), so that it stays a few minutes of CI."""

import json
import os
import subprocess
import sys

import pytest
from support import ROOT, real_model_dir


@pytest.mark.slow
def test_the_rehearsal_writes_its_report_and_verdicts(tmp_path):
    model = real_model_dir()
    workdir = tmp_path / "rehearsal"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lclm.extend",
            "--config",
            "configs/smollm2_rehearsal.py",
            f"--config.workdir={workdir}",
            f"--config.model.init_from_hf={model}",
            f"--config.data.tokenizer={model}",
            "--config.extension.documents=1",
            "--config.extension.lengths=256,2k",
            "--config.extension.ruler_tasks=vt",
            "--config.extension.passkey_depths=1",
            "--config.stages.list=()",
            "--config.stages.schedule=1k:4e5:1,2k:8e5:1",
            "--config.stages.tokens_per_batch=2048",
            "--budget-minutes=40",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=2400,
    )
    assert done.returncode in (0, 1), done.stderr[-3000:]
    report = json.load(open(workdir / "extension" / "extension.json"))
    assert [p["status"] for p in report["parts"]] == ["done"] * len(report["parts"])
    assert {p["task"] for p in report["parts"]} == {"perplexity", "train", "passkey", "ruler"}
    assert [v["target"] for v in report["verdicts"]] == [
        "loss over positions 1k-2k vs 256-512",
        "passkey at 2k, every depth",
        "loss at 256 kept",
        "loss at 2k below YaRN's",
    ]
    assert all(v["met"] in (True, False) for v in report["verdicts"])
    assert done.returncode == (0 if all(v["met"] for v in report["verdicts"]) else 1)
    for model_name in ("before", "yarn", "after"):
        assert report["results"][model_name]["2048"] is not None
    md = (workdir / "extension" / "extension.md").read_text()
    assert "## RULER subset" in md and "| model | vt | average |" in md
    assert os.path.getsize(workdir / "extension" / "extension.png") > 1000

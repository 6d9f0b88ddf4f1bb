"""The demo trained on your own ShareGPT chats (`--config.data.source=sharegpt
--config.data.path=chat.jsonl`, the documented way) keeps reading its held-out file as what it
is, plain text: a held-out entry with a kind of its own keeps it whatever data.source says."""

import copy
import json
import os
import subprocess
import sys

import pytest
from support import DEMO_CONFIG, ROOT

from lclm.config import load_config
from lclm.config.run_config import run_config
from lclm.data.loader import HostBatches, SourceEntry, parse_sources
from lclm.data.tokenizer import Tokenizer
from lclm.parallel import make_mesh
from lclm.train.startup_checks import check_data, validate

HELD_OUT = os.path.join(ROOT, "data", "demo", "heldout.jsonl")


def _chats(tmp_path, n: int = 24) -> str:
    """A ShareGPT file of `n` short conversations."""
    path = tmp_path / "chat.jsonl"
    with open(path, "w") as f:
        for i in range(n):
            f.write(
                json.dumps(
                    {
                        "conversations": [
                            {"from": "human", "value": f"What is {i} plus {i}?"},
                            {"from": "gpt", "value": f"{i} plus {i} is {2 * i}."},
                        ]
                    }
                )
                + "\n"
            )
    return str(path)


def test_the_demo_on_sharegpt_chats_passes_the_checks_and_reads_its_held_out_text(tmp_path):
    chats = _chats(tmp_path)
    config = load_config(DEMO_CONFIG, {"data.source": "sharegpt", "data.path": chats})
    sizes = validate(config, 8)
    check_data(config)
    assert parse_sources(config.data.path, config.data.source) == [
        SourceEntry("sharegpt", chats, 1.0)
    ]
    assert parse_sources(config.validation.path, config.data.source) == [
        SourceEntry("text", HELD_OUT, 1.0)
    ]
    # the held-out batches as the run reads them: validation.path in data.path's place
    held_out = copy.deepcopy(config)
    held_out.data.path = config.validation.path
    reader = HostBatches(
        run_config(held_out), make_mesh(**sizes), Tokenizer(config.data.tokenizer), prefetch=0
    )
    try:
        batch = next(reader)
    finally:
        reader.close()
    assert batch["tokens"].shape == (config.data.batch_size, config.data.seq_len)
    assert reader.stats.skipped == 0  # every held-out record read as the text it is


@pytest.mark.slow
def test_the_documented_sharegpt_command_trains_and_validates(tmp_path):
    chats = _chats(tmp_path)
    workdir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "NPROC")}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"  # one step: one device is enough
    done = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "train.py"),
            "--config",
            DEMO_CONFIG,
            "--config.data.source=sharegpt",
            f"--config.data.path={chats}",
            f"--config.workdir={workdir}",
            "--config.train.steps=1",
            "--config.log.progress=false",
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    assert records[-1]["step"] == 1 and records[-1]["val_loss"] > 0

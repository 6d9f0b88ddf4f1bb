"""The CPU long-context demonstration learns: configs/tiny_line_retrieval.py's recipe, shortened
(32 -> 64 tokens, 300 steps per stage, the documents at the stage's length only: the recipe's
half-length ones would be 16 tokens, too short for a line), retrieves the asked line's number
well above chance after the context-extension stage.

Chance is 1/9 (one-digit numbers); naming any of the 5 listed numbers at random gives 1/5.
Measured on 2 cores: 0.54 over 100 prompts (stages.extend_lr=1e-3, the recipe's). At this size
stage 1 at stage 0's 3e-3 still gives 0.49: the collapse of the full recipe's 128-token stage
at 3e-3 (0.30) needs its full size, about 10 minutes, to show; this test guards that the
pipeline learns at all (model, ring, loss, stages, decoder), not the learning rate."""

import json
import os

import ml_collections
import pytest
from support import ROOT

from lclm.config import load_config
from lclm.config.stages import stage_configs
from lclm.eval import line_retrieval
from lclm.train.stages import run_stages

pytestmark = pytest.mark.slow  # trains models or starts processes: left out by -m 'not slow'


def test_the_staged_recipe_learns_retrieval_well_above_chance(tmp_path):
    c = load_config(os.path.join(ROOT, "configs", "tiny_line_retrieval.py"))
    c.workdir = str(tmp_path / "run")
    c.stages.update(
        list=(), schedule="32:1e4:300, 64:1e4:300", tokens_per_batch=2048, extend_lr=1e-3
    )
    # the chunks this test's 0.54 was measured with (the recipe's are 32 since its 128-token
    # stage runs a block per device)
    c.model.update(ffn_chunk=16, loss_chunk=16)
    c.attention.update(q_chunk=16, kv_chunk=16)
    c.data.path = (
        ml_collections.FieldReference("line_retrieval:digits=1;seed=0;tokens=")
        + c.data.get_ref("seq_len").to_str()
    )
    c.validation.path = ""
    c.log.update(every=100, progress=False)
    c.checkpoint.every = 0
    run_stages(c)
    last = stage_configs(c)[-1]
    out = tmp_path / "eval"
    assert (
        line_retrieval.main(
            ["--checkpoint", last.workdir, "--lengths", "64", "--samples", "20", "--out", str(out)]
        )
        == 0
    )
    cells = json.loads((out / "line_retrieval.json").read_text())["cells"]
    accuracy = sum(cell["accuracy"] * cell["n"] for cell in cells) / sum(c["n"] for c in cells)
    assert accuracy >= 0.35, f"retrieval accuracy {accuracy:.2f} at 64 tokens (chance 0.11)"

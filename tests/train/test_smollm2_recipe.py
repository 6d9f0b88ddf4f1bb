"""configs/smollm2_64k.py, the real model's extension recipe: its stages as written, and a CPU
smoke run of the same recipe at short lengths (the real SmolLM2-135M from its HF directory,
the recipe's code mixture, both stages, the optimizer carried) whose loss starts where a
pretrained model's does, not near ln(vocabulary)."""

import math
import os

import pytest
from support import ROOT, real_model_dir

from lclm.config import load_config
from lclm.config.stages import stage_configs
from lclm.train.stages import run_stages

RECIPE = os.path.join(ROOT, "configs", "smollm2_64k.py")


def test_the_recipe_states_its_stages():
    c = load_config(RECIPE)
    s32, s64 = stage_configs(c)
    assert [(s.data.seq_len, s.model.rope_theta, s.train.lr) for s in (s32, s64)] == [
        (32768, 1e6, 1e-4),
        (65536, 4e6, 5e-5),
    ]
    assert [s.data.batch_size * s.data.seq_len for s in (s32, s64)] == [256 * 1024] * 2
    assert s64.train.optimizer_from_checkpoint and s64.model.init_from_checkpoint == s32.workdir
    assert c.model.init_from_hf == "checkpoints/smollm2-135m"
    assert c.extension.data.startswith("code-heldout:")


@pytest.mark.slow
def test_the_recipe_trains_the_real_model_on_cpu_at_short_lengths(tmp_path):
    model = real_model_dir()
    c = load_config(RECIPE)
    c.workdir = str(tmp_path / "run")
    c.model.init_from_hf = model
    c.data.tokenizer = model
    c.model.update(dtype="float32", ffn_chunk=256, loss_chunk=256)
    c.attention.update(q_chunk=128, kv_chunk=128)
    c.stages.tokens_per_batch = 1024
    # the recipe's stages as written, at 256 and 512 tokens and 2 steps each
    stages = [dict(s) for s in c.stages.list]
    for stage, length in zip(stages, (256, 512)):
        stage["data"] = dict(stage["data"], seq_len=length)
        stage["train"] = dict(stage["train"], steps=2)
    c.stages.list = stages
    c.validation.update(lengths="", every=2, batches=1)
    c.log.progress = False
    runs = run_stages(c)
    assert [[r["step"] for r in records] for records in runs] == [[1, 2], [1, 2]]
    first = runs[0][0]["loss"]
    # a pretrained model on Python code: far below a random model's ln(49152) = 10.8
    assert math.isfinite(first) and first < 0.5 * math.log(49152)
    assert all(math.isfinite(r["loss"]) for records in runs for r in records)

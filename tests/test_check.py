"""The pre-flight check (`python -m lclm.check`): the demo passes every check, and each check
fails on a fault planted for it: (1) a model whose loss at the target length is near ln(V),
(2) a strategy that lays tokens out wrongly, (3) segment ids that never reach the attention.
The real SmolLM2 with its own RoPE theta passes check 1 (skipped where it is absent)."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from support import (
    DEMO_CONFIG,
    ROOT,
    real_model_dir,
    save_initial_checkpoint,
    small_train_config,
)

from lclm.check.__main__ import chosen_stages, main
from lclm.check.checks import document_check, judge_lengths, length_check, strategy_check
from lclm.check.setup import check_mesh, initial_params, prepare
from lclm.config import ModelConfig, load_config
from lclm.config.run_config import run_config
from lclm.models import decoder
from lclm.ops.context_parallel import STRATEGIES
from lclm.ops.context_parallel.ring import Ring
from lclm.parallel.mesh import make_mesh
from lclm.train.loop import train

TARGET = 256  # the faults' target length (short: 128)


def fault_config(**model):
    """The demo's data and ring over sp=4 x fsdp=2 with a tiny model at 256 tokens."""
    c = small_train_config("unused", mesh=dict(dp=1, fsdp=2, tp=1, sp=4), attention={})
    c.data.seq_len = TARGET
    c.model.update(model)
    return c


def test_demo_passes(capsys):
    assert main(["--config", DEMO_CONFIG]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("weights random init")
    assert [line[:4] for line in lines[1:]] == ["ok  "] * 3
    assert "ln V = 6.2383" in lines[1] and "untrained" in lines[1]
    assert "mesh dp=1 fsdp=2 tp=1 sp=4 vs one device" in lines[2]
    assert "unchanged (max change 0.0e+00" in lines[3]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The workdir of a tiny model trained for a few seconds: its short loss is well below
    ln(V), so a long-length loss near ln(V) stands out."""
    workdir = tmp_path_factory.mktemp("trained")
    c = small_train_config(
        workdir, mesh=dict(dp=1, fsdp=1, tp=1, sp=1), attention={}, train=dict(steps=60, warmup=5)
    )
    c.data.update(seq_len=128, batch_size=8)
    c.checkpoint.every = 60
    train(c)
    return str(workdir)


def test_length_fault_fails(trained, monkeypatch):
    """Planted: a model whose hidden states vanish on rows of the target length (its loss
    there is exactly ln V) while shorter rows are fine."""
    config = fault_config()
    config.model.init_from_checkpoint = trained
    run = prepare(config, config, None)
    assert length_check(run).ok  # the healthy model first
    healthy = decoder.hidden_states

    def broken(c, params, tokens, *args, **kwargs):
        h = healthy(c, params, tokens, *args, **kwargs)
        return h * 0.0 if tokens.shape[1] >= TARGET else h

    monkeypatch.setattr(decoder, "hidden_states", broken)
    result = length_check(run)
    assert not result.ok
    assert f"loss at {TARGET} tokens 6.2383, at 128" in result.text
    assert "within 1 of ln V while the short one is not" in result.text


def test_judge_lengths():
    assert judge_lengths(2.0, 2.2, 10.8)[0]
    assert not judge_lengths(10.5, 2.2, 10.8)[0]  # long near ln V, short not
    assert not judge_lengths(3.0, 2.2, 10.8)[0]  # long 0.8 above short
    assert judge_lengths(6.3, 6.3, 6.24) == (True, judge_lengths(6.3, 6.3, 6.24)[1])
    assert "untrained" in judge_lengths(6.3, 6.3, 6.24)[1]
    assert not judge_lengths(float("nan"), 2.2, 10.8)[0]


def test_rows_with_no_trained_short_prefix_fail_naming_the_fix(tmp_path):
    """Chats whose prompts are longer than the target (128 tokens): the window at a chat's
    start has every target masked. It is skipped, so the check's rows have something to
    learn (they once all had nothing: the check printed `ok` comparing a loss of 0 with 0),
    and their first 64 tokens, still prompt, give no short loss: check 1 fails saying so."""
    chats = tmp_path / "long_prompts.jsonl"
    chats.write_text(
        "".join(
            json.dumps(
                {
                    "conversations": [
                        {
                            "from": "human",
                            "value": f"Count the apples. {' '.join(['one apple'] * 60)}. {i}?",
                        },
                        {"from": "gpt", "value": f"{i} apples."},
                    ]
                }
            )
            + "\n"
            for i in range(8)
        )
    )
    config = load_config(DEMO_CONFIG, {"data.source": "sharegpt", "data.path": str(chats)})
    run = prepare(config, config, 128)
    assert (run.rows["loss_mask"].sum(axis=1) > 0).all()
    result = length_check(run)
    assert not result.ok
    assert "the first 64 tokens of the rows have no trained target" in result.text
    assert "raise --length" in result.text


class MislaidRing(Ring):
    """A planted layout bug: the ring takes the striped shards for contiguous ones, so its
    causal masks let tokens see later ones."""

    def attention(self, q, k, v, *, mesh, **kwargs):
        return super().attention(q, k, v, mesh=mesh, **kwargs | dict(layout="contiguous"))


def test_strategy_fault_fails(monkeypatch):
    run = prepare(fault_config(), fault_config(), None)
    monkeypatch.setitem(STRATEGIES, "ring", MislaidRing())
    result = strategy_check(run)
    assert not result.ok and "vs one device (sp=1)" in result.text, result.text


def test_document_fault_fails(monkeypatch):
    """Planted: the layers never see the segment ids (the mask mode ignores documents)."""
    run = prepare(fault_config(), fault_config(), None)
    healthy = decoder._layer
    monkeypatch.setattr(
        decoder,
        "_layer",
        lambda c, a, mesh, x, p, rope, segment_ids: healthy(c, a, mesh, x, p, rope, None),
    )
    result = document_check(run)
    assert not result.ok and "CHANGED: tokens attend across document boundaries" in result.text
    sections = run.sections
    off = dataclasses.replace(
        run,
        sections=dataclasses.replace(
            sections, data=dataclasses.replace(sections.data, document_mask=False)
        ),
    )
    assert "by design" in document_check(off).line()


def test_mesh_shrinks_keeping_sp():
    c = load_config(f"{ROOT}/configs/llama7b_256k.py")  # fsdp=-1 x sp=8
    assert check_mesh(c, 8) == dict(dp=1, fsdp=1, tp=1, sp=8)
    assert check_mesh(c, 16) == dict(dp=1, fsdp=2, tp=1, sp=8)
    assert check_mesh(c, 3) == dict(dp=1, fsdp=1, tp=1, sp=2)


def test_staged_config_checks_last_then_first():
    stages = chosen_stages(load_config(f"{ROOT}/configs/demo_stages.py"))
    assert [(label, s.data.seq_len) for label, s in stages] == [
        ("stage 3/3 (512 tokens)", 512),
        ("stage 1/3 (128 tokens)", 128),
    ]


def test_a_stage_after_a_huggingface_one_checks_the_previous_stages_weights(tmp_path):
    """A later stage of a run started from HuggingFace keeps `init_from_hf` beside the previous
    stage's `init_from_checkpoint`: training loads the checkpoint, and so must the check
    (the HF path here does not exist: reading it would fail)."""
    saved = small_train_config(tmp_path / "stage0", mesh=dict(fsdp=1, sp=1), attention={})
    params = save_initial_checkpoint(saved, step=2, seed=7)
    model = ModelConfig.from_config(saved.model)
    stage = small_train_config(tmp_path / "stage1", mesh=dict(fsdp=1, sp=1), attention={})
    stage.model.update(
        init_from_hf=str(tmp_path / "no-such-hf-dir"), init_from_checkpoint=saved.workdir
    )
    loaded = initial_params(run_config(stage), model, make_mesh(devices=jax.devices()[:1]))
    for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_real_model_passes_length_check():
    """SmolLM2-135M with its own RoPE theta at an 8K target, run at 1K (--length) against
    256 tokens: the loss falls with context, far below ln V."""
    model = real_model_dir()
    c = load_config(f"{ROOT}/configs/smollm2_64k.py")
    c.stages.list = ()
    c.data.seq_len = 8192
    c.model.update(init_from_hf=model, rope_theta=1e5)
    run = prepare(c, c, 1024)
    assert "ran at 1024 tokens (--length), not the configured 8192" in run.notes[0]
    result = length_check(run)
    assert result.ok and "loss at 1024 tokens" in result.text, result.text

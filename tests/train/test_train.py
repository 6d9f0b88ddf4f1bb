"""The trainer end to end on simulated devices: falling loss, metrics, accumulation."""

import io
import json
import logging
import os
import re
import sys

import jax
import numpy as np
import pytest
from support import DEMO_CONFIG

from lclm.config import AttentionConfig, ModelConfig, load_config
from lclm.config.run_config import run_config
from lclm.config.secrets import public_config
from lclm.data.loader import batch_sharding
from lclm.ops.layout import batch_to_layout
from lclm.parallel import make_mesh
from lclm.train.loop import train
from lclm.train.step import make_optimizer, make_train_step
from lclm.workdir.state import init_state


def demo_config(tmp_path, **changes):
    c = load_config(DEMO_CONFIG)
    c.workdir = str(tmp_path / "run")
    c.model.update(dim=64, n_layers=2, ffn_dim=128, ffn_chunk=32, loss_chunk=32)
    c.data.update(seq_len=128, batch_size=4)
    c.attention.update(q_chunk=16, kv_chunk=16)
    c.mesh.update(dp=1, fsdp=2, tp=1, sp=2)
    c.train.update(steps=16, lr=1e-2, warmup=2)
    c.log.update(every=4, progress=False)
    for key, value in changes.items():
        section, field = key.split("__")
        c[section][field] = value
    return c


@pytest.mark.slow
def test_demo_steps_reduce_the_loss_and_write_metrics(tmp_path):
    config = demo_config(tmp_path, log__wandb=True)  # WANDB_MODE=disabled in conftest
    records = train(config)
    losses = [r["loss"] for r in records]
    assert losses[-1] < losses[0] - 1.0, losses
    lines = [json.loads(l) for l in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in lines] == [1, 4, 8, 12, 16]
    for r in lines:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_sec"} <= set(r)
        assert np.isfinite(r["loss"]) and r["tokens_per_sec"] > 0
    # the lr each step used: warmup reaches lr at step `warmup`, step 1 already trains
    assert lines[0]["lr"] == pytest.approx(config.train.lr / config.train.warmup)
    assert lines[1]["lr"] < config.train.lr
    saved = json.load(open(tmp_path / "run" / "config.json"))
    assert saved["mesh"]["sp"] == 2


def test_secrets_never_reach_saved_config():
    import ml_collections

    secrets = dict(
        wandb_api_key="s1",
        token="s2",
        apikey="s3",
        wandbApiKey="s4",
        secrets="s5",
        passwd="s6",
        credentials="s7",
        auth_header="s8",
        db_password="s9",
        hf_token="s10",
    )
    c = ml_collections.ConfigDict(
        dict(log=dict(every=1, **secrets), data=dict(tokenizer="t.model", **secrets))
    )
    public = public_config(c)
    for value in secrets.values():
        assert f'"{value}"' not in json.dumps(public)
    assert public == {"log": {"every": 1}, "data": {"tokenizer": "t.model"}}
    # none of lclm's own fields is mistaken for a secret
    from lclm.config import base_config

    assert public_config(base_config()) == base_config().to_dict()


def test_wandb_resumes_its_run_and_keeps_secret_command_lines_out(tmp_path, monkeypatch):
    from lclm.train.metrics import wandb_run

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setattr(sys, "argv", ["train.py", "--config.log.wandb_api_key=SECRETVALUE"])
    config = demo_config(tmp_path, log__wandb=True)
    os.makedirs(config.workdir)
    for resume_step in (0, 8):  # a first start, then a resume in the same workdir
        wandb_run(run_config(config), resume_step).finish()
    runs = sorted(os.listdir(os.path.join(config.workdir, "wandb")))
    runs = [r for r in runs if r.startswith("offline-run-")]
    run_id = open(os.path.join(config.workdir, "wandb_id")).read()
    # one run, resumed (wandb suffixes "-1" to the directory of a start in the same second)
    assert len(runs) == 2
    assert all(re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-\d+)?", r) for r in runs)
    for root, _, files in os.walk(config.workdir):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                assert b"SECRETVALUE" not in f.read(), name


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["striped", "contiguous", "zigzag"])
def test_grad_accumulation_equals_one_big_batch(tmp_path, layout):
    config = demo_config(tmp_path)
    config.model.update(vocab_size=64)
    model = ModelConfig.from_config(config.model)
    attention = AttentionConfig(layout=layout, q_chunk=16, kv_chunk=16)
    mesh = make_mesh(fsdp=2, sp=2)
    rng = np.random.default_rng(0)
    b, t = 8, 64
    tok = rng.integers(0, 64, (b, t + 1)).astype(np.int32)
    batch = dict(
        tokens=tok[:, :-1],
        targets=tok[:, 1:],
        loss_mask=(rng.random((b, t)) < 0.5).astype(np.float32),
        positions=np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
        segment_ids=np.ones((b, t), np.int32),
    )
    batch = batch_to_layout(batch, layout, 2)
    batch = {k: jax.device_put(v, batch_sharding(mesh)) for k, v in batch.items()}
    results = []
    for accum in (1, 4):
        config.train.grad_accum = accum
        optimizer = make_optimizer(run_config(config).train)
        state = init_state(model, optimizer, mesh, seed=3)
        step = jax.jit(make_train_step(model, attention, run_config(config).train, mesh, optimizer))
        state, metrics = step(state, batch)
        results.append((metrics, jax.device_get(state.params)))
    (m1, p1), (m4, p4) = results
    assert float(m1["loss"]) == pytest.approx(float(m4["loss"]), rel=1e-5)
    assert float(m1["grad_norm"]) == pytest.approx(float(m4["grad_norm"]), rel=1e-4)
    # Adam's first update is about lr * sign(g): a wrong accumulation flips or zeroes updates
    # (differences of ~lr), while float32 summation order moves entries whose gradient is
    # within rounding of zero by a few percent of lr (1 entry in 16384 here)
    lr = float(m1["lr"])
    for a, c in zip(jax.tree.leaves(p1), jax.tree.leaves(p4)):
        np.testing.assert_allclose(a, c, rtol=1e-4, atol=0.05 * lr)
        assert np.mean(np.abs(a - c) > 1e-6) < 1e-3


@pytest.mark.slow
def test_resume_continues_with_the_same_losses_under_another_strategy(tmp_path, caplog):
    full = train(demo_config(tmp_path / "a", train__steps=8, log__every=1, checkpoint__every=4))
    first = train(
        demo_config(tmp_path / "b", train__steps=8, log__every=1, checkpoint__every=4), stop_after=5
    )  # step 5 is lost
    # same workdir, longer run: restores step 4 (params, optimizer, data position), under
    # another context-parallel strategy (free: Ulysses x ring, so the batches' layout too)
    resumed = train(
        demo_config(
            tmp_path / "b",
            train__steps=8,
            log__every=1,
            checkpoint__every=4,
            attention__strategy="usp",
            attention__ulysses=2,
        )
    )
    assert [r["step"] for r in resumed] == [5, 6, 7, 8]
    assert [r["step"] for r in first] == [1, 2, 3, 4, 5]
    np.testing.assert_allclose(
        [r["loss"] for r in first[:4] + resumed], [r["loss"] for r in full], rtol=1e-5
    )
    steps = sorted(os.listdir(tmp_path / "b" / "run" / "checkpoints"))
    assert steps == ["4", "8"]
    with caplog.at_level(logging.INFO):  # a finished run says so, once, and trains nothing
        assert train(demo_config(tmp_path / "b", train__steps=8, checkpoint__every=4)) == []
    assert "is already trained to step 8 (train.steps); nothing to do" in caplog.text
    assert caplog.text.count("already") == 1, caplog.text


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_console_says_compiling_then_counts_eta_from_compiled_steps():
    from lclm.train.metrics import Progress

    plain = io.StringIO()  # CI, SLURM logs: plain lines
    progress = Progress(100, 1, stream=plain)
    for step in range(1, 11):
        progress.step_done(step)
        if step in (1, 10):
            progress.update(
                dict(step=step, loss=2.5, lr=1e-3, tokens_per_sec=100.0, skipped_steps=0)
            )
    progress.close(["summary line"])
    lines = plain.getvalue().splitlines()
    assert lines[0] == "compiling the training step (step 1 of 100)..."
    assert lines[1].startswith("compiled and ran step 1 in ")
    assert "ETA" not in lines[2]  # no rate yet: only the compiled step ran
    assert "steps/s, ETA" in lines[3] and lines[-1] == "summary line"
    terminal = _Terminal()  # a terminal: a bar with the metrics
    progress = Progress(10, 1, stream=terminal)
    for step in range(1, 11):
        progress.step_done(step)
    progress.update(dict(step=10, loss=2.5, lr=1e-3, tokens_per_sec=100.0))
    progress.close([])
    assert "10/10" in terminal.getvalue() and "loss=2.5000" in terminal.getvalue()

"""The memory planner: parameter bytes per device match the real sharded arrays."""

import os

import jax
import pytest
from support import DEMO_CONFIG, ROOT

from lclm.config import ModelConfig, load_config
from lclm.config.run_config import run_config
from lclm.parallel import make_mesh
from lclm.plan.__main__ import main
from lclm.plan.memory import estimate
from lclm.train.step import make_optimizer
from lclm.workdir.state import init_state


@pytest.mark.parametrize("mesh", [dict(fsdp=2, sp=4), dict(tp=2, sp=4), dict(dp=2, fsdp=4)])
def test_parameter_and_optimizer_bytes_match_the_sharded_state(mesh):
    config = load_config(DEMO_CONFIG)
    config.mesh.update(dict(dp=1, fsdp=1, tp=1, sp=1) | mesh)
    plan = estimate(config, 8)
    model = ModelConfig.from_config(config.model)
    state = init_state(model, make_optimizer(run_config(config).train), make_mesh(**mesh), seed=0)
    on_device0 = lambda tree: sum(
        x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree) if x.ndim > 0
    )
    assert plan.params == pytest.approx(on_device0(state.params), rel=1e-6)
    assert plan.optimizer == pytest.approx(on_device0(state.opt_state), rel=1e-6)
    assert plan.tokens_per_step == config.data.batch_size * config.data.seq_len


def test_plan_cli(capsys):
    assert (
        main(
            [
                "--config",
                os.path.join(ROOT, "configs", "llama7b_256k.py"),
                "--devices",
                "32",
                "--device",
                "tpu-v4",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "32,768" in out and "1,048,576" in out
    assert "the ring overlaps" in out and "tpu-v4 memory" in out
    assert main(["--config", os.path.join(ROOT, "configs", "llama7b_256k.py")]) == 2


def test_plan_measure_passes_its_config_to_the_benchmark(monkeypatch, capsys):
    """--measure runs bench.train_step with the same --config FILE --config.a.b=V arguments,
    plus the longest stage's fields of a staged config (which the benchmark accepts: it
    measures the fields it is given, it does not run the stages)."""
    import argparse
    import runpy
    import sys

    from lclm.cli import parse_cli

    ran = []
    monkeypatch.setattr(
        runpy, "run_module", lambda name, run_name: ran.append((name, list(sys.argv)))
    )
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    staged = os.path.join(ROOT, "configs", "demo_stages.py")
    assert (
        main(
            [
                "--config",
                staged,
                "--config.model.n_layers=1",
                "--measure",
                "--config.train.lr",
                "0.5",
            ]
        )
        == 0
    )
    assert "== stage 2: seq_len 512" in capsys.readouterr().out
    ((name, argv),) = ran
    assert name == "bench.train_step"
    assert argv[:5] == ["bench.train_step", "--config", staged, "--steps", "1"]
    assert argv[5:8] == ["--config.model.n_layers=1", "--config.train.lr", "0.5"]
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int)
    _, c = parse_cli(ap, argv[1:], runs_stages=False)
    assert (
        c.model.n_layers,
        c.train.lr,
        c.data.seq_len,
        c.data.batch_size,
        c.model.rope_theta,
        c.mesh.sp,
    ) == (1, 0.5, 512, 8, 1e6, 4)


def test_offload_moves_the_saved_layers_to_host_memory():
    plans = {}
    for remat in ("full", "attention", "offload"):
        config = load_config(os.path.join(ROOT, "configs", "llama1b.py"))
        config.model.remat, config.data.seq_len = remat, 524288
        plans[remat] = estimate(config, 1)
    full, attention, offload = plans["full"], plans["attention"], plans["offload"]
    layers = 16  # LLaMA-3.2-1B
    # attention keeps the ring's output and lse per layer on top of the layer input
    assert attention.activations_per_layer > full.activations_per_layer
    assert full.host_activations == attention.host_activations == 0
    assert offload.host_activations == pytest.approx(layers * attention.activations_per_layer)
    assert offload.total < full.total < attention.total


def test_plan_suggests_offload_when_the_run_does_not_fit(capsys):
    assert (
        main(
            [
                "--config",
                os.path.join(ROOT, "configs", "llama1b.py"),
                "--devices",
                "1",
                "--config.mesh.fsdp=1",
                "--config.data.seq_len=524288",
                "--config.model.remat=attention",
                "--device",
                "h100-nvlink",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "does not fit; with model.remat='offload'" in out and "in host memory" in out


def test_the_planner_plans_auto_as_the_compiles_chose():
    """model.remat='auto' planned by the estimates, against the GPU pool JAX makes (58.3 GiB of
    an H100) or a v5p chip's HBM: LLaMA-3.2-1B as `plan --compile` chose by compiling it
    (2026-11-28): 'none' at 8K on an H100 (XLA 30.39 GiB), 'attention' at 32K (none: 62.37),
    'none' at 32K on a v5p chip (73.57 of 95)."""

    def planned(seq_len, device):
        config = load_config(os.path.join(ROOT, "configs", "llama1b.py"))
        config.data.seq_len = seq_len
        return estimate(config, 1, device).remat

    assert planned(8192, "h100-nvlink") == "none"
    assert planned(32768, "h100-nvlink") == "attention"
    assert planned(32768, "tpu-v5p") == "none"
    config = load_config(os.path.join(ROOT, "configs", "llama1b.py"))
    assert estimate(config, 1).remat == "attention"  # no device: the fallback

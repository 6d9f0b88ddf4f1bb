"""The documented path from HuggingFace weights to training: `lclm.convert --from-hf H
--to-checkpoint W`, then `train.py --config configs/demo.py --config.workdir=W`. The converted
step 0 holds weights, not a training config: the run's own data, sequence length and schedule
apply, its tokenizer is compared by content, and only a model the weights do not fit (another
shape) is refused, in one line."""

import json
import os
import shutil
import subprocess
import sys

import jax
import pytest
from support import DEMO_CONFIG, DEMO_TOKENIZER, ROOT

from lclm import convert, hf
from lclm.config import MESH_AXES, AttentionConfig, ModelConfig, load_config
from lclm.config.run_config import run_config
from lclm.data.loader import HostBatches
from lclm.data.tokenizer import Tokenizer
from lclm.models.decoder import init_params, loss_terms
from lclm.parallel import make_mesh

pytestmark = pytest.mark.slow  # trains a model in a subprocess


def _hf_dir(path, **changes):
    """A HuggingFace LLaMA directory with configs/demo.py's model (shapes `changes`d) and a
    copy of the demo tokenizer; returns (its path, its parameters)."""
    fields = dict(load_config(DEMO_CONFIG).model) | changes
    model = ModelConfig.from_config(fields)
    params = init_params(model, jax.random.key(7))  # not what the run's own init would give
    hf.save(str(path), model, params)
    shutil.copy(DEMO_TOKENIZER, path / "tokenizer.model")
    return str(path), params


def _train(workdir, *overrides):
    env = dict(os.environ, JAX_PLATFORMS="cpu", WANDB_MODE="disabled")
    env.pop("XLA_FLAGS", None)  # train.py simulates the 8 devices configs/demo.py needs
    return subprocess.run(
        [
            sys.executable,
            "train.py",
            "--config",
            "configs/demo.py",
            f"--config.workdir={workdir}",
            "--config.train.steps=1",
            "--config.log.every=1",
            "--config.log.progress=False",
            *overrides,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def _first_batch_loss(params) -> float:
    """configs/demo.py's loss on its first batch with `params`, on the demo's mesh."""
    config = load_config(DEMO_CONFIG)
    mesh = make_mesh(**{a: config.mesh[a] for a in MESH_AXES})
    loader = HostBatches(run_config(config), mesh, Tokenizer(config.data.tokenizer))
    batch = next(loader)
    loader.close()
    model = ModelConfig.from_config(config.model)
    attention = AttentionConfig.from_config(config.attention)
    total, count = jax.jit(lambda p: loss_terms(model, p, batch, mesh=mesh, attention=attention))(
        params
    )
    return float(total / count)


def test_the_documented_convert_then_train_path_trains_the_converted_weights(tmp_path):
    hf_dir, params = _hf_dir(tmp_path / "hf")
    workdir = str(tmp_path / "W2")
    assert convert.main(["--from-hf", hf_dir, "--to-checkpoint", workdir]) == 0
    # the converted config says 2048 tokens, no data path and the HF directory's tokenizer
    # file; the demo's are 512 tokens, its corpus and the same tokenizer at another path
    r = _train(workdir)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"starting from the weights converted from {hf_dir} (step 0)" in r.stderr
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        (record,) = [json.loads(line) for line in f]
    # step 1's loss is the converted weights' loss on the demo's first batch
    assert record["step"] == 1
    assert record["loss"] == pytest.approx(_first_batch_loss(params), rel=1e-4)
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["0", "1"]


def test_converted_weights_of_another_shape_are_refused_in_one_line(tmp_path):
    hf_dir, _ = _hf_dir(tmp_path / "hf", dim=64, ffn_dim=192)
    workdir = str(tmp_path / "W2")
    assert convert.main(["--from-hf", hf_dir, "--to-checkpoint", workdir]) == 0
    r = _train(workdir)
    assert r.returncode == 2, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"error: the checkpoint (step 0) holds the weights converted from "
        f"{hf_dir}, which the config does not describe: model.dim 64 -> "
        "128; model.ffn_dim 192 -> 384; "
    ), last
    assert "Traceback" not in r.stderr
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["0"]

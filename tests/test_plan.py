"""The memory planner: parameter bytes per device match the real sharded arrays."""

import os

import jax
import pytest

from lclm.config import load_config
from lclm.models.llama import LlamaConfig
from lclm.parallel import make_mesh
from lclm.plan import estimate, main
from lclm.train.loop import init_state
from lclm.train.step import make_optimizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("mesh", [dict(fsdp=2, sp=4), dict(tp=2, sp=4), dict(dp=2, fsdp=4)])
def test_parameter_and_optimizer_bytes_match_the_sharded_state(mesh):
    config = load_config(os.path.join(ROOT, "configs", "demo.py"))
    config.mesh.update(dict(dp=1, fsdp=1, tp=1, sp=1) | mesh)
    plan = estimate(config, 8)
    model = LlamaConfig.from_config(config.model)
    state = init_state(model, make_optimizer(config.train), make_mesh(**mesh), seed=0)
    on_device0 = lambda tree: sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree)
                                  if x.ndim > 0)
    assert plan.params == pytest.approx(on_device0(state.params), rel=1e-6)
    assert plan.optimizer == pytest.approx(on_device0(state.opt_state), rel=1e-6)
    assert plan.tokens_per_step == config.data.batch_size * config.data.seq_len


def test_plan_cli(capsys):
    assert main(["--config", os.path.join(ROOT, "configs", "llama7b_256k.py"), "--devices", "32",
                 "--device", "tpu-v4"]) == 0
    out = capsys.readouterr().out
    assert "32,768" in out and "1,048,576" in out
    assert "the ring overlaps" in out and "tpu-v4 memory" in out
    assert main(["--config", os.path.join(ROOT, "configs", "llama7b_256k.py")]) == 2

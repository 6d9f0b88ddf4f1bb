"""model.remat='auto' (lclm.train.remat_choice): the first policy of none, attention, full,
offload whose compiled train step fits the device's budget, compiled once."""

import dataclasses
import logging

import jax
import pytest
from support import small_train_config

from lclm.config.run_config import run_config
from lclm.data.loader import abstract_batch, batch_sharding
from lclm.errors import ConfigError
from lclm.parallel.mesh import make_mesh
from lclm.train.loop import train
from lclm.train.remat_choice import AUTO_ORDER, choose, compiled_bytes
from lclm.train.step import jit_train_step, make_optimizer
from lclm.workdir.state import init_state, state_shardings


def _compiler(tmp_path):
    """policy -> the run's train step compiled with it on one CPU device (real compiles of a
    step whose saved activations outweigh its weights: 8 layers of width 64, 2 x 2,048
    tokens; on XLA:CPU 134, 40 and 32 MiB under none, attention and full)."""
    config = small_train_config(tmp_path / "run", mesh=dict(fsdp=1, sp=1), attention={})
    config.data.update(seq_len=2048, batch_size=2)
    config.model.update(ffn_chunk=256, loss_chunk=256, n_layers=8)
    run = run_config(config)
    model, mesh = run.model.resolved(), make_mesh(devices=jax.devices()[:1])
    optimizer = make_optimizer(run.train)
    state = init_state(model, optimizer, mesh, 0)
    batch = abstract_batch(run.data.batch_size, run.data.seq_len, batch_sharding(mesh))

    def compile_policy(policy: str):
        m = dataclasses.replace(model, remat=policy)
        step = jit_train_step(
            m, run.attention, run.train, mesh, optimizer, state_shardings(m, optimizer, mesh)
        )
        compiled = step.lower(state, batch).compile()
        return compiled, compiled_bytes(compiled)

    return compile_policy


@pytest.mark.slow  # compiles the step under each policy: about 50 s on 2 cores
def test_auto_takes_the_first_policy_that_fits_and_names_the_fix_when_none_does(tmp_path):
    compile_policy = _compiler(tmp_path)
    need = {p: compile_policy(p)[1] for p in ("none", "attention", "full")}
    # what each keeps: everything > the attention's output and layer inputs > layer inputs
    assert need["none"] > need["attention"] > need["full"]
    assert choose(compile_policy, None).policy == "none"
    assert choose(compile_policy, need["none"]).policy == "none"
    chosen = choose(compile_policy, need["none"] - 1)
    assert chosen.policy == "attention" and chosen.needed == {
        p: need[p] for p in ("none", "attention")
    }
    assert chosen.line().startswith("model.remat='auto' -> 'attention': ")
    assert f"(none needs {need['none'] / 2**30:.2f} GiB)" in chosen.line()
    assert choose(compile_policy, need["attention"] - 1).policy == "full"


def test_no_policy_fits_is_one_line_naming_the_fixes():
    tried = []

    def refuse(policy):  # as XLA:TPU refuses a program over HBM
        tried.append(policy)
        raise RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm")

    with pytest.raises(
        ConfigError,
        match=r"^model.remat='auto': no remat policy fits .*"
        r"none needs more than the device has .*shard more \(mesh.fsdp",
    ):
        choose(refuse, 2**30)
    assert tried == list(AUTO_ORDER)
    # a compile error that is not about memory is the run's error, not a reason to go on
    with pytest.raises(ValueError, match="bad kernel"):
        choose(lambda p: (_ for _ in ()).throw(ValueError("bad kernel")), 2**30)
    # a backend that reports no memory: the first policy is taken
    assert choose(lambda p: (object(), None), 2**30).policy == "none"


def test_a_run_with_auto_compiles_its_step_once_and_logs_the_choice(tmp_path, caplog):
    config = small_train_config(tmp_path / "run", mesh=dict(fsdp=1, sp=1), attention={})
    config.model.remat = "auto"
    config.train.steps = 2
    jax.config.update("jax_log_compiles", True)
    try:
        with caplog.at_level(logging.INFO):
            records = train(config)
    finally:
        jax.config.update("jax_log_compiles", False)
    assert [r["step"] for r in records] == [1, 2]
    steps = [r for r in caplog.records if r.getMessage().startswith("Compiling jit(step)")]
    assert len(steps) == 1  # the candidate's compiled program is the one the steps run
    assert any(r.getMessage().startswith("model.remat='auto' -> 'none': ") for r in caplog.records)

"""Layout-free checkpoints: restore on another mesh/layout/scan setting, bad checkpoints."""

import glob
import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from support import small_train_config

from lclm.config import MESH_AXES, AttentionConfig, ModelConfig
from lclm.config.run_config import run_config
from lclm.data.loader import HostBatches
from lclm.data.tokenizer import Tokenizer
from lclm.models.decoder import loss_terms
from lclm.ops.layout import batch_to_layout, from_layout
from lclm.parallel import make_mesh
from lclm.train.loop import train
from lclm.train.step import make_optimizer
from lclm.workdir.checkpoint import Checkpoints
from lclm.workdir.state import init_state

pytestmark = pytest.mark.slow  # trains models or starts processes: left out by -m 'not slow'


def _config(workdir, **mesh):
    return small_train_config(
        workdir, mesh=dict(dp=1, fsdp=2, tp=1, sp=4) | mesh, attention=dict(q_chunk=8, kv_chunk=8)
    )


def _restore(config):
    sizes = {k: config.mesh[k] for k in MESH_AXES}
    mesh = make_mesh(**sizes)
    model = ModelConfig.from_config(config.model)
    template = init_state(model, make_optimizer(run_config(config).train), mesh, seed=99)
    state, data = Checkpoints(config.workdir, keep=3).restore(template)
    return mesh, model, state, data


def _loss(config, mesh, model, params, batch):
    layout, sp = config.attention.layout, mesh.shape["sp"]
    attn = AttentionConfig.from_config(config.attention)
    b = batch_to_layout({k: jnp.asarray(v) for k, v in batch.items()}, layout, sp)
    t, c = jax.jit(lambda p: loss_terms(model, p, b, mesh=mesh, attention=attn))(params)
    return float(t / c)


def test_checkpoint_restores_on_another_mesh_layout_and_scan_setting(tmp_path):
    config = _config(tmp_path / "run")
    train(config)
    # a fixed batch in original order
    loader = HostBatches(
        run_config(config), make_mesh(fsdp=2, sp=4), Tokenizer(config.data.tokenizer)
    )
    batch = {k: from_layout(np.asarray(v), "striped", 4) for k, v in next(loader).items()}
    loader.close()
    mesh, model, state, data = _restore(config)
    assert int(state.step) == 4 and data[0]["batches"] == 4
    want = _loss(config, mesh, model, state.params, batch)

    other = _config(tmp_path / "run", sp=2, tp=2, fsdp=1)
    other.attention.layout = "contiguous"
    other.model.scan_layers = False
    mesh2, model2, state2, _ = _restore(other)
    assert dict(state2.params["layers"]["wq"].sharding.mesh.shape) == dict(dp=1, fsdp=1, tp=2, sp=2)
    assert _loss(other, mesh2, model2, state2.params, batch) == pytest.approx(want, rel=1e-5)
    # the optimizer state came along too
    for a, b in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(state2.opt_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    zigzag = _config(tmp_path / "run", sp=4, fsdp=2)
    zigzag.attention.layout = "zigzag"
    mesh3, model3, state3, _ = _restore(zigzag)
    assert _loss(zigzag, mesh3, model3, state3.params, batch) == pytest.approx(want, rel=1e-5)


def test_shape_mismatch_names_the_parameter_and_corrupt_latest_falls_back(tmp_path, caplog):
    config = _config(tmp_path / "run")
    train(config)
    wrong = _config(tmp_path / "run")
    wrong.model.ffn_dim = 96
    with pytest.raises(ValueError, match=r"parameter \['layers'\]\['w_down'\] has shape"):
        _restore(wrong)
    tied = _config(tmp_path / "run")  # one parameter fewer: a changed config, not damage
    tied.model.tie_embeddings = True
    with pytest.raises(ValueError, match=r"has parameter \['lm_head'\] that the model does not"):
        _restore(tied)
    assert not os.path.exists(tmp_path / "run" / "checkpoints_damaged")
    # damage step 4's array data: step 2 is used, and the damage is reported
    for f in glob.glob(
        str(tmp_path / "run" / "checkpoints" / "4" / "state" / "**" / "*"), recursive=True
    ):
        if os.path.isfile(f) and "ocdbt.process_0" in f:
            with open(f, "wb") as fh:
                fh.write(b"garbage")
    with caplog.at_level(logging.ERROR):
        _, _, state, data = _restore(config)
    assert int(state.step) == 2 and data[0]["batches"] == 2
    assert "checkpoint step 4" in caplog.text


def _step_bytes(workdir, step):
    return sum(
        os.path.getsize(f)
        for f in glob.glob(
            str(workdir / "checkpoints" / str(step) / "state" / "**" / "*"), recursive=True
        )
        if os.path.isfile(f)
    )


def test_a_step_in_orbaxs_default_format_restores_and_new_steps_are_uncompressed(tmp_path):
    """Steps saved before lclm chose its array format (Orbax's default, zarr2 chunks compressed
    with zstd, through the StandardCheckpointHandler lclm used) still resume; a new step is
    zarr3, uncompressed (never smaller than the arrays), and restores equal too."""
    workdir = tmp_path / "run"
    config = _config(workdir)
    mesh = make_mesh(fsdp=2, sp=4)
    model = ModelConfig.from_config(config.model)
    optimizer = make_optimizer(run_config(config).train)
    state = init_state(model, optimizer, mesh, seed=0)
    # moments that are not all zeros (zeros compress to nothing either way)
    state = state._replace(
        opt_state=jax.tree.map(
            lambda x: x + 1e-3 if jnp.issubdtype(x.dtype, jnp.floating) else x, state.opt_state
        )
    )
    item = {"step": state.step, "params": state.params, "opt_state": state.opt_state}
    earlier = ocp.CheckpointManager(
        str(workdir / "checkpoints"),
        item_handlers={
            "state": ocp.StandardCheckpointHandler(),
            "data": ocp.JsonCheckpointHandler(),
            "config": ocp.JsonCheckpointHandler(),
        },
    )
    earlier.save(
        1,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(item),
            data=ocp.args.JsonSave({"processes": [{"n": 1}]}),
            config=ocp.args.JsonSave({}),
        ),
    )
    earlier.close()
    nbytes = sum(x.nbytes for x in jax.tree.leaves(item))
    assert _step_bytes(workdir, 1) < 0.95 * nbytes  # compressed

    def same(a, b):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    template = init_state(model, optimizer, mesh, seed=99)
    ckpt = Checkpoints(str(workdir), keep=3)
    restored, data = ckpt.restore(template)
    same(restored, state)
    assert data == [{"n": 1}]
    ckpt.save(2, restored, {"n": 2}, {})
    ckpt.close()
    with open(workdir / "checkpoints" / "2" / "state" / "_METADATA") as f:
        assert json.load(f)["use_zarr3"] is True
    assert _step_bytes(workdir, 2) >= nbytes
    restored, data = Checkpoints(str(workdir), keep=3).restore(template)
    same(restored, state)
    assert data == [{"n": 2}]

"""The compiled train step reshards nothing by full replication: XLA's SPMD partitioner warns
"Involuntary full rematerialization" when a sharding change can only be done by replicating
a whole tensor on every device (memory and time that grow with the model and the sequence)."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from support import DEMO_CONFIG

from lclm.config import MESH_AXES, AttentionConfig, ModelConfig, apply_preset, load_config
from lclm.config.run_config import run_config
from lclm.data.loader import batch_sharding
from lclm.parallel import make_mesh
from lclm.train.step import make_optimizer, make_train_step
from lclm.workdir.state import init_state, state_shardings


def _demo(c):
    return c


def _llama7b(c):
    apply_preset(c, "llama2_7b")
    c.model.update(dtype="bfloat16", ffn_chunk=1024, loss_chunk=1024)
    c.attention.update(q_chunk=512, kv_chunk=512)
    c.data.update(seq_len=4096, batch_size=2)
    c.mesh.update(dp=1, fsdp=2, tp=2, sp=2)
    return c


@pytest.mark.parametrize("shape", [_demo, _llama7b], ids=["demo", "llama7b"])
def test_the_train_step_compiles_without_full_rematerialization(shape, capfd):
    c = shape(load_config(DEMO_CONFIG))
    mesh = make_mesh(**{k: c.mesh[k] for k in MESH_AXES})
    model = ModelConfig.from_config(c.model)
    optimizer = make_optimizer(run_config(c).train)
    where = state_shardings(model, optimizer, mesh)
    shapes = jax.eval_shape(lambda: init_state(model, optimizer, mesh, 0))
    state = jax.tree.map(
        lambda s, w: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=w), shapes, where
    )  # abstract: a 7B model needs no memory to compile
    rows = batch_sharding(mesh)
    batch = {
        k: jax.ShapeDtypeStruct(
            (c.data.batch_size, c.data.seq_len),
            jnp.float32 if k == "loss_mask" else jnp.int32,
            sharding=rows,
        )
        for k in ("tokens", "targets", "loss_mask", "positions", "segment_ids")
    }
    step = jax.jit(
        make_train_step(
            model, AttentionConfig.from_config(c.attention), run_config(c).train, mesh, optimizer
        ),
        in_shardings=(where, rows),
        out_shardings=(where, NamedSharding(mesh, PartitionSpec())),
    )
    capfd.readouterr()
    step.lower(state, batch).compile()
    assert "Involuntary full rematerialization" not in capfd.readouterr().err

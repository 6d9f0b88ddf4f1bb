"""Child process of test_simulated_meshes.py: runs two real train steps of the case named on
the command line (`mesh:layout:chunk`, e.g. `sp4:striped:64`, `dp2fsdp2sp2:zigzag:32`) on as
many simulated CPU devices as the mesh has, set up as train.py sets them up, and prints the
loss.

A separate process because a deadlock of simulated devices ends the process (XLA aborts a
collective that waits longer than its timeout); the parent sets that timeout short."""

import math
import re
import sys

from lclm.config.run_config import run_config
from lclm.parallel.devices import request_cpu_devices

CASE = sys.argv[1]
SIZES = {axis: int(n) for axis, n in re.findall(r"([a-z]+)(\d+)", CASE.split(":")[0])}
request_cpu_devices(math.prod(SIZES.values()))  # XLA's worker pool depends on the count

import jax  # noqa: E402  (after the XLA flags)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from lclm.config import (  # noqa: E402
    AttentionConfig,
    ModelConfig,
    base_config,  # noqa: E402
)
from lclm.data.loader import batch_sharding  # noqa: E402
from lclm.ops.layout import batch_to_layout  # noqa: E402
from lclm.parallel import make_mesh  # noqa: E402
from lclm.train.step import make_optimizer, make_train_step  # noqa: E402
from lclm.workdir.state import init_state  # noqa: E402

SEQ, BATCH = 1024, 8


def run(case: str) -> float:
    _, layout, chunk = case.split(":")
    mesh = make_mesh(**SIZES)
    c = base_config()
    # the shapes of the reported deadlock: configs/demo.py's model in float32, 1024 tokens
    c.model.update(
        vocab_size=512,
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=384,
        dtype="float32",
        ffn_chunk=int(chunk),
        loss_chunk=int(chunk),
    )
    c.attention.update(layout=layout, q_chunk=int(chunk), kv_chunk=int(chunk))
    model = ModelConfig.from_config(c.model)
    optimizer = make_optimizer(run_config(c).train)
    state = init_state(model, optimizer, mesh, 0)
    where = jax.tree.map(lambda x: x.sharding, state)
    rows = batch_sharding(mesh)
    step = jax.jit(
        make_train_step(
            model, AttentionConfig.from_config(c.attention), run_config(c).train, mesh, optimizer
        ),
        in_shardings=(where, rows),
        out_shardings=(where, NamedSharding(mesh, PartitionSpec())),
        donate_argnums=0,
    )
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model.vocab_size, (BATCH, SEQ + 1)).astype(np.int32)
    batch = dict(
        tokens=tokens[:, :-1],
        targets=tokens[:, 1:],
        loss_mask=np.ones((BATCH, SEQ), np.float32),
        positions=np.broadcast_to(np.arange(SEQ, dtype=np.int32), (BATCH, SEQ)),
        segment_ids=np.zeros((BATCH, SEQ), np.int32),
    )
    batch = batch_to_layout({k: jnp.asarray(v) for k, v in batch.items()}, layout, mesh.shape["sp"])
    batch = jax.device_put(batch, rows)
    for _ in range(2):
        state, metrics = step(state, batch)
    return float(metrics["loss"])


if __name__ == "__main__":
    print(f"{CASE} loss {run(CASE):.6f}", flush=True)

"""Train state: parameters and optimizer state, placed on the mesh by the logical rules."""

from __future__ import annotations

from typing import NamedTuple

import jax
import optax

from lclm.models.llama import LlamaConfig, is_param_entry, param_table
from lclm.parallel.mesh import logical_sharding


def param_shardings(c: LlamaConfig, mesh):
    """NamedSharding per parameter (canonical layout) under `AXIS_RULES`."""
    return jax.tree.map(lambda e: logical_sharding(mesh, e[1], e[0]), param_table(c),
                        is_leaf=is_param_entry)


def shard_params(c: LlamaConfig, params, mesh):
    """Place `params` on `mesh` with the parameter shardings."""
    return jax.device_put(params, param_shardings(c, mesh))


class TrainState(NamedTuple):
    """Everything a step updates. `step` counts completed updates."""
    step: jax.Array
    params: dict
    opt_state: optax.OptState

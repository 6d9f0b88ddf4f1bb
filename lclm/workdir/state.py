"""Train state: parameters and optimizer state, placed on the mesh by the logical rules."""

from __future__ import annotations

from typing import Generic, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from lclm.config import ModelConfig
from lclm.models.decoder import init_params, is_param_entry, param_table
from lclm.parallel.mesh import logical_sharding


def param_shardings(c: ModelConfig, mesh):
    """NamedSharding per parameter (canonical layout) under `AXIS_RULES`."""
    return jax.tree.map(
        lambda e: logical_sharding(mesh, e[1], e[0]), param_table(c), is_leaf=is_param_entry
    )


def shard_params(c: ModelConfig, params, mesh):
    """Place `params` on `mesh` with the parameter shardings."""
    return jax.device_put(params, param_shardings(c, mesh))


_Step = TypeVar("_Step")


class TrainState(NamedTuple, Generic[_Step]):
    """Everything a step updates. `step` counts completed updates. `state_shardings` gives
    the same tree with each array's sharding in its place (`TrainState[NamedSharding]`)."""

    step: _Step
    params: dict
    opt_state: optax.OptState


def state_shardings(model: ModelConfig, optimizer, mesh) -> TrainState[NamedSharding]:
    """Where every array of the train state lives: parameters by the logical rules, optimizer
    moments exactly like their parameters (left to propagation, XLA replicated them), counts
    and other scalars replicated."""
    shardings = param_shardings(model, mesh)
    replicated = NamedSharding(mesh, PartitionSpec())
    params = jax.eval_shape(lambda: init_params(model, jax.random.key(0)))
    opt_shardings = optax.tree_utils.tree_map_params(
        optimizer,
        lambda _, sharding: sharding,
        jax.eval_shape(optimizer.init, params),
        shardings,
        transform_non_params=lambda _: replicated,
    )
    return TrainState(replicated, shardings, opt_shardings)


def init_state(model: ModelConfig, optimizer, mesh, seed: int) -> TrainState[jax.Array]:
    """Fresh parameters and optimizer state, created directly in their shardings."""
    where = state_shardings(model, optimizer, mesh)
    params = jax.jit(lambda k: init_params(model, k), out_shardings=where.params)(
        jax.random.key(seed)
    )
    opt_state = jax.jit(optimizer.init, out_shardings=where.opt_state)(params)
    return TrainState(jax.device_put(jnp.zeros((), jnp.int32), where.step), params, opt_state)

"""The optimizer and the jitted train step (gradient accumulation, global token-mean loss,
non-finite steps skipped)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from lclm.config import AttentionConfig, ModelConfig
from lclm.config.schema import Train
from lclm.data.loader import batch_sharding
from lclm.models.decoder import BIASES, loss_terms
from lclm.parallel.mesh import logical_sharding
from lclm.workdir.state import TrainState


def lr_schedule(train: Train) -> optax.Schedule:
    """The learning rate of the update after `count` applied ones: linear warmup reaching
    `lr` at update `warmup`, then `decay` ('cosine' or 'linear' to `lr * min_lr_ratio` at
    update `steps`, or 'constant' at `lr`). The first update already gets `lr / warmup` (a
    warmup from 0 would waste step 1)."""
    t = train
    decay_steps = max(t.steps, t.warmup + 1) - t.warmup
    end = t.lr * t.min_lr_ratio
    warm = optax.linear_schedule(0.0, t.lr, t.warmup) if t.warmup else optax.constant_schedule(t.lr)
    after = {
        "cosine": lambda: optax.cosine_decay_schedule(t.lr, decay_steps, alpha=t.min_lr_ratio),
        "linear": lambda: optax.linear_schedule(t.lr, end, decay_steps),
        "constant": lambda: optax.constant_schedule(t.lr),
    }[t.decay]()
    base = optax.join_schedules([warm, after], [t.warmup])
    return lambda count: base(count + 1)


def _is_schedule(x) -> bool:
    """Whether `x` is the state of the optimizer's learning-rate schedule (its count)."""
    return isinstance(x, optax.ScaleByScheduleState)


def applied_updates(opt_state) -> jax.Array:
    """How many updates the optimizer has applied (skipped steps are not counted): the count
    its learning-rate schedule is evaluated at."""
    (state,) = [x for x in jax.tree.leaves(opt_state, is_leaf=_is_schedule) if _is_schedule(x)]
    return state.count


def restart_schedule(opt_state):
    """`opt_state` with its learning-rate schedule's count at 0 (a new stage's schedule
    starts from its warm-up; Adam's own count, its bias correction, is left as it is)."""
    return jax.tree.map(
        lambda x: x._replace(count=jnp.zeros_like(x.count)) if _is_schedule(x) else x,
        opt_state,
        is_leaf=_is_schedule,
    )


def make_optimizer(train: Train) -> optax.GradientTransformation:
    """AdamW (no decay on norm weights or biases, as transformers' Trainer) after global-norm
    clipping."""
    t = train
    decays = lambda path, _: (
        "norm" not in jax.tree_util.keystr(path) and getattr(path[-1], "key", None) not in BIASES
    )
    decay_mask = lambda params: jax.tree_util.tree_map_with_path(decays, params)
    return optax.chain(
        optax.clip_by_global_norm(t.clip) if t.clip > 0 else optax.identity(),
        optax.adamw(lr_schedule(t), b1=t.b1, b2=t.b2, weight_decay=t.weight_decay, mask=decay_mask),
    )


def _micro_batches(batch, accum: int, mesh):
    """`[batch, seq]` -> `[accum, batch/accum, seq]`, rows i*accum + a in micro-batch a, so
    every micro-batch is spread over all data-parallel devices without moving data."""

    def split(x):
        b = x.shape[0]
        y = x.reshape((b // accum, accum) + x.shape[1:]).swapaxes(0, 1)
        return lax.with_sharding_constraint(
            y, logical_sharding(mesh, (None, "batch", "seq"), y.shape)
        )

    return jax.tree.map(split, batch)


def make_train_step(
    model: ModelConfig,
    attention: AttentionConfig,
    train: Train,
    mesh,
    optimizer: optax.GradientTransformation,
    document_mask: bool = True,
):
    """`step(state, batch) -> (state, metrics)`, not yet jitted.

    The loss of the step is the mean over every unmasked target token of the global batch
    (all micro-batches, all devices) under the parameters before the update. A step whose
    loss or gradient norm is not finite leaves params and optimizer state unchanged (the
    step counter still advances: its batch is consumed) and reports `skipped=1`.
    """
    accum = train.grad_accum
    schedule = lr_schedule(train)
    terms = functools.partial(
        loss_terms, model, mesh=mesh, attention=attention, document_mask=document_mask
    )

    def step(state: TrainState, batch):
        def micro(carry, mb):
            grads, total, count = carry
            (t, c), g = jax.value_and_grad(terms, has_aux=True)(state.params, mb)
            return (jax.tree.map(jnp.add, grads, g), total + t, count + c), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
        init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
        (grads, total, count), _ = lax.scan(micro, init, _micro_batches(batch, accum, mesh))
        count = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g, p: (g / count).astype(p.dtype), grads, state.params)
        loss, grad_norm = total / count, optax.tree_utils.tree_norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        # an elementwise select, fused into the update: no conditional, so no device-to-host
        # round trip on GPUs, and nothing of a NaN step reaches params or moments
        keep = lambda new, old: jnp.where(finite, new, old)
        params = jax.tree.map(keep, params, state.params)
        opt_state = jax.tree.map(keep, opt_state, state.opt_state)
        metrics = dict(
            loss=loss,
            grad_norm=grad_norm,
            tokens=count,
            lr=schedule(applied_updates(state.opt_state)),  # what this update used
            skipped=(~finite).astype(jnp.int32),
        )
        return TrainState(state.step + 1, params, opt_state), metrics

    return step


def jit_train_step(
    model: ModelConfig,
    attention: AttentionConfig,
    train: Train,
    mesh,
    optimizer: optax.GradientTransformation,
    state_sharding,
    document_mask: bool = True,
):
    """The step train.py runs, jitted: `step(state, batch) -> (state, metrics)` with the state
    in `state_sharding` (donated, updated in place), batch rows as the loader shards them and
    replicated metrics. `lclm.plan.aot` compiles this very function for a TPU slice."""
    return jax.jit(
        make_train_step(model, attention, train, mesh, optimizer, document_mask=document_mask),
        in_shardings=(state_sharding, batch_sharding(mesh)),
        out_shardings=(state_sharding, NamedSharding(mesh, PartitionSpec())),
        donate_argnums=0,
    )


def jit_eval_loss(
    model: ModelConfig, attention: AttentionConfig, mesh, param_sharding, document_mask: bool = True
):
    """`eval_loss(params, batch) -> (sum of token losses, token count)` of one batch, jitted
    (no gradients), with replicated float32 scalars."""
    terms = functools.partial(
        loss_terms, model, mesh=mesh, attention=attention, document_mask=document_mask
    )
    return jax.jit(
        terms,
        in_shardings=(param_sharding, batch_sharding(mesh)),
        out_shardings=NamedSharding(mesh, PartitionSpec()),
    )


def all_finite(tree) -> jax.Array:
    """Whether every floating-point leaf of `tree` is finite (a scalar bool on device)."""
    leaves = [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(x.dtype, jnp.floating)
    ]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)

"""The training loop: composes config, mesh, data, model, optimizer and metric sinks."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import signal
import threading
import time

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from lclm.checkpoint import Checkpoints, read_params
from lclm.config import ConfigError, validate
from lclm.data.loader import HostBatches, batch_sharding
from lclm.data.tokenizer import Tokenizer
from lclm.models.llama import AttentionConfig, LlamaConfig, init_params
from lclm.parallel.distributed import any_process, check_same_config
from lclm.parallel.mesh import make_mesh
from lclm.train.metrics import MetricsLogger, Progress, flops_per_token, peak_flops
from lclm.train.state import TrainState, param_shardings
from lclm.train.step import make_optimizer, make_train_step

log = logging.getLogger(__name__)

# field names that hold secrets: key, api_key, wandb_api_key, hf_token, secret, password...
_SECRET = re.compile(r"(^|_)(key|token|secret|password)$")


def public_config(config) -> dict:
    """The config as a plain dict with every secret-named field removed."""
    def clean(d):
        return {k: clean(v) if isinstance(v, dict) else v for k, v in d.items()
                if not _SECRET.search(k.lower())}
    return clean(config.to_dict())


def _wandb_run(config):
    if not config.log.wandb or jax.process_index() != 0:
        return None
    import wandb  # optional at run time: only when asked for
    mode = os.environ.get("WANDB_MODE", config.log.wandb_mode)  # the environment wins
    return wandb.init(project=config.log.wandb_project, mode=mode,
                      dir=config.workdir, config=public_config(config))


def init_state(model: LlamaConfig, optimizer, mesh, seed: int) -> TrainState:
    """Fresh parameters and optimizer state, created directly in their shardings."""
    shardings = param_shardings(model, mesh)
    params = jax.jit(lambda k: init_params(model, k), out_shardings=shardings)(
        jax.random.key(seed))
    replicated = NamedSharding(mesh, PartitionSpec())
    # moments are sharded exactly like their parameters (left to propagation, XLA replicated
    # them); counts and other scalars are replicated
    opt_shardings = optax.tree_utils.tree_map_params(
        optimizer, lambda _, sharding: sharding, jax.eval_shape(optimizer.init, params),
        shardings, transform_non_params=lambda _: replicated)
    opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(params)
    return TrainState(jax.device_put(jnp.zeros((), jnp.int32), replicated), params, opt_state)


def apply_hf_shapes(config) -> None:
    """Take the model shape fields of `config.model` from `init_from_hf`'s config.json."""
    from lclm import hf
    path = os.path.join(config.model.init_from_hf, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model.init_from_hf={config.model.init_from_hf!r} has no "
                                "config.json; point it at a HuggingFace LLaMA directory")
    with open(path) as f:
        config.model.update(hf.model_fields(hf.config_from_hf(json.load(f))))


def load_hf_params(config, model: LlamaConfig, mesh):
    """`init_from_hf` weights in the run's param dtype and shardings."""
    from lclm import hf
    _, params = hf.load(config.model.init_from_hf)
    dtype = jnp.dtype(model.param_dtype)
    params = jax.tree.map(lambda x: x.astype(dtype), params)
    log.info("initialised from %s (rope_theta %g)", config.model.init_from_hf, model.rope_theta)
    return jax.device_put(params, param_shardings(model, mesh))


def load_checkpoint_params(config, template: TrainState):
    """The latest parameters of the lclm run in `init_from_checkpoint`, placed like
    `template.params` (its optimizer state is not read)."""
    source = config.model.init_from_checkpoint
    checkpoints = Checkpoints(source, every=0, keep=1)
    try:
        step = checkpoints.latest_step()
        if step is None:
            raise FileNotFoundError(f"model.init_from_checkpoint={source!r} has no checkpoint; "
                                    "point it at the workdir of a finished lclm run")
        checkpoints.check_shapes(step, template.params)
    finally:
        checkpoints.close()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            template.params)
    log.info("initialised from %s step %d", source, step)
    return read_params(source, step, abstract)


def train(config, stop_after: int | None = None) -> list[dict]:
    """Run (or resume) up to `config.train.steps` steps; returns the logged metric records.

    `stop_after` ends the run after that step as a crash would (steps since the last
    checkpoint are lost), leaving the schedule and the final step unchanged for the resume.
    """
    devices = jax.devices()
    if config.model.init_from_hf:
        apply_hf_shapes(config)
    sizes = validate(config, len(devices))
    if jax.process_count() > 1:
        used = math.prod(sizes.values())
        if used != len(devices):
            raise ConfigError(f"mesh {sizes} uses {used} of the {len(devices)} devices of "
                              f"{jax.process_count()} processes; with several processes the "
                              "mesh must use all devices (use -1 for one axis)")
        check_same_config(json.dumps(public_config(config), sort_keys=True))
    mesh = make_mesh(**sizes, devices=devices)
    model = LlamaConfig.from_config(config.model)
    attention = AttentionConfig.from_config(config.attention)
    tokenizer = Tokenizer(config.data.tokenizer)
    tokenizer.check_fits(model.vocab_size)
    is_main = jax.process_index() == 0
    if is_main:
        os.makedirs(config.workdir, exist_ok=True)
        with open(os.path.join(config.workdir, "config.json"), "w") as f:
            json.dump(public_config(config), f, indent=1)
    log.info("mesh %s on %d %s devices; model %.2fM params", sizes, len(devices),
             devices[0].platform, model.param_count() / 1e6)

    optimizer = make_optimizer(config.train)
    state = init_state(model, optimizer, mesh, config.seed)
    checkpoints = Checkpoints(config.workdir, config.checkpoint.every, config.checkpoint.keep)
    data_state = None
    if checkpoints.latest_step() is None:
        if config.model.init_from_checkpoint:
            state = state._replace(params=load_checkpoint_params(config, state))
        elif config.model.init_from_hf:
            state = state._replace(params=load_hf_params(config, model, mesh))
    else:
        state, data_state = checkpoints.restore(state)
        if int(state.step) >= config.train.steps:
            log.info("the checkpoint in %s is already at step %d of %d: nothing to train "
                     "(raise train.steps or use a new workdir)", config.workdir,
                     int(state.step), config.train.steps)
    state_sharding = jax.tree.map(lambda x: x.sharding, state)
    step_fn = jax.jit(
        make_train_step(model, attention, config.train, mesh, optimizer,
                        document_mask=config.data.document_mask),
        in_shardings=(state_sharding, batch_sharding(mesh)),
        out_shardings=(state_sharding, NamedSharding(mesh, PartitionSpec())), donate_argnums=0)
    batches = HostBatches(config, mesh, tokenizer, state=data_state)

    total = config.train.steps
    tokens_per_step = config.data.batch_size * config.data.seq_len
    flops = flops_per_token(model, config.data.seq_len) * tokens_per_step
    peak = peak_flops(devices[0].device_kind)
    logger = MetricsLogger(config.workdir, _wandb_run(config)) if is_main else None
    progress = Progress(total) if is_main and config.log.progress else None
    records = []
    first = int(state.step) + 1
    saved_config = public_config(config)
    preempted = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: preempted.set())
                for sig in (signal.SIGTERM, signal.SIGINT)
                if threading.current_thread() is threading.main_thread()}
    # Simulated CPU devices: one step in flight at a time. Overlapping multi-device CPU
    # programs were seen to stall XLA's in-process collective rendezvous on 2-core machines
    # (an abort after its 40 s timeout); real accelerators keep asynchronous dispatch.
    sync_each_step = devices[0].platform == "cpu"
    t0, since = time.perf_counter(), first - 1
    try:
        last = total if stop_after is None else min(total, stop_after)
        for step in range(first, last + 1):
            state, metrics = step_fn(state, next(batches))
            if sync_each_step:
                jax.block_until_ready(metrics)
            if any_process(preempted.is_set()):  # every process must join the save
                preempted.set()
            if checkpoints.due(step) or step == total or preempted.is_set():
                checkpoints.save(step, state, batches.state(), saved_config)
            if step % config.log.every and step not in (first, last) and not preempted.is_set():
                continue
            metrics = jax.device_get(metrics)
            now = time.perf_counter()
            seconds = (now - t0) / (step - since)
            record = dict(step=step, loss=float(metrics["loss"]), lr=float(metrics["lr"]),
                          grad_norm=float(metrics["grad_norm"]),
                          tokens_per_sec=tokens_per_step / seconds, step_time=seconds,
                          mfu=(flops / seconds / (peak * len(devices))) if peak else None)
            t0, since = now, step
            records.append(record)
            if logger:
                logger.log(record)
            if progress:
                progress.update(record, first)
            if preempted.is_set():
                log.warning("stopped after step %d on a termination signal (checkpoint saved)",
                            step)
                break
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        batches.close()
        checkpoints.close()
        if logger:
            logger.close()
    return records

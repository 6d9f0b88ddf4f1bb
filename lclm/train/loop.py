"""The training loop: composes config, mesh, data, model, optimizer and metric sinks."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import signal
import sys
import threading
import time
import uuid

import jax
import jax.numpy as jnp
import optax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from lclm.checkpoint import Checkpoints, SaveFailed, read_params
from lclm.config import ConfigError, validate
from lclm.errors import TrainingHalted
from lclm.data.loader import HostBatches, batch_sharding
from lclm.data.tokenizer import Tokenizer
from lclm.models.llama import AttentionConfig, LlamaConfig, init_params
from lclm.ops.attention import choose_kernel, platform_family
from lclm.ops.ring_attention import tile_run
from lclm.parallel.distributed import check_same_config
from lclm.parallel.mesh import make_mesh
from lclm.train.lock import WorkdirLock
from lclm.train.metrics import MetricsLogger, Progress, flops_per_token, peak_flops
from lclm.train.state import TrainState, param_shardings
from lclm.train.step import all_finite, make_optimizer, make_train_step

log = logging.getLogger(__name__)

# A field is secret when its name contains one of these words (case and separators aside):
# apikey, wandbApiKey, hf_token, secrets, passwd, credentials, auth_header... lclm's own
# fields that merely contain one of them are named in _NOT_SECRET (a test keeps it exact).
_SECRET_WORDS = ("key", "token", "secret", "password", "passwd", "credential", "auth")
_NOT_SECRET = frozenset({"tokenizer", "tokens_per_batch"})


def is_secret(name: str) -> bool:
    name = name.lower()
    return name not in _NOT_SECRET and any(w in name for w in _SECRET_WORDS)


def public_config(config) -> dict:
    """The config as a plain dict with every secret-named field removed (what config.json,
    checkpoints and wandb get)."""
    def clean(d):
        return {k: clean(v) if isinstance(v, dict) else v for k, v in d.items()
                if not is_secret(k)}
    return clean(config.to_dict())


def _wandb_run(config, resume_step: int):
    """The wandb run of this workdir: the same run id across resumes (`<workdir>/wandb_id`),
    so a resumed run continues its run instead of starting a second one."""
    if not config.log.wandb or jax.process_index() != 0:
        return None
    import wandb  # optional at run time: only when asked for
    mode = os.environ.get("WANDB_MODE", config.log.wandb_mode)  # the environment wins
    id_path = os.path.join(config.workdir, "wandb_id")
    if os.path.isfile(id_path):
        with open(id_path) as f:
            run_id = f.read().strip()
    else:
        run_id = uuid.uuid4().hex[:16]  # wandb ids: letters and digits
        with open(id_path, "w") as f:
            f.write(run_id)
    # wandb records the command line; not when an override on it names a secret
    secret_args = any(is_secret(a.split("=")[0].rsplit(".", 1)[-1].lstrip("-"))
                      for a in sys.argv[1:])
    settings = wandb.Settings(x_disable_meta=True) if secret_args else None
    if resume_step:
        log.info("wandb: resuming run %s after step %d (wandb keeps the values it already "
                 "has for re-run steps; metrics.jsonl holds the re-run ones)", run_id,
                 resume_step)
    return wandb.init(project=config.log.wandb_project, mode=mode, dir=config.workdir,
                      config=public_config(config), id=run_id, resume="allow",
                      settings=settings)


def state_shardings(model: LlamaConfig, optimizer, mesh) -> TrainState:
    """Where every array of the train state lives: parameters by the logical rules, optimizer
    moments exactly like their parameters (left to propagation, XLA replicated them), counts
    and other scalars replicated."""
    shardings = param_shardings(model, mesh)
    replicated = NamedSharding(mesh, PartitionSpec())
    params = jax.eval_shape(lambda: init_params(model, jax.random.key(0)))
    opt_shardings = optax.tree_utils.tree_map_params(
        optimizer, lambda _, sharding: sharding, jax.eval_shape(optimizer.init, params),
        shardings, transform_non_params=lambda _: replicated)
    return TrainState(replicated, shardings, opt_shardings)


def init_state(model: LlamaConfig, optimizer, mesh, seed: int) -> TrainState:
    """Fresh parameters and optimizer state, created directly in their shardings."""
    where = state_shardings(model, optimizer, mesh)
    params = jax.jit(lambda k: init_params(model, k), out_shardings=where.params)(
        jax.random.key(seed))
    opt_state = jax.jit(optimizer.init, out_shardings=where.opt_state)(params)
    return TrainState(jax.device_put(jnp.zeros((), jnp.int32), where.step), params, opt_state)


def apply_hf_shapes(config) -> None:
    """Take the fields of `config.model` that `init_from_hf`'s config.json determines: shapes,
    token ids, max positions and, where `model.rope_scaling` is 'auto', the RoPE scaling.
    `model.rope_theta` stays the run's (long-context recipes raise it)."""
    from lclm import hf
    source = hf.read_config(config.model.init_from_hf)
    config.model.update(hf.model_fields(dataclasses.asdict(source),
                                        rope_scaling=config.model.rope_scaling == "auto"))
    if source.rope_theta != config.model.rope_theta:
        log.info("model.rope_theta=%g replaces %s's rope_theta %g", config.model.rope_theta,
                 config.model.init_from_hf, source.rope_theta)


def apply_checkpoint_fields(config) -> None:
    """Take the fields of `config.model` that `init_from_checkpoint`'s saved config
    determines, as `apply_hf_shapes` does for HF weights: shapes, token ids, max positions
    and, where `model.rope_scaling` is 'auto', the RoPE scaling it trained with."""
    from lclm import hf
    from lclm.checkpoint import read_config
    _, saved = read_config(config.model.init_from_checkpoint)
    config.model.update(hf.model_fields(saved.get("model", {}),
                                        rope_scaling=config.model.rope_scaling == "auto"))


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


def attention_kernel(config, model: LlamaConfig, sp: int, platform: str) -> str:
    """The kernel the ring will run (`attention.impl`, 'auto' resolved); an explicit kernel
    that cannot run on this platform is a config error here, at start, not a traceback
    inside the step."""
    a = config.attention
    try:
        return choose_kernel(a.impl, head_dim=model.dim // model.n_heads, q_chunk=a.q_chunk,
                             kv_chunk=a.kv_chunk, platform=platform, dtype=model.dtype,
                             block=tile_run(a.layout, sp, config.data.seq_len))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _attention_line(config, model: LlamaConfig, sp: int, platform: str) -> str:
    kernel = attention_kernel(config, model, sp, platform)
    chosen = f" (auto on {platform_family(platform)})" if config.attention.impl == "auto" else ""
    return f"{kernel}{chosen}, {config.attention.layout} layout"


def train(config, stop_after: int | None = None) -> list[dict]:
    """Run (or resume) up to `config.train.steps` steps; returns the logged metric records.

    `stop_after` ends the run after that step as a crash would (steps since the last
    checkpoint are lost), leaving the schedule and the final step unchanged for the resume.
    """
    devices = jax.devices()
    if config.model.init_from_hf:
        apply_hf_shapes(config)
    elif config.model.init_from_checkpoint:
        apply_checkpoint_fields(config)
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
    lock = WorkdirLock(config.workdir)  # before anything is written to the workdir
    lock.acquire()
    try:
        return _run(config, sizes, mesh, model, attention, tokenizer, stop_after)
    finally:
        lock.release()


def _restore_or_init(config, checkpoints: Checkpoints, state: TrainState, model, mesh):
    """(state, data state) to start from: the workdir's latest readable checkpoint, else the
    configured initial weights (another run's checkpoint, HF weights, or the fresh init)."""
    if checkpoints.latest_step() is not None:
        state, data_state = checkpoints.restore(state)
        if int(state.step) >= config.train.steps:
            log.info("the checkpoint in %s is already at step %d of %d: nothing to train "
                     "(raise train.steps or use a new workdir)", config.workdir,
                     int(state.step), config.train.steps)
        return state, data_state
    if config.model.init_from_checkpoint:
        state = state._replace(params=load_checkpoint_params(config, state))
    elif config.model.init_from_hf:
        state = state._replace(params=load_hf_params(config, model, mesh))
    return state, None


def _summary(records: list[dict], started: float, first_logged: float, tokens_per_step: int,
             checkpoints: Checkpoints, logger: MetricsLogger | None) -> list[str]:
    """What a finished (or stopped) run did and where its outputs are; throughput counts the
    steps after the first logged one (compilation excluded)."""
    first, last = records[0], records[-1]
    now = time.perf_counter()

    def loss(record):
        return "nan" if not math.isfinite(record["loss"]) else f"{record['loss']:.4f}"

    line = (f"trained steps {first['step']}-{last['step']} in {now - started:,.0f} s; loss "
            f"{loss(first)} -> {loss(last)}")
    if last["step"] > first["step"]:
        steady = (last["step"] - first["step"]) * tokens_per_step / (now - first_logged)
        line += f"; {steady:,.0f} tokens/s after compilation"
    latest = checkpoints.latest_step()
    lines = [line, "final checkpoint: " + (os.path.join(checkpoints.directory, str(latest))
                                           if latest is not None else "none")]
    if logger is not None:
        lines += logger.outputs()
    return lines


def _run(config, sizes, mesh, model, attention, tokenizer, stop_after) -> list[dict]:
    devices = list(mesh.devices.flat)
    is_main = jax.process_index() == 0
    saved_config = public_config(config)   # config.json and every checkpoint get this
    if is_main:
        with open(os.path.join(config.workdir, "config.json"), "w") as f:
            json.dump(saved_config, f, indent=1)
    log.info("mesh %s on %d %s devices; model %.2fM params; attention %s", sizes, len(devices),
             devices[0].platform, model.param_count() / 1e6,
             _attention_line(config, model, sizes["sp"], devices[0].platform))

    optimizer = make_optimizer(config.train)
    state = init_state(model, optimizer, mesh, config.seed)
    checkpoints = Checkpoints(config.workdir, config.checkpoint.every, config.checkpoint.keep)
    batches = logger = None
    previous_handlers = {}
    try:
        state, data_state = _restore_or_init(config, checkpoints, state, model, mesh)
        state_sharding = jax.tree.map(lambda x: x.sharding, state)
        step_fn = jax.jit(
            make_train_step(model, attention, config.train, mesh, optimizer,
                            document_mask=config.data.document_mask),
            in_shardings=(state_sharding, batch_sharding(mesh)),
            out_shardings=(state_sharding, NamedSharding(mesh, PartitionSpec())),
            donate_argnums=0)
        finite_fn = jax.jit(all_finite)
        batches = HostBatches(config, mesh, tokenizer, state=data_state)

        total = config.train.steps
        first = int(state.step) + 1
        tokens_per_step = config.data.batch_size * config.data.seq_len
        flops = flops_per_token(model, config.data.seq_len) * tokens_per_step
        peak = peak_flops(devices[0].device_kind)
        if is_main:
            logger = MetricsLogger(config.workdir, _wandb_run(config, first - 1),
                                   resume_step=first - 1)
        progress = Progress(total, first) if is_main and config.log.progress else None
        started, first_logged = time.perf_counter(), None
        records = []
        preempted = threading.Event()
        # One process: SIGTERM/SIGINT save and stop. Several: SIGTERM is the preemption
        # notice of JAX's distributed runtime, which agrees on a step at which every process
        # saves (reached_preemption_sync_point) without a collective per step; SIGINT keeps
        # its default (the run stops; it resumes from its last checkpoint).
        multi = jax.process_count() > 1
        if threading.current_thread() is threading.main_thread() and not multi:
            previous_handlers = {sig: signal.signal(sig, lambda *_: preempted.set())
                                 for sig in (signal.SIGTERM, signal.SIGINT)}
        max_bad = config.train.max_bad_steps
        bad_in_a_row = skipped_steps = failed_saves = 0

        def halt(why: str):
            latest = checkpoints.latest_step()
            where = (f"step {latest} in {checkpoints.directory}" if latest is not None
                     else "none (this run has not saved one)")
            return TrainingHalted(f"{why}; last good checkpoint: {where}")

        def check_step(step: int, skipped) -> None:
            """Count a non-finite step (its update was skipped inside the step)."""
            nonlocal bad_in_a_row, skipped_steps
            if not int(skipped):
                bad_in_a_row = 0
                return
            bad_in_a_row += 1
            skipped_steps += 1
            log.warning("step %d: non-finite loss or gradient norm, update skipped (%d in a "
                        "row, train.max_bad_steps=%d)", step, bad_in_a_row, max_bad)
            if bad_in_a_row >= max_bad:
                raise halt(f"stopped at step {step} after {bad_in_a_row} consecutive steps "
                           "with a non-finite loss or gradient norm (their updates were "
                           "skipped); lower train.lr or check the data")

        def save_failed(error: SaveFailed, last_chance: bool) -> None:
            """Policy: report at once; retry at the next checkpoint step (a transient storage
            fault costs nothing); stop on a second failure in a row or when no later save
            will come (final step, preemption): a run that cannot save loses its work."""
            nonlocal failed_saves
            failed_saves += 1
            log.error("%s", error)
            if last_chance or failed_saves >= 2:
                raise halt(f"stopped: {error}") from None
            log.error("training goes on; the save is retried at the next checkpoint step")

        def save(step: int, last_chance: bool) -> None:
            if not bool(finite_fn((state.params, state.opt_state))):
                raise halt(f"step {step}: parameters or optimizer state are not finite, so no "
                           "checkpoint was written")
            try:
                checkpoints.save(step, state, batches.state(), saved_config)
            except SaveFailed as e:
                save_failed(e, last_chance)

        # Simulated CPU devices: one step in flight at a time. Overlapping multi-device CPU
        # programs were seen to stall XLA's in-process collective rendezvous on 2-core
        # machines (an abort after its 40 s timeout); real accelerators keep asynchronous
        # dispatch.
        sync_each_step = devices[0].platform == "cpu"
        t0, since = time.perf_counter(), first - 1
        last = total if stop_after is None else min(total, stop_after)
        unchecked = None   # (step, skipped flag) read one step late: the host never waits
        for step in range(first, last + 1):
            state, metrics = step_fn(state, next(batches))
            if sync_each_step:
                jax.block_until_ready(metrics)
            if progress:
                progress.step_done(step)
            if unchecked is not None:
                check_step(*unchecked)
            unchecked = (step, metrics["skipped"])
            try:
                if checkpoints.poll():
                    failed_saves = 0
            except SaveFailed as e:
                save_failed(e, last_chance=False)
            if multi and multihost_utils.reached_preemption_sync_point(step):
                preempted.set()
            saving = checkpoints.due(step) or step == total or preempted.is_set()
            logging_step = (step % config.log.every == 0 or step in (first, last)
                            or preempted.is_set())
            if (saving or logging_step) and unchecked is not None:
                check_step(*unchecked)   # the host waits for this step now anyway
                unchecked = None
            if logging_step:
                metrics = jax.device_get(metrics)
                now = time.perf_counter()
                seconds = (now - t0) / (step - since)
                record = dict(step=step, loss=float(metrics["loss"]), lr=float(metrics["lr"]),
                              grad_norm=float(metrics["grad_norm"]),
                              tokens_per_sec=tokens_per_step / seconds, step_time=seconds,
                              mfu=(flops / seconds / (peak * len(devices))) if peak else None,
                              skipped_steps=skipped_steps)
                t0, since = now, step
                first_logged = first_logged or now
                records.append(record)
                if logger:
                    logger.log(record)
                if progress:
                    progress.update(record)
            if saving:
                save(step, last_chance=step == total or preempted.is_set())
            if preempted.is_set():
                log.warning("stopped after step %d on a termination signal (checkpoint saved)",
                            step)
                break
        if unchecked is not None:
            check_step(*unchecked)
        try:
            checkpoints.wait()  # the final save is complete before the run reports success
        except SaveFailed as e:
            save_failed(e, last_chance=True)
        if is_main and records:
            summary = _summary(records, started, first_logged, tokens_per_step, checkpoints,
                               logger)
            if progress:
                progress.close(summary)
            else:
                for line in summary:
                    log.info("%s", line)
        return records
    finally:
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)
        if batches is not None:
            batches.close()
        try:
            checkpoints.close()
        except SaveFailed as e:  # already reported, or an error is on its way out
            log.error("%s", e)
        if logger:
            logger.close()

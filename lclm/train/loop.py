"""The training loop: composes config, mesh, data, model, optimizer and metric sinks."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import threading
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from lclm.checkpoint import Checkpoints, SaveFailed
from lclm.config.model import AttentionConfig, LlamaConfig
from lclm.config.secrets import public_config
from lclm.data.loader import HostBatches
from lclm.data.tokenizer import Tokenizer
from lclm.errors import ConfigError, TrainingHalted
from lclm.files import write_json
from lclm.models.llama import param_count
from lclm.parallel.distributed import any_process, check_same_config
from lclm.parallel.mesh import make_mesh
from lclm.train.lock import WorkdirLock
from lclm.train.metrics import (
    MetricsFailed,
    MetricsLogger,
    Progress,
    flops_per_token,
    peak_flops,
)
from lclm.train.resume import allowed_keys, check_resume, tokenizer_fingerprint
from lclm.train.setup import (
    apply_checkpoint_fields,
    apply_hf_shapes,
    attention_line,
    load_checkpoint_params,
    load_hf_params,
    validate,
    wandb_run,
)
from lclm.train.state import TrainState, init_state
from lclm.train.step import all_finite, jit_eval_loss, jit_train_step, make_optimizer

log = logging.getLogger(__name__)

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
    fresh = not os.path.exists(config.workdir)
    lock = WorkdirLock(config.workdir, config.workdir_lease_minutes)  # before any write there
    lock.acquire()
    try:
        return _run(config, sizes, mesh, model, attention, tokenizer, stop_after, lock)
    except BaseException:
        lock.release()
        if fresh and jax.process_index() == 0 and not _trained(config.workdir):
            # a run that fails before its first step (its data, a compile error) leaves no
            # workdir of its own behind: nothing in it was worth keeping
            shutil.rmtree(config.workdir, ignore_errors=True)
        raise
    finally:
        lock.release()


def _trained(workdir: str) -> bool:
    """Whether a run in `workdir` has logged a step or saved a checkpoint."""
    metrics = os.path.join(workdir, "metrics.jsonl")
    checkpoints = os.path.join(workdir, "checkpoints")
    return ((os.path.isfile(metrics) and os.path.getsize(metrics) > 0)
            or (os.path.isdir(checkpoints) and bool(os.listdir(checkpoints))))


def _restore_or_init(config, checkpoints: Checkpoints, state: TrainState, model, mesh,
                     saved_config: dict):
    """(state, data state) to start from: the workdir's latest readable checkpoint (if the
    config may resume it, `lclm.train.resume`), else the configured initial weights (another
    run's checkpoint, HF weights, or the fresh init)."""
    latest = checkpoints.latest_step()
    if latest is not None:
        saved = checkpoints.saved_config(latest)
        restart_data = saved is not None and check_resume(saved, saved_config,
                                                          allowed_keys(config), latest)
        state, data_state = checkpoints.restore(state)
        if restart_data:
            data_state = None
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


def _validation(config, mesh, tokenizer, model, attention, param_sharding):
    """`val_loss(params) -> float`: the mean token loss over the first `validation.batches`
    batches of `validation.path` (read once, so every evaluation sees the same tokens), or
    None when the run has no validation data."""
    v = config.validation
    if not v.path:
        return None
    held_out = config.copy_and_resolve_references()
    held_out.data.path = v.path
    reader = HostBatches(held_out, mesh, tokenizer, prefetch=0)
    try:
        batches = [next(reader) for _ in range(v.batches)]
    finally:
        reader.close()
    loss_fn = jit_eval_loss(model, attention, mesh, param_sharding,
                            document_mask=config.data.document_mask)

    def val_loss(params) -> float:
        sums = [jax.device_get(loss_fn(params, batch)) for batch in batches]
        return float(sum(t for t, _ in sums)) / max(float(sum(c for _, c in sums)), 1.0)

    return val_loss


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


def _run(config, sizes, mesh, model, attention, tokenizer, stop_after,
         lock: WorkdirLock) -> list[dict]:
    devices = list(mesh.devices.flat)
    is_main = jax.process_index() == 0
    # config.json and every checkpoint get this; `identity` tells a resume what the tokenizer
    # was even when its file has moved
    saved_config = dict(public_config(config),
                        identity=dict(tokenizer=tokenizer_fingerprint(tokenizer)))
    if is_main:
        write_json(os.path.join(config.workdir, "config.json"), saved_config)
    log.info("mesh %s on %d %s devices; model %.2fM params; attention %s", sizes, len(devices),
             devices[0].platform, param_count(model) / 1e6,
             attention_line(config, model, sizes["sp"], devices[0].platform))

    optimizer = make_optimizer(config.train)
    state = init_state(model, optimizer, mesh, config.seed)
    checkpoints = Checkpoints(config.workdir, config.checkpoint.every, config.checkpoint.keep)
    batches = logger = None
    previous_handlers = {}
    try:
        state, data_state = _restore_or_init(config, checkpoints, state, model, mesh,
                                             saved_config)
        state_sharding = jax.tree.map(lambda x: x.sharding, state)
        step_fn = jit_train_step(model, attention, config.train, mesh, optimizer, state_sharding,
                                 document_mask=config.data.document_mask)
        finite_fn = jax.jit(all_finite)
        batches = HostBatches(config, mesh, tokenizer, state=data_state)
        val_loss = _validation(config, mesh, tokenizer, model, attention,
                               state_sharding.params)

        total = config.train.steps
        first = int(state.step) + 1
        tokens_per_step = config.data.batch_size * config.data.seq_len
        flops = flops_per_token(model, config.data.seq_len) * tokens_per_step
        peak = peak_flops(devices[0].device_kind)
        if is_main:
            logger = MetricsLogger(config.workdir, wandb_run(config, first - 1),
                                   resume_step=first - 1)
        if first > total and is_main:
            log.info("%s is already trained to step %d (train.steps); nothing to do: raise "
                     "train.steps to train on", config.workdir, total)
        progress = (Progress(total, first) if is_main and config.log.progress and first <= total
                    else None)
        if is_main and progress is None and first <= total:   # the bar says it where there is one
            log.info("compiling the training step (step %d of %d)", first, total)
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
        bad_in_a_row = skipped_steps = 0
        failures = {"checkpoint": 0, "metrics": 0}   # failed writes in a row, per kind

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

        def write_failed(kind: str, error: Exception, last_chance: bool) -> bool:
            """The one policy for every write of the run: report at once; retry at the next
            chance (a transient storage fault costs nothing); give up on a second failure in
            a row or when no later chance will come. A run that cannot save a checkpoint stops
            (exit 3) with its earlier ones intact; one that cannot write its metrics returns
            True: it saves a checkpoint, then stops, so no trained step is lost."""
            failures[kind] += 1
            log.error("%s", error)
            if last_chance or failures[kind] >= 2:
                if kind == "metrics":
                    return True
                raise halt(f"stopped: {error}") from None
            log.error("training goes on; %s", "the save is retried at the next checkpoint "
                      "step" if kind == "checkpoint" else "the records are written with the "
                      "next logged step")
            return False

        # Time-based saves: several processes must agree, and their clocks differ, so there
        # process 0 decides at logging steps and tells the others (a collective every
        # log.every steps, not every step).
        every_seconds = 60 * config.checkpoint.every_minutes
        last_saved = time.monotonic()

        def save(step: int, last_chance: bool) -> None:
            nonlocal last_saved
            if not bool(finite_fn((state.params, state.opt_state))):
                raise halt(f"step {step}: parameters or optimizer state are not finite, so no "
                           "checkpoint was written")
            last_saved = time.monotonic()
            try:
                checkpoints.save(step, state, batches.state(), saved_config)
            except SaveFailed as e:
                write_failed("checkpoint", e, last_chance)

        def due_by_time(step: int) -> bool:
            if not every_seconds or (multi and step % config.log.every):
                return False
            due = time.monotonic() - last_saved >= every_seconds
            if multi:
                due = bool(multihost_utils.broadcast_one_to_all(np.int32(due)))
            return due

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
                    failures["checkpoint"] = 0
            except SaveFailed as e:
                write_failed("checkpoint", e, last_chance=False)
            if multi and multihost_utils.reached_preemption_sync_point(step):
                preempted.set()
            saving = (checkpoints.due(step) or due_by_time(step) or step == total
                      or preempted.is_set())
            stopping = None   # why the run stops after saving this step
            validating = val_loss is not None and (step % config.validation.every == 0
                                                   or step == last)
            logging_step = (step % config.log.every == 0 or step in (first, last)
                            or preempted.is_set() or validating)
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
                first_logged = first_logged or now
                if validating:   # not counted in the next steps' time
                    record["val_loss"] = val_loss(state.params)
                    now = time.perf_counter()
                t0, since = now, step
                records.append(record)
                give_up = False
                if logger:
                    try:
                        logger.log(record)
                        failures["metrics"] = 0
                    except MetricsFailed as e:
                        give_up = write_failed("metrics", e, last_chance=False)
                lost = lock.lost()   # None, or why another run now holds the workdir
                if multi:   # only process 0 writes metrics and holds the lock
                    give_up = any_process(give_up)
                    lost = lost or ("process 0 lost the workdir lock"
                                    if any_process(lost is not None) else None)
                if lost:   # the workdir is another run's now: write nothing more to it
                    raise halt(f"stopped after step {step}: {lost}; this run stops so that "
                               "two runs never write one workdir")
                if give_up:
                    stopping = f"stopped after step {step}: metrics.jsonl cannot be written"
                    saving = True
                if progress:
                    progress.update(record)
            if saving:
                save(step, last_chance=(step == total or preempted.is_set()
                                        or stopping is not None))
            if stopping is not None:
                try:
                    checkpoints.wait()
                except SaveFailed as e:
                    stopping += f"; {e}"
                raise halt(stopping)
            if preempted.is_set():
                log.warning("stopped after step %d on a termination signal (checkpoint saved)",
                            step)
                break
        if unchecked is not None:
            check_step(*unchecked)
        try:
            checkpoints.wait()  # the final save is complete before the run reports success
        except SaveFailed as e:
            write_failed("checkpoint", e, last_chance=True)
        if is_main and records:
            assert first_logged is not None  # set with the first record
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
            try:
                logger.close()
            except MetricsFailed as e:  # the steps are in the checkpoint: keep their records
                log.error("%s; they are: %s", e, " ".join(line.strip() for line in logger.held()))

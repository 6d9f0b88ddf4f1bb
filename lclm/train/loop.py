"""The training loop: composes config, mesh, data, model, optimizer and metric sinks."""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import math
import signal
import threading
import time

import jax
from jax.experimental import multihost_utils

from lclm import storage
from lclm.checkpoint import Checkpoints, SaveFailed
from lclm.config.model import AttentionConfig, ModelConfig
from lclm.config.secrets import public_config
from lclm.config.stages import validation_lengths
from lclm.data.loader import HostBatches, parse_sources
from lclm.data.sources import DataError, open_documents
from lclm.data.tokenizer import Tokenizer
from lclm.errors import ConfigError, StartupError
from lclm.files import write_json
from lclm.hardware import peak_flops
from lclm.models.decoder import param_count
from lclm.parallel.distributed import any_process, check_same_config
from lclm.parallel.mesh import make_mesh
from lclm.train.cadence import Cadence
from lclm.train.checks import attention_line, check_data, validate
from lclm.train.faults import FaultPolicy, WritePatience
from lclm.train.first_weights import first_state, take_model_fields
from lclm.train.lock import WorkdirLock
from lclm.train.metrics import (
    MetricsFailed,
    MetricsLogger,
    Progress,
    flops_per_token,
    read_metrics,
    wandb_run,
)
from lclm.train.object_lock import workdir_lock
from lclm.train.resume import tokenizer_fingerprint
from lclm.train.step import all_finite, jit_eval_loss, jit_train_step, make_optimizer

log = logging.getLogger(__name__)


def train(config, stop_after: int | None = None) -> list[dict]:
    """Run (or resume) up to `config.train.steps` steps; returns the logged metric records.

    `stop_after` ends the run after that step as a crash would (steps since the last
    checkpoint are lost), leaving the schedule and the final step unchanged for the resume.
    Storage faults are ridden out for `config.storage_patience_seconds` (`WritePatience`).
    """
    devices = jax.devices()
    take_model_fields(config)
    sizes = validate(config, len(devices))
    check_data(config)   # before the model: a missing file is found in seconds
    if jax.process_count() > 1:
        used = math.prod(sizes.values())
        if used != len(devices):
            raise ConfigError(f"mesh {sizes} uses {used} of the {len(devices)} devices of "
                              f"{jax.process_count()} processes; with several processes the "
                              "mesh must use all devices (use -1 for one axis)")
        check_same_config(json.dumps(public_config(config), sort_keys=True))
    mesh = make_mesh(**sizes, devices=devices)
    model = ModelConfig.from_config(config.model)
    attention = AttentionConfig.from_config(config.attention)
    tokenizer = Tokenizer(config.data.tokenizer)
    tokenizer.check_fits(model.vocab_size)
    fresh = not storage.exists(config.workdir)
    lock = workdir_lock(config.workdir, config.workdir_lease_minutes)  # before any write there
    lock.acquire()
    try:
        return _run(config, sizes, mesh, model, attention, tokenizer, stop_after, lock,
                    WritePatience(config.storage_patience_seconds))
    except BaseException:
        lock.release()
        if fresh and jax.process_index() == 0 and not _trained(config.workdir):
            # a run that fails before its first step (its data, a compile error) leaves no
            # workdir of its own behind: nothing in it was worth keeping
            _remove_workdir(config.workdir)
        raise
    finally:
        lock.release()


def _trained(workdir: str) -> bool:
    """Whether a run in `workdir` has logged a step or saved a checkpoint (True where the
    workdir cannot be read: a bucket unreachable when the run stopped keeps its work)."""
    try:
        return bool(read_metrics(workdir)) or bool(storage.listdir(storage.join(workdir,
                                                                                 "checkpoints")))
    except OSError:
        return True


def _remove_workdir(workdir: str) -> None:
    try:
        storage.remove_tree(workdir)
    except Exception as e:  # noqa: BLE001  (the run's own error is the one to report)
        log.warning("could not remove the new workdir %s (%s)", workdir, e)


def _validation(config, mesh, tokenizer, model, attention, param_sharding):
    """`val_losses(params) -> {length: mean token loss}` over the first `validation.batches`
    batches of `validation.path` at each of `validation_lengths(config)` (read once, so every
    evaluation sees the same tokens; `data.batch_size` rows of each length), or None when the
    run has no validation data."""
    v = config.validation
    if not v.path:
        return None
    batches_of = {}
    for length in validation_lengths(config):
        held_out = copy.deepcopy(config)   # references kept: a path may follow seq_len
        held_out.data.seq_len = length
        held_out.data.path = held_out.validation.path
        try:
            reader = HostBatches(held_out, mesh, tokenizer, prefetch=0)
        except DataError:
            _check_validation_size(config, tokenizer)   # the loader's advice is for training
            raise
        try:
            batches_of[length] = [next(reader) for _ in range(v.batches)]
        finally:
            reader.close()
    loss_fn = jit_eval_loss(model, attention, mesh, param_sharding,   # one program per length
                            document_mask=config.data.document_mask)

    def val_losses(params) -> dict[int, float]:
        means = {}
        for length, batches in batches_of.items():
            sums = [jax.device_get(loss_fn(params, batch)) for batch in batches]
            means[length] = (float(sum(t for t, _ in sums))
                             / max(float(sum(c for _, c in sums)), 1.0))
        return means

    return val_losses


def _check_validation_size(config, tokenizer) -> None:
    """A ConfigError naming the validation keys when a source of `validation.path` holds
    fewer records than a batch has rows (each row reads its own records, as in training):
    the fix is more held-out data, not another `data.batch_size`, which would change the
    training run."""
    v, d = config.validation, config.data
    for kind, path, *_ in parse_sources(v.path, d.source, "validation.path"):
        found = len(open_documents(kind, path, tokenizer, text_field=d.text_field,
                                   chat_template=d.chat_template))
        if found < d.batch_size:
            raise ConfigError(
                f"validation.path={v.path!r}: {path} has {found} usable record(s), fewer than "
                f"the data.batch_size={d.batch_size} rows of a validation batch (each row reads "
                f"its own records; validation.batches={v.batches} batches read "
                f"{v.batches * d.batch_size} rows of {d.seq_len} tokens); give "
                f"validation.path at least {d.batch_size} held-out records, or set "
                "validation.path='' to train without validation")


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
    lines = [line, "final checkpoint: " + (storage.join(checkpoints.directory, str(latest))
                                           if latest is not None else "none")]
    if logger is not None:
        lines += logger.outputs()
    return lines


@contextlib.contextmanager
def _written_at_start(path: str):
    """A file the run cannot write before it trains (a full disk) stops it with one line:
    nothing is lost yet."""
    try:
        yield
    except OSError as e:
        raise StartupError(f"cannot write {path} ({e.strerror or e}); free space there or use "
                           "another workdir") from None


def _val_fields(config, losses: dict[int, float]) -> dict:
    """A metric record's held-out losses: `val_loss` at the run's own length and, where it
    measures several, `val_loss@LEN` for each (its own included)."""
    fields = dict(val_loss=losses[config.data.seq_len])
    if len(losses) > 1:
        fields.update({f"val_loss@{n}": x for n, x in losses.items()})
    return fields


def _run(config, sizes, mesh, model, attention, tokenizer, stop_after,
         lock: WorkdirLock, patience: WritePatience) -> list[dict]:
    devices = list(mesh.devices.flat)
    is_main = jax.process_index() == 0
    # config.json and every checkpoint get this; `identity` tells a resume what the tokenizer
    # was even when its file has moved
    saved_config = dict(public_config(config),
                        identity=dict(tokenizer=tokenizer_fingerprint(tokenizer)))
    log.info("mesh %s on %d %s devices; model %.2fM params; attention %s", sizes, len(devices),
             devices[0].platform, param_count(model) / 1e6,
             attention_line(config, model, sizes["sp"], devices[0].platform))

    checkpoints = Checkpoints(config.workdir, config.checkpoint.every, config.checkpoint.keep)
    batches = logger = None
    previous_handlers = {}
    try:
        optimizer = make_optimizer(config.train)
        state, data_state = first_state(config, checkpoints, model, mesh, optimizer,
                                        saved_config)
        if is_main:   # only once the run is accepted: config.json describes the checkpoints
            config_path = storage.join(config.workdir, "config.json")
            with _written_at_start(config_path):
                write_json(config_path, saved_config)
        state_sharding = jax.tree.map(lambda x: x.sharding, state)
        step_fn = jit_train_step(model, attention, config.train, mesh, optimizer, state_sharding,
                                 document_mask=config.data.document_mask)
        finite_fn = jax.jit(all_finite)
        batches = HostBatches(config, mesh, tokenizer, state=data_state)
        if is_main:   # what the run trains on: tokens per length bucket and source, the mixture
            stats_path = storage.join(config.workdir, "data_statistics.json")
            with _written_at_start(stats_path):
                write_json(stats_path, batches.statistics())
        val_losses = _validation(config, mesh, tokenizer, model, attention,
                                 state_sharding.params)

        multi = jax.process_count() > 1
        cadence = Cadence.of(config, int(state.step) + 1, stop_after, multi)
        first, total = cadence.first, cadence.total
        tokens_per_step = config.data.batch_size * config.data.seq_len
        flops = flops_per_token(model, config.data.seq_len) * tokens_per_step
        peak = peak_flops(devices[0].device_kind)
        if is_main:
            with _written_at_start(storage.join(config.workdir, "metrics.jsonl")):
                logger = MetricsLogger(config.workdir, wandb_run(config, first - 1),
                                       resume_step=first - 1)
        if cadence.trained and is_main:
            log.info("%s is already trained to step %d (train.steps); nothing to do: raise "
                     "train.steps to train on", config.workdir, total)
        progress = (Progress(total, first) if is_main and config.log.progress
                    and not cadence.trained else None)
        if is_main and progress is None and not cadence.trained:   # else the bar says it
            log.info("compiling the training step (step %d of %d)", first, total)
        if cadence.validates_at_start:
            # the first weights' held-out loss (validation.at_start): every process computes
            start = dict(step=0, **_val_fields(config, val_losses(state.params)))
            if logger:
                logger.log(start)
        started, first_logged = time.perf_counter(), None
        records = []
        preempted = threading.Event()
        # One process: SIGTERM/SIGINT save and stop. Several: SIGTERM is the preemption
        # notice of JAX's distributed runtime, which agrees on a step at which every process
        # saves (reached_preemption_sync_point) without a collective per step; SIGINT keeps
        # its default (the run stops; it resumes from its last checkpoint).
        if threading.current_thread() is threading.main_thread() and not multi:
            previous_handlers = {sig: signal.signal(sig, lambda *_: preempted.set())
                                 for sig in (signal.SIGTERM, signal.SIGINT)}
        faults = FaultPolicy(checkpoints, patience, config.train.max_bad_steps,
                             60 * config.checkpoint.every_minutes, multi)

        # Simulated CPU devices: one step in flight at a time. Overlapping multi-device CPU
        # programs were seen to stall XLA's in-process collective rendezvous on 2-core
        # machines (an abort after its 40 s timeout); real accelerators keep asynchronous
        # dispatch.
        sync_each_step = devices[0].platform == "cpu"
        t0, since = time.perf_counter(), first - 1
        unchecked = None   # (step, skipped flag) read one step late: the host never waits
        resave = False     # an asynchronous save failed: save the current step instead
        for step in cadence.steps():
            state, metrics = step_fn(state, next(batches))
            if sync_each_step:
                jax.block_until_ready(metrics)
            if progress:
                progress.step_done(step)
            if unchecked is not None:
                faults.check_step(*unchecked)
            unchecked = (step, metrics["skipped"])
            try:
                saved = checkpoints.poll()
                if saved is not None:
                    faults.save_written(saved)
            except SaveFailed as e:
                # that step's state is gone: a later one is saved in its place
                faults.save_trouble(e)
                faults.save_failed(e, last_chance=False)
                resave = True
            if multi and multihost_utils.reached_preemption_sync_point(step):
                preempted.set()
            plan = cadence.at(step, preempted.is_set())
            if multi and plan.log:   # every process saves, or none
                resave = any_process(resave)
            # a failed save is tried again once its pause is over (with several processes, as
            # process 0's clock says)
            retry = resave and plan.retry
            if retry:
                retry = (any_process(jax.process_index() == 0 and faults.retry_due()) if multi
                         else faults.retry_due())
            saving = plan.save or (plan.by_time and faults.due_by_time()) or retry
            stopping = None   # why the run stops after saving this step
            if (saving or plan.log) and unchecked is not None:
                faults.check_step(*unchecked)   # the host waits for this step now anyway
                unchecked = None
            if plan.log:
                metrics = jax.device_get(metrics)
                now = time.perf_counter()
                seconds = (now - t0) / (step - since)
                record = dict(step=step, loss=float(metrics["loss"]), lr=float(metrics["lr"]),
                              grad_norm=float(metrics["grad_norm"]),
                              tokens_per_sec=tokens_per_step / seconds, step_time=seconds,
                              mfu=(flops / seconds / (peak * len(devices))) if peak else None,
                              skipped_steps=faults.skipped_steps)
                first_logged = first_logged or now
                if plan.validate:   # not counted in the next steps' time
                    record.update(_val_fields(config, val_losses(state.params)))
                    now = time.perf_counter()
                t0, since = now, step
                records.append(record)
                give_up = False
                if logger:
                    try:
                        logger.log(record)
                        faults.metrics_written(step)
                    except MetricsFailed as e:
                        give_up = faults.metrics_failed(step, e)
                lost = lock.lost()   # None, or why another run now holds the workdir
                if multi:   # only process 0 writes metrics and holds the lock
                    give_up = any_process(give_up)
                    lost = lost or ("process 0 lost the workdir lock"
                                    if any_process(lost is not None) else None)
                if lost:   # the workdir is another run's now: write nothing more to it
                    raise faults.halt(f"stopped after step {step}: {lost}; this run stops so "
                                      "that two runs never write one workdir")
                if give_up:
                    stopping, saving = faults.metrics_stop_reason(step), True
                if progress:
                    progress.update(record)
            if saving:
                # the final, preemption and stopping saves are the last chance: written to the
                # end (and retried) before the run reports; so is the retry of a failed save
                last_chance = plan.last_chance or stopping is not None
                error = faults.save(
                    step, functools.partial(checkpoints.save, step, state, batches.state(),
                                            saved_config),
                    finite=bool(finite_fn((state.params, state.opt_state))),
                    wait=last_chance or retry, last_chance=last_chance)
                resave = error is not None   # a failed save is tried again at a later step
                if error is not None and stopping is not None:
                    stopping += f"; {error}"
                elif error is not None:
                    faults.save_failed(error, last_chance)
            if stopping is not None:
                raise faults.halt(stopping)
            if plan.stop:
                log.warning("stopped after step %d on a termination signal (checkpoint saved)",
                            step)
                break
        if unchecked is not None:
            faults.check_step(*unchecked)
        try:
            checkpoints.wait()   # a save in flight where `stop_after` ended the loop
        except SaveFailed as e:
            faults.save_failed(e, last_chance=True)
        if logger is not None and faults.failing_since is not None:
            # the last logged steps' records: retried while the patience lasts, else the run
            # stops naming them (they go to the log)
            faults.flush_metrics(logger.flush, records[-1]["step"])
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

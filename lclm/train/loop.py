"""The training loop: composes config, mesh, data, model, optimizer and metric sinks. Where
the first state comes from is `first_weights`' decision, what each step does besides training
`cadence`'s, what a fault does `step_faults`' and `save_faults`', and what a logged step does
the `hooks`'."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import signal
import threading
import time
from collections.abc import Callable

import jax
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from lclm import storage
from lclm.config.model import ModelConfig
from lclm.config.run_config import RunConfig, held_out_runs
from lclm.config.secrets import public_config
from lclm.data.loader import HostBatches
from lclm.data.tokenizer import Tokenizer
from lclm.errors import ConfigError, StartupError
from lclm.models.decoder import param_count
from lclm.parallel.distributed import check_same_config
from lclm.parallel.mesh import make_mesh
from lclm.train.cadence import Cadence
from lclm.train.compile_cache import use_compile_cache
from lclm.train.first_weights import first_state, take_model_fields
from lclm.train.hooks import (
    Console,
    Hook,
    MetricsWriter,
    Throughput,
    Validation,
    log_record,
    summary,
)
from lclm.train.metrics import (
    MetricsFailed,
    MetricsLogger,
    metrics_path,
    read_metrics,
    wandb_run,
)
from lclm.train.remat_choice import train_step
from lclm.train.save_faults import SaveFaults
from lclm.train.startup_checks import attention_line, check_data, checked
from lclm.train.step import all_finite, make_optimizer
from lclm.train.step_faults import StepFaults
from lclm.train.write_patience import WritePatience
from lclm.workdir.checkpoint import Checkpoints, SaveFailed
from lclm.workdir.lock import WorkdirLock
from lclm.workdir.object_lock import workdir_lock
from lclm.workdir.resume import tokenizer_fingerprint
from lclm.workdir.state import TrainState
from lclm.writes import write_json

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Setup:
    """What `train` made before it took the workdir: the checked config's typed sections (and
    those the held-out loss reads, per length), the config that config.json and every
    checkpoint get, the mesh (`sizes`: its axes), the model, the tokenizer, and the workdir's
    lock."""

    sections: RunConfig
    held_out: dict[int, RunConfig]
    saved_config: dict
    sizes: dict[str, int]
    mesh: Mesh
    model: ModelConfig
    tokenizer: Tokenizer
    lock: WorkdirLock


def train(
    config, stop_after: int | None = None, termination: Termination | None = None
) -> list[dict]:
    """Run (or resume) up to `config.train.steps` steps; returns the logged metric records.

    `stop_after` ends the run after that step as a crash would (steps since the last
    checkpoint are lost), leaving the schedule and the final step unchanged for the resume.
    Storage faults are ridden out for `config.storage_patience_seconds` (`WritePatience`).
    `termination`: the caller's handling of termination signals, where it spans more than
    this run (a staged run's: a signal between two stages stops it there); else the run
    handles them itself while it trains.
    """
    devices = jax.devices()
    config = take_model_fields(config)  # the source of its weights fixes the model's shapes
    config, sections, sizes = checked(config, len(devices))
    check_data(config)  # before the model: a missing file is found in seconds
    public = public_config(config)
    if jax.process_count() > 1:
        used = math.prod(sizes.values())
        if used != len(devices):
            raise ConfigError(
                f"mesh {sizes} uses {used} of the {len(devices)} devices of "
                f"{jax.process_count()} processes; with several processes the "
                "mesh must use all devices (use -1 for one axis)"
            )
        check_same_config(json.dumps(public, sort_keys=True))
    use_compile_cache(sections.compile_cache)
    mesh = make_mesh(**sizes, devices=devices)
    model = sections.model.resolved()
    tokenizer = Tokenizer(sections.data.tokenizer)
    tokenizer.check_fits(model.vocab_size)
    # `identity` tells a resume what the tokenizer was even when its file has moved
    saved_config = dict(public, identity=dict(tokenizer=tokenizer_fingerprint(tokenizer)))
    workdir = sections.workdir
    fresh = not storage.exists(workdir)
    lock = workdir_lock(workdir, sections.workdir_lease_minutes)  # before any write there
    lock.acquire()
    try:
        with contextlib.ExitStack() as stack:
            if termination is None:
                termination = stack.enter_context(handled_termination())
            return _run(
                _Setup(
                    sections,
                    held_out_runs(config),
                    saved_config,
                    sizes,
                    mesh,
                    model,
                    tokenizer,
                    lock,
                ),
                stop_after,
                termination,
            )
    except BaseException:
        lock.release()
        if fresh and jax.process_index() == 0 and not _trained(workdir):
            # a run that fails before its first step (its data, a compile error) leaves no
            # workdir of its own behind: nothing in it was worth keeping
            _remove_workdir(workdir)
        raise
    finally:
        lock.release()


def _trained(workdir: str) -> bool:
    """Whether a run in `workdir` has logged a step or saved a checkpoint (True where the
    workdir cannot be read: a bucket unreachable when the run stopped keeps its work)."""
    try:
        return bool(read_metrics(workdir)) or bool(
            storage.listdir(storage.join(workdir, "checkpoints"))
        )
    except OSError:
        return True


def _remove_workdir(workdir: str) -> None:
    try:
        storage.remove_tree(workdir)
    except Exception as e:  # noqa: BLE001  (the run's own error is the one to report)
        log.warning("could not remove the new workdir %s (%s)", workdir, e)


def _run(setup: _Setup, stop_after: int | None, termination: Termination) -> list[dict]:
    """Train from the first state to the cadence's last step; whatever it opened is closed
    however it ends."""
    mesh, model, tokenizer, sections = setup.mesh, setup.model, setup.tokenizer, setup.sections
    saved_config = setup.saved_config
    is_main, multi = jax.process_index() == 0, jax.process_count() > 1
    devices = list(mesh.devices.flat)
    log.info(
        "mesh %s on %d %s devices; model %.2fM params; attention %s",
        setup.sizes,
        len(devices),
        devices[0].platform,
        param_count(model) / 1e6,
        attention_line(
            sections.attention, sections.data.seq_len, model, setup.sizes["sp"], devices[0].platform
        ),
    )
    checkpoints = Checkpoints(sections.workdir, keep=sections.checkpoint.keep)
    batches = logger = step_faults = None
    try:
        optimizer = make_optimizer(sections.train)
        state, data_state = first_state(sections, checkpoints, model, mesh, optimizer, saved_config)
        if is_main:  # only once the run is accepted: config.json describes the checkpoints
            _write_at_start(sections.workdir, "config.json", saved_config)
        state_sharding = jax.tree.map(lambda x: x.sharding, state)
        model, step_fn, remat_line = train_step(
            sections, model, mesh, optimizer, state, state_sharding
        )
        if remat_line:
            log.info("%s", remat_line)
        batches = HostBatches(sections, mesh, tokenizer, state=data_state)
        if is_main:  # what the run trains on: tokens per length bucket and source, the mixture
            _write_at_start(sections.workdir, "data_statistics.json", batches.statistics())
        validation = Validation.of(
            sections, setup.held_out, mesh, tokenizer, model, state_sharding.params
        )
        cadence = Cadence.of(sections, int(state.step) + 1, stop_after, multi)
        if is_main:
            with _written_at_start(metrics_path(sections.workdir)):
                logger = MetricsLogger(
                    sections.workdir,
                    wandb_run(sections, cadence.first - 1),
                    resume_step=cadence.first - 1,
                )
        console = Console(sections, cadence) if is_main else None
        if validation is not None and cadence.validates_at_start:
            # the first weights' held-out loss (a step-0 record): every process computes it
            start = dict(step=0, **validation.fields(state.params))
            if logger:
                logger.log(start)
        patience = WritePatience(sections.storage_patience_seconds)
        save_faults = SaveFaults(
            checkpoints, patience, 60 * sections.checkpoint.every_minutes, multi
        )
        step_faults = StepFaults(
            save_faults.halt,
            patience,
            sections.train.max_bad_steps,
            metrics=metrics_path(sections.workdir),
        )
        throughput = Throughput(sections.data, model, devices, cadence.first)
        writer = MetricsWriter(logger, setup.lock, step_faults, multi)
        # in this order: the clock restarts after validation, the console shows what was written
        hooks: list[Hook] = [h for h in (validation, throughput, writer, console) if h]
        records = _steps(
            _Loop(
                step_fn,
                batches,
                checkpoints,
                saved_config,
                cadence,
                termination,
                step_faults,
                save_faults,
                throughput,
                hooks,
                devices[0].platform == "cpu",
            ),
            state,
        )
        step_faults.check_pending()
        save_faults.wait_for_saves()  # a save in flight where `stop_after` ended the loop
        writer.flush_held()
        lines = summary(records, throughput, checkpoints, logger) if is_main else []
        for hook in hooks:
            hook.on_end(lines)
        return records
    finally:
        _close(
            batches,
            checkpoints,
            logger,
            write_held=step_faults is None or step_faults.failing_since is None,
        )


@dataclasses.dataclass(frozen=True)
class _Loop:
    """What the steps use: the jitted step, the data, the checkpoints (`saved_config`: the
    config each gets), what each step does, the answers to faults of steps and of saves, the
    hooks (`throughput` among them: it makes the records), and whether each step is waited
    for (`sync`)."""

    step_fn: Callable
    batches: HostBatches
    checkpoints: Checkpoints
    saved_config: dict
    cadence: Cadence
    termination: Termination
    step_faults: StepFaults
    save_faults: SaveFaults
    throughput: Throughput
    hooks: list[Hook]
    # Simulated CPU devices: one step in flight at a time. Overlapping multi-device CPU
    # programs were seen to stall XLA's in-process collective rendezvous on 2-core machines
    # (an abort after its 40 s timeout); real accelerators keep asynchronous dispatch.
    sync: bool


def _steps(run: _Loop, state: TrainState) -> list[dict]:
    """Train the cadence's steps from `state`; returns the logged records."""
    cadence, step_faults, save_faults = run.cadence, run.step_faults, run.save_faults
    hooks = run.hooks
    finite_fn = jax.jit(all_finite)
    records: list[dict] = []
    throughput = run.throughput
    for step in cadence.steps():
        began = time.perf_counter()
        batch = next(run.batches)
        fed = time.perf_counter()
        throughput.waited("data", fed - began)
        state, metrics = run.step_fn(state, batch)
        if run.sync:
            jax.block_until_ready(metrics)
        if throughput.compile_seconds is None:  # the first call traced and compiled the step
            throughput.compiled(time.perf_counter() - fed)
        for hook in hooks:
            hook.on_step(step)
        step_faults.step_ran(step, metrics["skipped"])  # the previous step's flag is checked
        save_faults.poll_saves()
        plan = cadence.at(step, terminated=run.termination.at(step))
        retry = save_faults.retry_now(plan)  # a failed save, once its pause is over
        saving = plan.save or (plan.by_time and save_faults.due_by_time()) or retry
        stopping = None  # why the run stops after saving this step
        if saving or plan.log:
            step_faults.check_pending()  # the host waits for this step now anyway
        if plan.log:
            records.append(
                throughput.record(step, jax.device_get(metrics), step_faults.skipped_steps)
            )
            stopping = log_record(hooks, records[-1], state, plan)
        if saving or stopping is not None:
            # the final, termination and stopping saves are the last chance: written to the
            # end (and retried) before the run reports; so is the retry of a failed save
            last_chance = plan.last_chance or stopping is not None
            began = time.perf_counter()
            write = functools.partial(
                run.checkpoints.save, step, state, run.batches.state(), run.saved_config
            )
            save_faults.save_step(
                step,
                write,
                finite=bool(finite_fn((state.params, state.opt_state))),
                wait=last_chance or retry,
                last_chance=last_chance,
                stopping=stopping,
                terminated=plan.stop,
            )
            throughput.waited("save", time.perf_counter() - began)
        if plan.stop:
            log.warning("stopped after step %d on a termination signal (checkpoint saved)", step)
            break
    return records


class Termination:
    """Whether the run was asked to stop. One process: SIGTERM/SIGINT save and stop. Several:
    SIGTERM is the preemption notice of JAX's distributed runtime, which agrees on a step at
    which every process saves (reached_preemption_sync_point) without a collective per step;
    SIGINT keeps its default (the run stops; it resumes from its last checkpoint). Made by
    `handled_termination`, for as long as the signals are handled."""

    def __init__(self, multi: bool):
        self.multi = multi
        self._signalled = threading.Event()
        self._previous = {}
        if threading.current_thread() is threading.main_thread() and not multi:
            self._previous = {
                sig: signal.signal(sig, lambda *_: self._signalled.set())
                for sig in (signal.SIGTERM, signal.SIGINT)
            }

    def at(self, step: int) -> bool:
        """Whether the run stops after `step` (every process gets the same answer)."""
        if self.multi and multihost_utils.reached_preemption_sync_point(step):
            self._signalled.set()
        return self._signalled.is_set()

    def signalled(self) -> bool:
        """Whether this process was signalled, at any time (also after the last step's
        `at`: during a run's final save and summary)."""
        return self._signalled.is_set()

    def restore(self) -> None:
        """The signal handlers as they were before."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def handled_termination():
    """Termination signals handled (`Termination`) inside the block, as before after it."""
    termination = Termination(jax.process_count() > 1)
    try:
        yield termination
    finally:
        termination.restore()


def _close(
    batches: HostBatches | None,
    checkpoints: Checkpoints,
    logger: MetricsLogger | None,
    write_held: bool,
) -> None:
    """What a run opened, however it ends: the data readers stopped, the save in flight
    written, the held metrics written (unless `write_held` is False: their writes were
    failing when the run stopped, and are in the log)."""
    if batches is not None:
        batches.close()
    try:
        checkpoints.close()
    except SaveFailed as e:  # already reported, or an error is on its way out
        log.error("%s", e)
    if logger:
        try:
            logger.close(write=write_held)
        except MetricsFailed as e:  # the steps are in the checkpoint: keep their records
            log.error("%s; they are: %s", e, " ".join(line.strip() for line in logger.held()))


def _write_at_start(workdir: str, name: str, value) -> None:
    """`value` as JSON to `name` in `workdir`, before the run trains."""
    path = storage.join(workdir, name)
    with _written_at_start(path):
        write_json(path, value)


@contextlib.contextmanager
def _written_at_start(path: str):
    """A file the run cannot write before it trains (a full disk) stops it with one line:
    nothing is lost yet."""
    try:
        yield
    except OSError as e:
        raise StartupError(
            f"cannot write {path} ({e.strerror or e}); free space there or use another workdir"
        ) from None

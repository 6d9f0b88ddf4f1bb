"""Orbax checkpoints of the train state in `<workdir>/checkpoints`, and resume.

Saves asynchronously (training continues while tensorstore writes) and keeps the last
`checkpoint.keep`; which steps are saved (every `checkpoint.every`, the final step, on
SIGTERM / SIGINT) is `lclm.train.cadence`'s, saves by time and retries are
`lclm.train.save_faults`'. Each process writes its own shards. A checkpoint holds
`state` (step, params, optimizer state), `data` (every process's data-pipeline state) and
`config` (secrets removed).

Layout-free: parameters are in lclm's canonical layout (stacked layers, heads as an axis),
independent of mesh, `scan_layers` and attention layout, and the data state is in original
token order; restoring places arrays with the *new* run's shardings, so a checkpoint moves
between meshes. Loading reads tensorstore arrays and JSON only (no pickles).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import TypeVar

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from orbax.checkpoint._src.serialization import tensorstore_utils

from lclm import storage
from lclm.errors import StartupError
from lclm.parallel.distributed import any_process

log = logging.getLogger(__name__)
T = TypeVar("T")
# the object Orbax writes last into a step saved on GCS (no rename there): the step is complete
COMMITTED = "commit_success.txt"


def gather_json(obj) -> list:
    """Every process's JSON-serialisable `obj`, in process order (Orbax's JsonSave keeps only
    process 0's dict, so per-host data states are gathered into it)."""
    if jax.process_count() == 1:
        return [obj]
    raw = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    size = int(np.max(multihost_utils.process_allgather(np.int64(raw.size))))
    padded = np.zeros(size, np.uint8)
    padded[: raw.size] = raw
    rows = multihost_utils.process_allgather(padded)
    return [json.loads(bytes(r).rstrip(b"\0").decode()) for r in rows]


def _as_dict(state) -> dict:
    return {"step": state.step, "params": state.params, "opt_state": state.opt_state}


# tensorstore's tries of one request to a bucket while Orbax writes or reads arrays (its own for
# GCS: 32, with pauses doubling to 32 s): during an outage a failed save's writes went on for
# minutes, and the interpreter, at exit, waited for Orbax's threads that wait for them. A few
# seconds, as for gcsfs (storage.GCS_TRIES): `storage_patience_seconds` decides how long a run
# waits.
_TENSORSTORE_RETRIES = {"max_retries": 3, "initial_delay": "1s", "max_delay": "2s"}
# how long one of its requests waits for the store (storage.REQUEST_SECONDS): to connect, and
# with less than a byte a second moving either way. Variables its HTTP transport reads when
# it is first used (the process's first checkpoint read or write on a bucket)
_TENSORSTORE_WAITS = {
    "TENSORSTORE_CURL_CONNECT_TIMEOUT_SECONDS": storage.REQUEST_SECONDS,
    "TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS": storage.REQUEST_SECONDS,
    "TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES": 1,
}


# How the train state's arrays are written (bench/checkpoint_save.py, results in
# bench/results/checkpoint-speed/): Orbax's default compresses every chunk with zstd, which is
# CPU-bound: on 2 cores it saved at 0.3-0.4 of what `dd` wrote to the same disk and restored at
# 0.1-0.3 of a numpy read, for 17-35% fewer bytes (35% on SmolLM2's weights, which come from a
# 4-bit GGUF). Compression pays only where the host's cores compress faster than its store
# writes; uncompressed, a save keeps up with the disk (0.55-1.6 of dd) and needs no buffers
# beyond the arrays' host copy. zarr3 and zarr2 measured alike uncompressed; zarr3 is Orbax's
# newer format. Restores read the format each step's files record, so steps saved before
# (zarr2 + zstd) still restore.
STATE_FORMAT = {"use_zarr3": True, "use_compression": False}


def state_handler() -> ocp.PyTreeCheckpointHandler:
    """The Orbax handler of a checkpoint's `state` item, for saves and restores alike."""
    return ocp.PyTreeCheckpointHandler(**STATE_FORMAT)


def _prepare_orbax() -> None:
    """Before a checkpoint manager's handlers make their tensorstore contexts: bound their
    retries (`_TENSORSTORE_RETRIES`, under each scheme's `tensorstore_retries` resource, put
    into the module-level dicts Orbax builds each context from: it offers no option for it)
    and their waits (`_TENSORSTORE_WAITS`, unless the environment sets them), and show
    storage failures in one line (`_quiet_storage_tracebacks`)."""
    for name, value in _TENSORSTORE_WAITS.items():
        os.environ.setdefault(name, str(value))
    for context in (
        tensorstore_utils._BASE_TS_CONTEXT,
        tensorstore_utils._DEFAULT_OCDBT_TS_CONTEXT,
    ):
        for entry in storage.SCHEMES.values():
            if entry.tensorstore_retries:
                context[entry.tensorstore_retries] = dict(_TENSORSTORE_RETRIES)
    _quiet_storage_tracebacks()


def _reader(workdir: str):
    """A read-only manager of `<workdir>/checkpoints`; `state` is read as a plain PyTree so
    that parameters can be restored without the optimizer state."""
    directory = storage.absolute(storage.join(workdir, "checkpoints"))
    if not storage.isdir(directory):
        if not storage.exists(workdir):
            raise FileNotFoundError(f"{workdir!r} does not exist; pass the workdir of an lclm run")
        raise FileNotFoundError(f"no checkpoints in {workdir!r} (expected {directory})")
    _prepare_orbax()  # a damaged step's failed reads: one line, as for saves
    handlers = {
        "state": state_handler(),
        "data": ocp.JsonCheckpointHandler(),
        "config": ocp.JsonCheckpointHandler(),
    }
    return ocp.CheckpointManager(
        directory, item_handlers=handlers, options=ocp.CheckpointManagerOptions(create=False)
    )


def saved_config(workdir: str, step: int | None = None) -> tuple[int, dict]:
    """(step, the config saved with it) of checkpoint `step` or the latest one of `workdir`."""
    manager = _reader(workdir)
    try:
        step = manager.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {workdir!r}/checkpoints")
        config = manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
    finally:
        manager.close()
    return step, config["config"]


def first_readable(steps, read, damaged):
    """(step, `read(step)`) of the first of `steps` (latest first) that every process reads,
    `damaged(step, why)` called for each that is not; None when none is. The one fallback
    of training's resume (`Checkpoints.restore`, which sets a damaged step aside) and of the
    tools that read a run's parameters (`read_checkpoint`, which leaves it where it is). A
    shape mismatch, or any other StartupError (a mesh this machine cannot make), is not
    damage: it is raised."""
    for step in steps:
        error, result = None, None
        try:
            result = read(step)
        except StartupError:
            raise
        except Exception as e:  # noqa: BLE001  (any damage: truncated, random, missing)
            error = e
        if any_process(error is not None):  # every process falls back together
            damaged(step, first_line(error) if error else "unreadable on another process")
            continue
        return step, result
    return None


def read_checkpoint(
    workdir: str, step: int | None, load: Callable[[int, dict], T]
) -> tuple[int, dict, T]:
    """(step, its saved config, `load(step, config)`) of checkpoint `step` of `workdir`, or
    where `step` is None of its latest readable one: a damaged step is named in a warning and
    the previous one read, as a resumed run falls back, but left where it is (a reader does
    not move a run's files; the next training run sets it aside). `load` reads what the
    caller needs (the parameters); a given `step` that cannot be read is one line."""
    manager = _reader(workdir)
    try:
        steps = sorted(manager.all_steps(), reverse=True)
    finally:
        manager.close()
    if not steps:
        raise FileNotFoundError(f"no checkpoint in {workdir!r}/checkpoints")
    if step is not None and step not in steps:
        raise FileNotFoundError(
            f"{workdir!r} has no checkpoint step {step} (saved: {sorted(steps)})"
        )

    def read(s: int):
        config = saved_config(workdir, s)[1]
        return config, load(s, config)

    def damaged(s: int, why: str) -> None:
        if step is not None:
            raise StartupError(
                f"checkpoint step {s} of {workdir} cannot be read ({why}); pass "
                f"another --step (saved: {sorted(steps)})"
            )
        log.warning(
            "checkpoint step %d of %s is damaged (%s); reading the previous one", s, workdir, why
        )

    found = first_readable([step] if step is not None else steps, read, damaged)
    if found is None:
        raise StartupError(
            f"no readable checkpoint in {workdir!r} (steps {sorted(steps)} are damaged)"
        )
    s, (config, loaded) = found
    return s, config, loaded


def read_params(workdir: str, step: int, abstract_params):
    """The parameters of checkpoint `step` alone (no optimizer or data state), placed as the
    `jax.ShapeDtypeStruct` leaves of `abstract_params` say (their shardings: any mesh)."""
    return read_state_items(workdir, step, {"params": abstract_params})["params"]


def read_state_items(workdir: str, step: int, abstract: dict) -> dict:
    """Items of checkpoint `step`'s train state (`{"params": ..., "opt_state": ...}`, any of
    them), placed as the `jax.ShapeDtypeStruct` leaves of `abstract` say."""
    manager = _reader(workdir)
    try:
        restored = manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(
                    item=abstract,
                    restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
                    partial_restore=True,
                )
            ),
        )
    finally:
        manager.close()
    return restored["state"]


def path_problem(workdir: str) -> str | None:
    """Why checkpoints cannot be kept under `workdir` (None: they can): an object store whose
    `storage.SCHEMES` entry keeps no checkpoints, or a '[' or ']' in the path (Orbax finds
    the files each process wrote with glob patterns that contain the path, so a character
    class would make every checkpoint written there unreadable)."""
    name = storage.scheme(workdir)
    entry = storage.SCHEMES.get(name or "")
    if name is not None and not (entry and entry.checkpoints):
        kept = storage.listing(lambda s: s.checkpoints)
        mount = f" (e.g. {entry.mount})" if entry else ""
        return (
            f"is on {name}://, where Orbax (0.12, lclm's checkpoint writer) cannot keep "
            f"checkpoints: it writes arrays to {kept} or a file path; use a {kept} "
            f"workdir, or mount the bucket{mount} and give its path"
        )
    if "[" in workdir or "]" in workdir:
        return (
            "contains '[' or ']', which Orbax's file matching reads as a pattern: "
            "checkpoints written there could not be read back; rename it"
        )
    return None


class ShapeMismatch(StartupError):
    """The checkpoint was written for another model (the config, not the files, is wrong)."""


class SaveFailed(RuntimeError):
    """A checkpoint save did not complete; the checkpoints before it are intact. `began`: when
    the failed save was started (`time.monotonic()`): a save that waited on a silent store
    was failing from then."""

    def __init__(self, message: str, began: float):
        super().__init__(message)
        self.began = began


def first_line(e: BaseException, limit: int = 300) -> str:
    """A one-line summary of an exception (tensorstore errors run to dozens of lines)."""
    if storage.timed_out(e) or not str(e).strip():
        return storage.error_text(e)
    return str(e).strip().splitlines()[0][:limit]


class _LateCallbacksIgnored:
    """`sys.unraisablehook` that drops one harmless race: when a write fails, Orbax closes the
    event loop of the save while tensorstore's other writes are in flight, and each that
    completes later finds the loop closed ('Event loop is closed' raised in asyncio's
    call_soon_threadsafe, printed with its traceback). Everything else goes to `previous`."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, unraisable) -> None:
        error, tb = unraisable.exc_value, unraisable.exc_traceback
        frames = []
        while tb is not None:
            frames.append(tb.tb_frame.f_code.co_name)
            tb = tb.tb_next
        if (
            isinstance(error, RuntimeError)
            and str(error) == "Event loop is closed"
            and "call_soon_threadsafe" in frames
        ):
            log.debug("a storage write completed after its save was abandoned")
            return
        self.previous(unraisable)


# the loggers of the storage clients Orbax goes through (fsspec's and those of the schemes it
# keeps checkpoints on) and those of their modules that log on their own: a logger's filters
# see only the records logged on it, not those its children pass up
_CLIENT_LOGGERS = (*(s.client for s in storage.SCHEMES.values() if s.checkpoints), "fsspec")
_CLIENT_CHILDREN = (
    *(name for s in storage.SCHEMES.values() if s.checkpoints for name in s.loggers),
    "fsspec.asyn",
    "fsspec.caching",
    "fsspec.prefetcher",
    "fsspec.generic",
    "fsspec.mapping",
)


def _quiet_storage_tracebacks() -> None:
    # Orbax logs through absl, whose records (like asyncio's and the storage clients') reach
    # lclm's handlers
    storage.quiet_tracebacks(("absl", "asyncio", *_CLIENT_LOGGERS, *_CLIENT_CHILDREN))
    for name in _CLIENT_LOGGERS:
        # their informational records (fsspec's 'AdaptiveReadaheadCache enabled', five per
        # save or restore) are not shown; a level someone set on purpose is kept
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.WARNING)
    if not isinstance(sys.unraisablehook, _LateCallbacksIgnored):
        sys.unraisablehook = _LateCallbacksIgnored(sys.unraisablehook)


class Checkpoints:
    """The run's checkpoint directory (when to save: `lclm.train.cadence`, and
    `lclm.train.save_faults` for saves by time and retries).

    Faults: a step that cannot be read is moved aside to `<workdir>/checkpoints_damaged/`
    (never deleted) and the previous one is used, so the run can save that step again. A save
    that fails is reported by `poll` (called every step) or `close` as `SaveFailed`.
    """

    def __init__(self, workdir: str, keep: int):
        self.directory = storage.absolute(storage.join(workdir, "checkpoints"))
        self.damaged = storage.join(storage.dirname(self.directory), "checkpoints_damaged")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=True,
            enable_async_checkpointing=True,
            # the step directory is created before `save` returns, so an unwritable or full
            # disk fails the save call itself instead of a background thread waiting minutes
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
        )
        _prepare_orbax()
        handlers = {
            "state": state_handler(),
            "data": ocp.JsonCheckpointHandler(),
            "config": ocp.JsonCheckpointHandler(),
        }
        self.manager = ocp.CheckpointManager(
            self.directory, options=options, item_handlers=handlers
        )
        self._pending: int | None = None  # step of the asynchronous save in flight
        self._began = time.monotonic()  # when the save in flight (or the last one) began
        self._completed: int | None = None  # a save completed since `poll` last said so
        self._abandoned: set[int] = set()  # failed saves whose partial files may remain

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def latest_config(self) -> tuple[int, dict] | None:
        """(step, saved config) of the latest step whose config can be read, or None when
        there is no such step: what a resume is checked against before anything is
        initialised (a step whose config is damaged is skipped here, as `restore` will skip
        it)."""
        for step in sorted(self.manager.all_steps(), reverse=True):
            config = self.config_at(step)
            if config is not None:
                return step, config
        return None

    def config_at(self, step: int) -> dict | None:
        """The config saved with `step`, or None where it cannot be read (damage is
        `restore`'s business: it sets the step aside)."""
        try:
            restored = self.manager.restore(
                step, args=ocp.args.Composite(config=ocp.args.JsonRestore())
            )
        except Exception:  # noqa: BLE001  (any damage)
            return None
        return restored["config"]

    def check_shapes(self, step: int, params) -> None:
        """A clear error naming the first parameter whose saved shape differs, or that only
        one of the checkpoint and the model has (a changed config, not damage: nothing is
        set aside for it)."""
        saved = self.manager.item_metadata(step)["state"].tree["params"]
        saved = {
            jax.tree_util.keystr(k): v.shape
            for k, v in jax.tree_util.tree_leaves_with_path(
                saved, is_leaf=lambda x: hasattr(x, "shape")
            )
        }
        expected = {
            jax.tree_util.keystr(path): leaf.shape
            for path, leaf in jax.tree_util.tree_leaves_with_path(params)
        }
        for name, shape in expected.items():
            if name not in saved:
                raise ShapeMismatch(
                    f"checkpoint step {step} in {self.directory} has no "
                    f"parameter {name}; it was written for another model"
                )
            if tuple(saved[name]) != tuple(shape):
                raise ShapeMismatch(
                    f"checkpoint step {step} parameter {name} has shape "
                    f"{tuple(saved[name])} but the model expects "
                    f"{tuple(shape)}; check config.model against the "
                    "run that wrote it"
                )
        extra = sorted(set(saved) - set(expected))
        if extra:
            raise ShapeMismatch(
                f"checkpoint step {step} in {self.directory} has parameter "
                f"{extra[0]} that the model does not (e.g. "
                "model.tie_embeddings); check config.model against the run "
                "that wrote it"
            )

    def _read(self, step: int, template):
        """`(state, data states)` of `step`; raises whatever a damaged step raises."""
        self.check_shapes(step, template.params)
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
            _as_dict(template),
        )
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(
                    item=abstract,
                    restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
                ),
                data=ocp.args.JsonRestore(),
            ),
        )
        s = restored["state"]
        return type(template)(s["step"], s["params"], s["opt_state"]), restored["data"]["processes"]

    def set_aside(self, step: int, why: str) -> None:
        """Move a damaged step out of the way (to `checkpoints_damaged/<step>-<time>`), so
        that the run can write that step again, and keep it for inspection."""
        if jax.process_index() == 0:
            source = storage.join(self.directory, str(step))
            target = storage.join(self.damaged, f"{step}-{time.strftime('%Y%m%d-%H%M%S')}")
            if storage.exists(source):
                storage.move(source, target)
            log.error(
                "checkpoint step %d in %s is damaged (%s); moved it to %s and falling "
                "back to the previous one",
                step,
                self.directory,
                why,
                target,
            )
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"lclm_set_aside_{step}")
        storage.forget_listings(self.directory)
        self.manager.reload()

    def restore(self, template):
        """(state placed like `template`, the data states of every process that saved it) of
        the latest readable checkpoint. Damaged steps are set aside; a shape mismatch is a
        config error and stops."""
        found = first_readable(
            sorted(self.manager.all_steps(), reverse=True),
            lambda step: self._read(step, template),
            self.set_aside,
        )
        if found is not None:
            log.info("restored checkpoint step %d of %s", found[0], self.directory)
            return found[1]
        raise StartupError(
            f"no readable checkpoint in {self.directory} (damaged ones are in "
            f"{self.damaged}); run again to start from scratch, or use a new "
            "workdir"
        )

    def save(self, step: int, state, data_state: dict | None, config: dict) -> None:
        """Start an asynchronous save of `step` (returns once the arrays are copied);
        `data_state` is None where no data has been read (a converted checkpoint).
        Raises `SaveFailed` if the previous save or this one cannot be written."""
        self.wait()
        self._began = time.monotonic()
        self._remove_partial()  # again: writes still in flight at a failure may have left some
        data = {"processes": gather_json(data_state)}
        try:
            self.manager.save(
                step,
                force=True,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeSave(_as_dict(state)),
                    data=ocp.args.JsonSave(data),
                    config=ocp.args.JsonSave(config),
                ),
            )
        except Exception as e:  # noqa: BLE001  (unwritable directory, disk full...)
            raise self._failed(step, e) from None
        self._pending = step

    def poll(self) -> int | None:
        """The step of the save in flight once it has completed (else None); `SaveFailed` as
        soon as it has failed (cheap: a flag test while it is still writing)."""
        if self._pending is not None and not self.manager.is_saving_in_progress():
            self.wait()
        # also a save that the next one waited for (with `checkpoint.every=1`, most of them)
        done, self._completed = self._completed, None
        return done

    def wait(self) -> None:
        """Wait for the save in flight; `SaveFailed` if it failed."""
        step, self._pending = self._pending, None
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise self._failed(step, e) from None
        if step is not None:
            self._completed = step

    def _remove_partial(self) -> None:
        """Delete what failed saves wrote: it would keep a full disk full for the retry, and on
        GCS a step's partial objects sit under the step's own name (a local save writes under
        a temporary name and renames it; a GCS save marks the end with a commit object).
        Done at the next save or, on a local disk, at close, not when the save fails: storage
        that fails a save usually fails this too (an unreachable bucket), and the run decides
        by its patience, not by waiting on cleanup. Storage that still fails is tried again
        the next time."""
        if not self._abandoned:
            return
        if jax.process_index() == 0:
            for step in sorted(self._abandoned):
                try:
                    for name in storage.listdir(self.directory):
                        path = storage.join(self.directory, name)
                        if name.startswith(f"{step}.orbax-checkpoint-tmp") or (
                            name == str(step)
                            and storage.is_remote(path)
                            and not storage.exists(storage.join(path, COMMITTED))
                        ):
                            storage.remove_tree(path)
                except Exception as e:  # noqa: BLE001  (any client's error: the save failed)
                    log.debug("partial files of step %d not removed yet (%s)", step, first_line(e))
                    return
                self._abandoned.discard(step)
        else:
            self._abandoned.clear()
        self._reload()

    def _reload(self) -> None:
        try:
            storage.forget_listings(self.directory)  # a removed GCS step: out of every listing
            self.manager.reload()  # the failed step out of the manager's list, if it is there
        except Exception as e:  # noqa: BLE001  (storage still failing: its last list stands)
            log.debug("checkpoint list not reloaded (%s)", first_line(e))

    def _failed(self, step, error: BaseException) -> SaveFailed:
        if step is not None:
            self._abandoned.add(step)
        # an earlier save completed but not yet reported: not news once a later one failed
        self._completed = None
        self._reload()  # Orbax, not reloaded, raises the failed save again at every later one
        intact = [s for s in self.manager.all_steps() if s != step]
        return SaveFailed(
            f"checkpoint step {step} could not be saved to {self.directory} "
            f"({first_line(error)}); intact checkpoints: {intact or 'none'}",
            began=self._began,
        )

    def close(self) -> None:
        """Wait for the save in flight and release the manager; `SaveFailed` if a save failed.

        Newer Orbax raises a failed background save again from `close()`: that is the same
        failure (usually reported already), turned into one `SaveFailed`, never a traceback."""
        failed = None
        try:
            self.wait()
        except SaveFailed as e:
            failed = e
        if not storage.is_remote(self.directory):
            # a full disk is freed at once; a step on a store that failed to save it has no
            # commit object (never read as a checkpoint) and the store is likely still
            # failing: the run's end does not wait on it
            self._remove_partial()
        try:
            self.manager.close()
        except Exception as e:  # noqa: BLE001
            failed = failed or SaveFailed(
                f"a checkpoint save to {self.directory} failed ({first_line(e)})", began=self._began
            )
        if failed is not None:
            raise failed

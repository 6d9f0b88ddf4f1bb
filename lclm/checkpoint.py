"""Orbax checkpoints of the train state in `<workdir>/checkpoints`, and resume.

Saves every `checkpoint.every` steps (asynchronously: training continues while tensorstore
writes), keeps the last `checkpoint.keep`, and always saves the final step (and on SIGTERM
/ SIGINT, see `lclm.train.loop`). Each process writes its own shards. A checkpoint holds
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

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

log = logging.getLogger(__name__)


def gather_json(obj) -> list:
    """Every process's JSON-serialisable `obj`, in process order (Orbax's JsonSave keeps only
    process 0's dict, so per-host data states are gathered into it)."""
    if jax.process_count() == 1:
        return [obj]
    raw = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    size = int(np.max(multihost_utils.process_allgather(np.int64(raw.size))))
    padded = np.zeros(size, np.uint8)
    padded[:raw.size] = raw
    rows = multihost_utils.process_allgather(padded)
    return [json.loads(bytes(r).rstrip(b"\0").decode()) for r in rows]


def _as_dict(state) -> dict:
    return {"step": state.step, "params": state.params, "opt_state": state.opt_state}


def _reader(workdir: str):
    """A read-only manager of `<workdir>/checkpoints`; `state` is read as a plain PyTree so
    that parameters can be restored without the optimizer state."""
    directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"no checkpoints in {workdir!r} (expected {directory})")
    handlers = {"state": ocp.PyTreeCheckpointHandler(), "data": ocp.JsonCheckpointHandler(),
                "config": ocp.JsonCheckpointHandler()}
    return ocp.CheckpointManager(directory, item_handlers=handlers,
                                 options=ocp.CheckpointManagerOptions(create=False))


def read_config(workdir: str, step: int | None = None) -> tuple[int, dict]:
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


def read_params(workdir: str, step: int, abstract_params):
    """The parameters of checkpoint `step` alone (no optimizer or data state), placed as the
    `jax.ShapeDtypeStruct` leaves of `abstract_params` say (their shardings: any mesh)."""
    item = {"params": abstract_params}
    manager = _reader(workdir)
    try:
        restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
            item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
            partial_restore=True)))
    finally:
        manager.close()
    return restored["state"]["params"]


class Checkpoints:
    """The run's checkpoint directory (`every=0`: only final and preemption saves)."""

    def __init__(self, workdir: str, every: int, keep: int):
        self.every = every
        path = os.path.join(workdir, "checkpoints")
        self.directory = path if "://" in path else os.path.abspath(path)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=True)
        handlers = {"state": ocp.StandardCheckpointHandler(),
                    "data": ocp.JsonCheckpointHandler(), "config": ocp.JsonCheckpointHandler()}
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_handlers=handlers)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def check_shapes(self, step: int, params) -> None:
        """A clear error naming the first parameter whose saved shape differs."""
        saved = self.manager.item_metadata(step)["state"].tree["params"]
        saved = {jax.tree_util.keystr(k): v.shape
                 for k, v in jax.tree_util.tree_leaves_with_path(
                     saved, is_leaf=lambda x: hasattr(x, "shape"))}
        for path, leaf in jax.tree_util.tree_leaves_with_path(params):
            name = jax.tree_util.keystr(path)
            if name not in saved:
                raise ValueError(f"checkpoint step {step} in {self.directory} has no parameter "
                                 f"{name}; it was written for another model")
            if tuple(saved[name]) != tuple(leaf.shape):
                raise ValueError(f"checkpoint step {step} parameter {name} has shape "
                                 f"{tuple(saved[name])} but the model expects "
                                 f"{tuple(leaf.shape)}; check config.model against the run "
                                 "that wrote it")

    def restore(self, template):
        """(state placed like `template`, the data states of every process that saved it) of
        the latest readable checkpoint; an unreadable one is reported and the previous one
        used."""
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
            _as_dict(template))
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                self.check_shapes(step, template.params)
            except ValueError:
                raise
            except Exception as e:  # noqa: BLE001  (unreadable metadata: try an older one)
                log.error("checkpoint step %d is unreadable (%s); trying the previous one",
                          step, e)
                continue
            try:
                restored = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()))
            except Exception as e:  # noqa: BLE001
                log.error("checkpoint step %d could not be restored (%s); trying the previous "
                          "one", step, e)
                continue
            log.info("restored checkpoint step %d of %s", step, self.directory)
            s = restored["state"]
            state = type(template)(s["step"], s["params"], s["opt_state"])
            return state, restored["data"]["processes"]
        raise ValueError(f"no readable checkpoint in {self.directory}")

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def save(self, step: int, state, data_state: dict, config: dict) -> None:
        """Start an asynchronous save of `step` (returns once the arrays are copied)."""
        data = {"processes": gather_json(data_state)}
        self.manager.save(step, force=True, args=ocp.args.Composite(
            state=ocp.args.StandardSave(_as_dict(state)), data=ocp.args.JsonSave(data),
            config=ocp.args.JsonSave(config)))

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

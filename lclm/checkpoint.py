"""Orbax checkpoints of the train state in `<workdir>/checkpoints`, and resume.

Saves every `checkpoint.every` steps (asynchronously: training continues while tensorstore
writes), keeps the last `checkpoint.keep`, and always saves the final step. Each process
writes its own shards. Parameters are saved in lclm's canonical layout (stacked layers,
original head order), which is independent of mesh, `scan_layers` and attention layout, so
a checkpoint restores onto any mesh. Loading reads tensorstore arrays and JSON only.
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


class Checkpoints:
    """The run's checkpoint directory (`every=0` keeps only the final save)."""

    def __init__(self, workdir: str, every: int, keep: int):
        self.every = every
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=True)
        self.manager = ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, "checkpoints")),
                                             options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def restore(self, template):
        """(state placed like `template`, this process's data-pipeline state) of the latest
        checkpoint."""
        step = self.manager.latest_step()
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), template)
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()))
        log.info("resumed from checkpoint step %d", step)
        data = restored["data"]["processes"][jax.process_index()]
        return restored["state"], data

    def maybe_save(self, step: int, state, data_state: dict, final: bool = False) -> bool:
        """Save at multiples of `every`, and at the final step."""
        if not final and (self.every <= 0 or step % self.every):
            return False
        data = {"processes": gather_json(data_state)}
        return self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data)), force=True)

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

"""Orbax checkpoints of the train state in `<workdir>/checkpoints`, and resume.

Saves every `checkpoint.every` steps (asynchronously: training continues while tensorstore
writes), keeps the last `checkpoint.keep`, and always saves the final step. Each process
writes its own shards. Parameters are saved in lclm's canonical layout (stacked layers,
original head order), which is independent of mesh, `scan_layers` and attention layout, so
a checkpoint restores onto any mesh. Loading reads tensorstore arrays and JSON only.
"""

from __future__ import annotations

import logging
import os

import jax
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


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
        """The latest saved state, placed like `template` (a pytree of arrays)."""
        step = self.manager.latest_step()
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), template)
        restored = self.manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
        log.info("resumed from checkpoint step %d", step)
        return restored["state"]

    def maybe_save(self, step: int, state, final: bool = False) -> bool:
        """Save at multiples of `every`, and at the final step."""
        if not final and (self.every <= 0 or step % self.every):
            return False
        return self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state)),
                                 force=True)

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

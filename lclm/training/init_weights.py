"""Where a run's first weights come from when it does not resume: a HuggingFace directory
(`model.init_from_hf`) or another lclm run's latest checkpoint (`model.init_from_checkpoint`,
with its optimizer state where `train.optimizer_from_checkpoint`), with the model fields each
determines (shapes, token ids, positions, RoPE scaling). The weights are read into the run's
shardings; nothing is unpickled.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import jax

from lclm import hf
from lclm.checkpoint import (
    Checkpoints,
    ShapeMismatch,
    first_line,
    read_state_items,
    saved_config,
)
from lclm.config.model import ModelConfig
from lclm.errors import StartupError
from lclm.parallel.distributed import any_process
from lclm.training.state import TrainState, param_shardings
from lclm.training.step import restart_schedule

log = logging.getLogger(__name__)


def apply_hf_shapes(config) -> None:
    """Take the fields of `config.model` that `init_from_hf`'s config.json determines: shapes,
    token ids, max positions and, where `model.rope_scaling` is 'auto', the RoPE scaling.
    `model.rope_theta` stays the run's (long-context recipes raise it)."""
    source = hf.read_config(config.model.init_from_hf)
    config.model.update(hf.model_fields(dataclasses.asdict(source),
                                        rope_scaling=config.model.rope_scaling == "auto"))
    if source.rope_theta != config.model.rope_theta:
        log.info("model.rope_theta=%g replaces %s's rope_theta %g", config.model.rope_theta,
                 config.model.init_from_hf, source.rope_theta)


class SourceDamaged(StartupError):
    """The latest checkpoint of `model.init_from_checkpoint` cannot be read."""

    def __init__(self, workdir: str, step: int | None, why: str):
        self.workdir, self.step, self.why = workdir, step, why
        where = os.path.join(workdir, "checkpoints", "<step>" if step is None else str(step))
        super().__init__(
            f"model.init_from_checkpoint={workdir!r}: its latest checkpoint"
            f"{'' if step is None else f' (step {step})'} cannot be read ({why}); move {where} "
            "aside to start from that run's previous step, or point "
            "model.init_from_checkpoint at another run")


def apply_checkpoint_fields(config) -> None:
    """Take the fields of `config.model` that `init_from_checkpoint`'s saved config
    determines, as `apply_hf_shapes` does for HF weights: shapes, token ids, max positions
    and, where `model.rope_scaling` is 'auto', the RoPE scaling it trained with."""
    source = config.model.init_from_checkpoint
    try:
        _, saved = saved_config(source)
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001  (a damaged config item)
        raise SourceDamaged(source, None, first_line(e)) from None
    config.model.update(hf.model_fields(saved.get("model", {}),
                                        rope_scaling=config.model.rope_scaling == "auto"))


def load_hf_params(source: str, model: ModelConfig, mesh):
    """The weights of the HuggingFace directory `source` (`model.init_from_hf`) in the run's
    param dtype and shardings."""
    # each device's block is read from the files and placed where it belongs: the model is
    # never whole on one device nor on the host (13B in float32 is 52 GB)
    _, params = hf.load(source, shardings=param_shardings(model, mesh), dtype=model.param_dtype)
    log.info("initialised from %s (rope_theta %g)", source, model.rope_theta)
    return params


def load_checkpoint_state(source: str, carry: bool, template: TrainState) -> TrainState:
    """`template` with the latest parameters of the lclm run in `source`
    (`model.init_from_checkpoint`), and, where `carry` (`train.optimizer_from_checkpoint`),
    its optimizer state with the learning-rate schedule started again (Adam's moments and
    step count carry on: its bias correction stays that of a warmed-up optimizer). Placed
    like `template`."""
    items = {"params": template.params, **({"opt_state": template.opt_state} if carry else {})}
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            items)
    checkpoints = Checkpoints(source, keep=1)
    error, restored = None, None
    try:
        step = checkpoints.latest_step()
        if step is None:
            raise FileNotFoundError(f"model.init_from_checkpoint={source!r} has no checkpoint; "
                                    "point it at the workdir of a finished lclm run")
        try:
            checkpoints.check_shapes(step, template.params)
            restored = read_state_items(source, step, abstract)
        except ShapeMismatch:
            raise
        except Exception as e:  # noqa: BLE001  (truncated, garbage, missing files)
            error = e
    finally:
        checkpoints.close()
    if any_process(error is not None):  # every process stops, or none
        raise SourceDamaged(source, step, first_line(error) if error else
                            "unreadable on another process")
    assert restored is not None   # read above, or raised
    log.info("initialised from %s step %d%s", source, step,
             " with its optimizer state" if carry else "")
    if not carry:
        return template._replace(params=restored["params"])
    return template._replace(params=restored["params"],
                             opt_state=restart_schedule(restored["opt_state"]))

"""Where a run's first state comes from, decided here and nowhere else, and its reading:

1. this workdir's latest readable checkpoint: the run resumes (its config checked against the
   checkpoint's by `lclm.workdir.resume`, the parameter shapes against its metadata, before
   anything is initialised);
2. else another lclm run's latest checkpoint (`model.init_from_checkpoint`, with its optimizer
   state where `train.optimizer_from_checkpoint`);
3. else a HuggingFace directory (`model.init_from_hf`);
4. else the fresh initialisation from `seed`.

The model fields a source of weights fixes (shapes, token ids, positions, RoPE scaling) are
taken into a copy of the config before it is checked against the devices
(`take_model_fields`); the state itself once the workdir is the run's (`first_state`).
Another run's or HuggingFace's weights are read into the run's shardings; nothing is
unpickled.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import os

import jax

from lclm import hf
from lclm.config.model import ModelConfig
from lclm.config.run_config import RunConfig
from lclm.config.schema import Model
from lclm.errors import StartupError
from lclm.models.decoder import init_params
from lclm.parallel.distributed import any_process
from lclm.train.step import restart_schedule
from lclm.workdir.checkpoint import (
    Checkpoints,
    ShapeMismatch,
    first_line,
    read_state_items,
    saved_config,
)
from lclm.workdir.resume import allowed_keys, check_resume
from lclm.workdir.state import TrainState, init_state, param_shardings

log = logging.getLogger(__name__)

RESUME, OTHER_RUN, HUGGINGFACE, FRESH = "resume", "another run", "huggingface", "fresh"


@dataclasses.dataclass(frozen=True)
class Origin:
    """Where the first state comes from: `kind` (RESUME, OTHER_RUN, HUGGINGFACE or FRESH); for
    a resume the `step` whose config was checked (None where no step's config could be read:
    the restore sets the damaged steps aside) and whether the data pipeline starts afresh
    (`restart_data`: an allowed change of the data order, or a converted checkpoint)."""

    kind: str
    step: int | None = None
    restart_data: bool = False


def take_model_fields(config):
    """`config` with the fields of `config.model` that its source of weights determines
    taken: a HuggingFace directory's (`apply_hf_shapes`) or another run's
    (`apply_checkpoint_fields`); a new config (`config` stays as it was), or `config` itself
    where it starts from scratch.
    Before the config is checked: a resume is then compared with the config it will train.
    HuggingFace first, unlike `origin`: a later stage of a run started from HuggingFace keeps
    its `init_from_hf` beside the previous stage's `init_from_checkpoint`, and takes its fields
    from the HuggingFace directory but its weights from that checkpoint."""
    if config.model.init_from_hf:
        return apply_hf_shapes(config)
    if config.model.init_from_checkpoint:
        return apply_checkpoint_fields(config)
    return config


def apply_hf_shapes(config):
    """A copy of `config` with the fields of `config.model` that `init_from_hf`'s config.json
    determines: shapes, token ids, max positions and, where `model.rope_scaling` is 'auto',
    the RoPE scaling. `model.rope_theta` stays the run's (long-context recipes raise it)."""
    source = hf.read_config(config.model.init_from_hf)
    config = copy.deepcopy(config)
    config.model.update(
        hf.model_fields(
            dataclasses.asdict(source), rope_scaling=config.model.rope_scaling == "auto"
        )
    )
    if source.rope_theta != config.model.rope_theta:
        log.info(
            "model.rope_theta=%g replaces %s's rope_theta %g",
            config.model.rope_theta,
            config.model.init_from_hf,
            source.rope_theta,
        )
    return config


class SourceDamaged(StartupError):
    """The latest checkpoint of `model.init_from_checkpoint` cannot be read."""

    def __init__(self, workdir: str, step: int | None, why: str):
        self.workdir, self.step, self.why = workdir, step, why
        where = os.path.join(workdir, "checkpoints", "<step>" if step is None else str(step))
        super().__init__(
            f"model.init_from_checkpoint={workdir!r}: its latest checkpoint"
            f"{'' if step is None else f' (step {step})'} cannot be read ({why}); move {where} "
            "aside to start from that run's previous step, or point "
            "model.init_from_checkpoint at another run"
        )


def apply_checkpoint_fields(config):
    """A copy of `config` with the fields of `config.model` that `init_from_checkpoint`'s
    saved config determines, as `apply_hf_shapes` takes HF weights': shapes, token ids, max
    positions and, where `model.rope_scaling` is 'auto', the RoPE scaling it trained with."""
    source = config.model.init_from_checkpoint
    try:
        _, saved = saved_config(source)
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001  (a damaged config item)
        raise SourceDamaged(source, None, first_line(e)) from None
    config = copy.deepcopy(config)
    config.model.update(
        hf.model_fields(saved.get("model", {}), rope_scaling=config.model.rope_scaling == "auto")
    )
    return config


def origin(
    sections: RunConfig, checkpoints: Checkpoints, saved_config: dict, model: ModelConfig
) -> Origin:
    """Where the first state of the run `sections` (its config as checkpoints save it:
    `saved_config`) comes from, `checkpoints` being its workdir's. A resume this config may not
    make (ConfigError, `lclm.workdir.resume`) or whose parameter shapes are not `model`'s
    (ShapeMismatch, from the checkpoint's metadata) is refused here, before the model is
    initialised (a large one takes minutes and most of the memory) and before config.json,
    which describes the workdir's checkpoints, is rewritten."""
    if checkpoints.latest_step() is not None:
        latest = checkpoints.latest_config()
        if latest is None:
            return Origin(RESUME)
        step, saved = latest
        restart_data = check_resume(
            saved, saved_config, allowed_keys(sections.checkpoint.allow_changed), step
        )
        try:  # an allowed change (checkpoint.allow_changed) may still change a shape
            checkpoints.check_shapes(
                step, jax.eval_shape(functools.partial(init_params, model), jax.random.key(0))
            )
        except ShapeMismatch:
            raise
        except Exception as e:  # noqa: BLE001  (damaged metadata: the restore sets the step aside)
            log.debug("shapes of checkpoint step %d not checked before the restore (%s)", step, e)
        return Origin(RESUME, step, restart_data)
    return Origin(configured_source(sections.model))


def configured_source(model: Model) -> str:
    """OTHER_RUN, HUGGINGFACE or FRESH: where the weights of a run that does not resume come
    from, by its `model` section. Another run first: a later stage of a run started from
    HuggingFace keeps its `init_from_hf` beside the previous stage's `init_from_checkpoint`.
    The pre-flight check (`lclm.check.setup.initial_params`) asks here too, so both load the
    same weights."""
    if model.init_from_checkpoint:
        return OTHER_RUN
    if model.init_from_hf:
        return HUGGINGFACE
    return FRESH


def first_state(
    sections: RunConfig,
    checkpoints: Checkpoints,
    model: ModelConfig,
    mesh,
    optimizer,
    saved_config: dict,
) -> tuple[TrainState, dict | None]:
    """(state, data state) the run starts from, placed on `mesh` (`origin` decides where from;
    the data state is None where the data pipeline starts at its beginning)."""
    source = origin(sections, checkpoints, saved_config, model)
    state = init_state(model, optimizer, mesh, sections.seed)
    if source.kind == RESUME:
        return _resume(sections, checkpoints, state, saved_config, source)
    if source.kind == OTHER_RUN:
        state = load_checkpoint_state(
            sections.model.init_from_checkpoint, sections.train.optimizer_from_checkpoint, state
        )
    elif source.kind == HUGGINGFACE:
        state = state._replace(params=load_hf_params(sections.model.init_from_hf, model, mesh))
    return state, None


def _resume(
    sections: RunConfig,
    checkpoints: Checkpoints,
    template: TrainState,
    saved_config: dict,
    checked: Origin,
) -> tuple[TrainState, dict | None]:
    """The workdir's latest readable checkpoint, placed like `template`, and its data state
    unless the data pipeline starts afresh."""
    state, data_state = checkpoints.restore(template)
    restart_data = checked.restart_data
    restored = checkpoints.latest_step()  # the steps found damaged are set aside by now
    if restored is not None and restored != checked.step:
        # damage sent the restore to another step than the one checked: its own config
        # decides (an allowed change of the data order may lie between the two)
        saved = checkpoints.config_at(restored)
        restart_data = saved is not None and check_resume(
            saved, saved_config, allowed_keys(sections.checkpoint.allow_changed), restored
        )
    return state, None if restart_data else data_state


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
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), items
    )
    checkpoints = Checkpoints(source, keep=1)
    error, restored = None, None
    try:
        step = checkpoints.latest_step()
        if step is None:
            raise FileNotFoundError(
                f"model.init_from_checkpoint={source!r} has no checkpoint; "
                "point it at the workdir of a finished lclm run"
            )
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
        raise SourceDamaged(
            source, step, first_line(error) if error else "unreadable on another process"
        )
    assert restored is not None  # read above, or raised
    log.info(
        "initialised from %s step %d%s", source, step, " with its optimizer state" if carry else ""
    )
    if not carry:
        return template._replace(params=restored["params"])
    return template._replace(
        params=restored["params"], opt_state=restart_schedule(restored["opt_state"])
    )

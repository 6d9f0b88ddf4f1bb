"""What the pre-flight check runs: the config's mesh shrunk to the devices at hand, the
target and short lengths, the first weights a stage trains from, and rows of its real data
in original token order (`Run`).

Shapes: B rows (one or two), L the target length, S the short length, V the vocabulary.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import tempfile

import jax
import numpy as np
from ml_collections import ConfigDict

from lclm.config import MESH_AXES, ModelConfig
from lclm.config.run_config import RunConfig, run_config
from lclm.data.loader import HostBatches
from lclm.data.tokenizer import Tokenizer
from lclm.errors import ConfigError
from lclm.eval.model import restore_params
from lclm.models.decoder import init_params, param_count
from lclm.ops.context_parallel import strategy_of
from lclm.parallel.mesh import make_mesh
from lclm.train.first_weights import (
    HUGGINGFACE,
    OTHER_RUN,
    configured_source,
    load_hf_params,
    take_model_fields,
)
from lclm.train.startup_checks import check_data, validate
from lclm.workdir.layout import has_checkpoint, saved_steps
from lclm.workdir.state import param_shardings

MAX_ROWS = 2  # batch rows a check runs (the data axis of the shrunk mesh)
SHORT_FRACTION = 8  # the short length is about 1/8 of the target ...
MIN_SHORT = 256  # ... and at least this many tokens (while under half the target)
LARGE_MODEL = 1e9  # parameters above which a check on CPUs is announced as slow


@dataclasses.dataclass
class Run:
    """One stage as the check runs it."""

    sections: RunConfig  # the stage's config at length L, shrunk mesh, B rows
    model: ModelConfig
    mesh: jax.sharding.Mesh  # the shrunk mesh (the configured strategy runs on it)
    params: dict  # placed on `mesh`
    rows: dict[str, np.ndarray]  # `[B, L]` tokens/targets/loss_mask/positions/segment_ids
    short: int  # S
    weights: str  # where the weights came from, in words
    notes: list[str]  # what differs from the configured run, in words


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_mesh(config, available: int) -> dict[str, int]:
    """The mesh sizes the check runs `config` on with `available` devices: sp as configured
    where the devices allow (else its largest divisor that fits and the strategy accepts),
    then tp likewise, then up to `MAX_ROWS` devices on the configured data axis."""
    m, a = config.mesh, config.attention
    heads = config.model.n_heads
    want = {k: (available if m[k] == -1 else m[k]) for k in MESH_AXES}
    fits = lambda sp, tp: (
        sp * tp <= available and strategy_of(a).limits(heads=heads, tp=tp, sp=sp) is None
    )
    sp = max((d for d in divisors(want["sp"]) if fits(d, 1)), default=1)
    tp = max(d for d in divisors(want["tp"]) if fits(sp, d))
    data_axis = "fsdp" if want["fsdp"] > 1 else "dp"
    rows = min(MAX_ROWS, available // (sp * tp), want["dp"] * want["fsdp"])
    return dict(dp=1, fsdp=1, tp=tp, sp=sp) | {data_axis: rows}


def short_length(config, length: int, available: int) -> int:
    """S: about `length / SHORT_FRACTION`, at least `MIN_SHORT` while under half of `length`,
    doubled until the mesh and kernels accept it (`validate`)."""
    short = max(length // SHORT_FRACTION, min(MIN_SHORT, length // 2))
    while True:
        c = copy.deepcopy(config)
        c.data.seq_len = short
        try:
            validate(c, available)
            return short
        except ConfigError as e:
            if short * 2 >= length:
                raise ConfigError(
                    f"no short length up to {short} tokens that the mesh "
                    f"accepts ({e}); check a longer target (--length)"
                ) from None
            short *= 2


def config_for_check(config, length: int | None, available: int) -> tuple[ConfigDict, list[str]]:
    """(`config` as the check runs it, notes on what differs): the target length capped at
    `length`, the shrunk mesh, `MAX_ROWS` rows at most, no accumulation or validation, a
    scratch workdir (nothing is written); validated like a training start."""
    c = copy.deepcopy(config)
    notes = []
    if length and length < c.data.seq_len:
        notes.append(f"ran at {length} tokens (--length), not the configured {c.data.seq_len}")
        c.data.seq_len = length
    sizes = check_mesh(c, available)
    configured = {k: c.mesh[k] for k in MESH_AXES}
    if sizes != configured:
        notes.append(
            "mesh "
            + _sizes(sizes)
            + f" of {available} device(s) (configured "
            + _sizes(configured)
            + ")"
        )
    rows = math.prod(sizes[k] for k in ("dp", "fsdp"))
    c.mesh.update(sizes)
    c.data.batch_size, c.train.grad_accum = rows, 1
    c.validation.update(path="", lengths="", at_start=False)
    c.workdir = tempfile.gettempdir()
    try:
        validate(c, available)
    except ConfigError as e:
        raise ConfigError(
            f"checking at {c.data.seq_len} tokens on mesh {_sizes(sizes)}: {e}"
        ) from None
    check_data(c)
    return c, notes


def _sizes(sizes: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in sizes.items())


def weights_source(stage, first) -> tuple[ConfigDict, str]:
    """(`stage` with the weights the check loads, those weights in words). A later stage
    starts from its predecessor's checkpoint; before training there is none, and the first
    stage's initial weights stand in (with this stage's model settings: RoPE and the rest)."""
    c = copy.deepcopy(stage)
    source = c.model.init_from_checkpoint
    if source and stage is not first and not has_checkpoint(source):
        c.model.update(
            init_from_hf=first.model.init_from_hf,
            init_from_checkpoint=first.model.init_from_checkpoint,
        )
        what = _source_words(run_config(c))
        return c, f"{what} (the previous stage's checkpoint {source} does not exist yet)"
    return c, _source_words(run_config(c))


def _source_words(sections: RunConfig) -> str:
    m, kind = sections.model, configured_source(sections.model)
    if kind == OTHER_RUN:
        return f"checkpoint {m.init_from_checkpoint}"
    if kind == HUGGINGFACE:
        return f"HF {m.init_from_hf}"
    return f"random init (seed {sections.seed}): untrained"


def prepare(stage, first, length: int | None) -> Run:
    """The `Run` of `stage` (a training config; `first`: its schedule's first stage, or
    itself) on this machine's devices, capped at `length` tokens."""
    devices = jax.devices()
    c, weights = weights_source(stage, first)
    c = take_model_fields(c)
    c, notes = config_for_check(c, length, len(devices))
    sections = run_config(c)
    model = sections.model.resolved()
    if param_count(model) > LARGE_MODEL and devices[0].platform == "cpu":
        notes.append(
            f"{param_count(model) / 1e9:.1f}B parameters on CPUs: slow (minutes to "
            "hours); --length caps the target length"
        )
    mesh = make_mesh(**{k: c.mesh[k] for k in MESH_AXES}, devices=devices)
    tokenizer = Tokenizer(sections.data.tokenizer)
    tokenizer.check_fits(model.vocab_size)
    return Run(
        sections,
        model,
        mesh,
        initial_params(sections, model, mesh),
        first_rows(sections, tokenizer),
        short_length(c, c.data.seq_len, len(devices)),
        weights,
        notes,
    )


def initial_params(sections: RunConfig, model: ModelConfig, mesh) -> dict:
    """The weights training would start from, placed on `mesh`: the latest checkpoint of
    another run, HF weights, or the seeded random init (chosen as training chooses:
    `first_weights.configured_source`)."""
    source_kind = configured_source(sections.model)
    if source_kind == HUGGINGFACE:
        return load_hf_params(sections.model.init_from_hf, model, mesh)
    if source_kind == OTHER_RUN:
        source = sections.model.init_from_checkpoint
        steps = saved_steps(source)
        if not steps:
            raise FileNotFoundError(f"model.init_from_checkpoint={source!r} has no checkpoint")
        return restore_params(source, steps[-1], model, mesh)
    params = init_params(model, jax.random.key(sections.seed))
    return jax.device_put(params, param_shardings(model, mesh))


def first_rows(sections: RunConfig, tokenizer: Tokenizer) -> dict[str, np.ndarray]:
    """The first batch of the run's data (`[B, L]` arrays, original token order): what
    the run's first step trains on, read by the trainer's own loader."""
    one = make_mesh(devices=jax.devices()[:1])  # one shard: the layout is the original order
    reader = HostBatches(sections, one, tokenizer, prefetch=0)
    try:
        return reader.next_host_batch()
    finally:
        reader.close()

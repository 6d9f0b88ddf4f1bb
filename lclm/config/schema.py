"""The config schema: every section as a typed dataclass (each field's default, help, accepted
names and range: `fields.setting`), the model presets, and the checks a config can pass or
fail on its own (no devices, no other component).

Config files (`configs/*.py`) define `get_config()` returning `base_config()` with fields
changed (`apply_preset` fills a real model shape). `config.model` and `config.attention` are
`ModelConfig`/`AttentionConfig` (lclm.config.model), the one model schema. Every CLI's
`--help` lists `SECTIONS` (`lclm.cli.config_help`). The checks that need other components
(the mesh, kernels, strategies, data) are `lclm.train.startup_checks.validate`'s. No JAX
here: train.py reads the config before JAX starts.
"""

from __future__ import annotations

import dataclasses
import math

import ml_collections

from lclm.config.fields import (
    AT_LEAST_0,
    AT_LEAST_1,
    BELOW_1,
    FINITE_NON_NEGATIVE,
    FINITE_POSITIVE,
    FRACTION,
    fields_of,
    from_saved,
    setting,
)
from lclm.config.loading import field
from lclm.config.model import (
    REMAT_HELP,
    REMAT_POLICIES,
    ROPE_SCALINGS,
    AttentionConfig,
    ModelConfig,
)
from lclm.errors import ConfigError
from lclm.families import FAMILIES

# the device mesh's axes, outermost first (lclm.parallel.mesh builds the mesh in this order)
MESH_AXES = ("dp", "fsdp", "tp", "sp")
# kinds of data.path entries: the names of the registry lclm.data.sources.KINDS, which holds
# each kind's reader (the config is read below the data layer, so the names are repeated
# here; tests/data/test_kinds.py checks that they agree)
SOURCE_KINDS = ("text", "sharegpt", "tokenized", "line_retrieval", "ruler", "code", "code-heldout")
MIXTURE_UNITS = ("tokens", "documents")
LR_DECAYS = ("cosine", "linear", "constant")
WANDB_MODES = ("online", "offline", "disabled", "shared")  # wandb.init's modes
# what a stage after the first does with its predecessor's optimizer state
STAGE_OPTIMIZER = ("carry", "fresh")

# released models' shapes (and their tokenizers' bos/eos ids), each family's
# (lclm.families); a preset sets model.family too
MODEL_PRESETS = {
    name: dict(family=family.name, **fields)
    for family in FAMILIES.values()
    for name, fields in family.presets.items()
}


@dataclasses.dataclass(frozen=True)
class Run:
    """The run"""

    workdir: str = setting(
        "runs/default",
        "where checkpoints, metrics and the config go (a local path, gs:// or s3://)",
    )
    workdir_lease_minutes: float = setting(
        10.0,
        "the workdir lock is a lease its run renews; one not renewed for this long (a "
        "dead host, a requeued job) may be taken over by the next run (lclm.workdir.lock)",
        rule=FINITE_POSITIVE,
    )
    storage_patience_seconds: float = setting(
        300.0,
        "how long checkpoint saves and metrics writes may keep failing (a full disk, an "
        "unreachable bucket) while they are retried; then the run stops (exit 3), what it "
        "saved intact (lclm.train.write_patience)",
        rule=FINITE_NON_NEGATIVE,
    )
    seed: int = setting(0, "of the first weights and the data order")
    compile_cache: str = setting(
        "~/.cache/lclm/jax",
        "JAX's persistent compilation cache: a restart, resume or later "
        "stage of the same shapes loads the compiled step instead of compiling it again ('' "
        "turns it off; JAX_COMPILATION_CACHE_DIR wins; its programs are run, so keep it in a "
        "folder only you write: lclm.train.compile_cache)",
    )


@dataclasses.dataclass(frozen=True)
class Mesh:
    """The device mesh (its product: the devices; one axis may be -1: all the rest)"""

    dp: int = setting(1, "data parallel: batch split, weights replicated")
    fsdp: int = setting(1, "fully sharded data parallel: batch and weights split")
    tp: int = setting(1, "tensor parallel: heads and the feed-forward split")
    sp: int = setting(1, "sequence parallel: the sequence split, attention by attention.strategy")
    fit: bool = setting(
        False,
        "a mesh larger than the machine shrinks to fit (dp, then "
        "fsdp, tp, sp; lclm.parallel.mesh.fit_mesh) instead of stopping the "
        "run; the loss does not depend on the mesh (the demo sets it)",
    )


@dataclasses.dataclass(frozen=True)
class Model(ModelConfig):
    """The model: a decoder of one family (real shapes: lclm.config.MODEL_PRESETS,
    `apply_preset`)"""

    rope_scaling: str = setting(
        "auto",
        "the init_from_hf source's scaling ('auto'; none without a source), or one of these",
        choices=("auto", *ROPE_SCALINGS),
    )
    remat: str = setting(
        "attention",
        f"{REMAT_HELP}; 'auto': per stage, the first of none, "
        "attention, full, offload whose compiled step fits the device",
        choices=("auto", *REMAT_POLICIES),
    )
    init_from_hf: str = setting(
        "",
        "a HuggingFace directory of a family lclm knows: its "
        "shapes and weights start the run (model.rope_theta still "
        "applies: long-context recipes raise it)",
    )
    init_from_checkpoint: str = setting(
        "",
        "an lclm workdir: its latest parameters start the "
        "run (fresh optimizer); staged recipes chain their "
        "stages with it",
    )

    def __post_init__(self):
        """The section keeps 'auto' (ModelConfig resolves rope_scaling when a run reads its
        model; the training loop chooses the remat policy, lclm.train.remat_choice)."""

    def resolved(self) -> ModelConfig:
        """The model a run builds from this section ('auto' resolved)."""
        return from_saved(ModelConfig, dataclasses.asdict(self))


@dataclasses.dataclass(frozen=True)
class Data:
    """Training data"""

    source: str = setting("text", "data.path entries' default kind", choices=SOURCE_KINDS)
    path: str = setting(
        "",
        "comma-separated [kind:]path[@weight][?key=value&...] entries (a "
        "mixture); options per source: min_tokens, short_below + short_keep, "
        "long_above + long_repeat (docs/training.md, long documents)",
    )
    text_field: str = setting("text", "the field of a JSON record that holds its text")
    chat_template: str = setting(
        "vicuna",
        "how ShareGPT chats become text "
        "(lclm.data.chat.TEMPLATES), or 'tokenizer': the one "
        "data.tokenizer ships, rendered as transformers does",
    )
    tokenizer: str = setting("", "a SentencePiece model or a HuggingFace tokenizer directory")
    seq_len: int = setting(2048, "tokens per sequence", rule=AT_LEAST_1)
    batch_size: int = setting(8, "sequences per step", rule=AT_LEAST_1)
    document_mask: bool = setting(True, "packed documents do not attend to each other")
    reset_positions: bool = setting(True, "positions restart at each packed document")
    mixture_unit: str = setting(
        "tokens",
        "what a data.path weight shares out: 'tokens' (each "
        "source's share of the tokens trained on, whatever its "
        "documents' lengths, as ProLong's and Fu et al.'s mixtures are "
        "stated) or 'documents' (of the documents drawn)",
        choices=MIXTURE_UNITS,
    )
    balance: bool = setting(
        True,
        "the rows of a step go to devices and micro-batches so that "
        "each gets about the same attention work (its documents' squared "
        "lengths); only which device trains which row changes, never the "
        "rows or the loss",
    )


@dataclasses.dataclass(frozen=True)
class Train:
    """The optimizer (AdamW with warm-up and cosine decay)"""

    steps: int = setting(1000, rule=AT_LEAST_1)
    lr: float = setting(3e-4, "peak learning rate", rule=FINITE_POSITIVE)
    min_lr_ratio: float = setting(0.1, "the cosine ends at lr x this", rule=FRACTION)
    warmup: int = setting(100, "steps of linear warm-up", rule=AT_LEAST_0)
    decay: str = setting(
        "cosine",
        "the learning rate after warm-up: to lr x min_lr_ratio at "
        "the last step by a cosine or a straight line, or 'constant' at lr",
        choices=LR_DECAYS,
    )
    optimizer_from_checkpoint: bool = setting(
        False,
        "with model.init_from_checkpoint: that run's optimizer state too (Adam's moments "
        "and step count carry on; the learning-rate schedule starts again); staged runs set it "
        "per stage (stages.optimizer)",
    )
    grad_accum: int = setting(1, "micro-batches per step", rule=AT_LEAST_1)
    clip: float = setting(
        1.0, "global gradient-norm clip", rule=FINITE_NON_NEGATIVE, note="0: no clipping"
    )
    weight_decay: float = setting(0.1, rule=FINITE_NON_NEGATIVE)
    b1: float = setting(0.9, rule=BELOW_1)
    b2: float = setting(0.95, rule=BELOW_1)
    max_bad_steps: int = setting(
        3, "the run stops after this many consecutive non-finite steps", rule=AT_LEAST_1
    )


@dataclasses.dataclass(frozen=True)
class Log:
    """Logging"""

    every: int = setting(10, "steps between metric lines", rule=AT_LEAST_1)
    wandb: bool = setting(False, "also log to Weights & Biases")
    wandb_project: str = setting("lclm")
    wandb_mode: str = setting(
        "online", "wandb's mode (the environment's WANDB_MODE wins)", choices=WANDB_MODES
    )
    progress: bool = setting(True, "a progress line between metric lines")


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """Checkpoints (Orbax, in the workdir)"""

    every: int = setting(
        0, "steps between saves", rule=AT_LEAST_0, note="0: no saves by step count"
    )
    every_minutes: float = setting(
        30.0,
        "training minutes between saves; a kill -9 or an OOM then loses at most this much",
        rule=FINITE_NON_NEGATIVE,
        note="0: no saves by time",
    )
    keep: int = setting(3, "checkpoints kept", rule=AT_LEAST_1)
    allow_changed: str = setting(
        "",
        "comma-separated config keys a resume may change from the "
        "config its checkpoints were written with (e.g. "
        '"data.batch_size"); the change is logged. See '
        "lclm.workdir.resume",
    )


@dataclasses.dataclass(frozen=True)
class Validation:
    """Held-out data: the mean loss over its first `batches` batches (the same ones every
    time), logged as val_loss every `every` steps and at the end"""

    path: str = setting("", "the data.path syntax; empty: none")
    every: int = setting(200, rule=AT_LEAST_1)
    batches: int = setting(4, rule=AT_LEAST_1)
    at_start: bool = setting(
        False,
        "also measure it before a fresh run's first step (a "
        "step-0 record in metrics.jsonl: what the run starts from; a "
        "stage's gate sets it)",
    )
    lengths: str = setting(
        "",
        "more sequence lengths to measure it at, each logged as "
        'val_loss@LEN, e.g. "2k,8k", or "stages": this stage\'s and every '
        "earlier stage's (a staged run then shows what it gained at its new "
        "length and whether it forgot the old ones); empty: data.seq_len "
        "only",
    )


@dataclasses.dataclass(frozen=True)
class Stages:
    """Staged context extension (lclm.config.stages: what a stage may set; lclm.train.stages
    runs them)"""

    list: tuple = setting(
        (),
        "the stages, each a dict of the config fields it changes "
        "(nested by section, e.g. dict(data=dict(seq_len='64k', path=...), "
        "model=dict(rope_theta=8e6), train=dict(lr=1e-5, steps=5000))) and "
        "of name, tokens, tokens_per_batch and optimizer; a field a stage "
        "leaves out keeps the previous stage's value. Set in a config "
        "file; empty: stages.schedule",
    )
    schedule: str = setting(
        "",
        'the one-line form: "seq_len:rope_theta:steps[:sp], ..." '
        "runs one stage after another, each from the previous one's final "
        "weights; empty (and no stages.list) = a single run",
    )
    tokens_per_batch: int = setting(
        0,
        "each stage's data.batch_size = this / its seq_len "
        "(0: data.batch_size throughout); a stage may set its own",
    )
    extend_lr: float = setting(
        0.0,
        "the one-line form: the peak learning rate of every stage after the first; 0 = train.lr",
        rule=FINITE_NON_NEGATIVE,
        note="0: the stages after the first use train.lr",
    )
    optimizer: str = setting(
        "carry",
        "what a stage after the first starts from besides its "
        "predecessor's weights: 'carry' its optimizer state (Adam's "
        "moments, as ProLong's second stage), 'fresh' a new one; a stage "
        "may set its own",
        choices=STAGE_OPTIMIZER,
    )


@dataclasses.dataclass(frozen=True)
class Extension:
    """What `python -m lclm.extend` measures of a staged context extension, before training
    and after (lclm.extend): loss by position on held-out long documents, passkey by depth, a
    RULER subset, the short-context loss, and the starting weights with YaRN at inference"""

    data: str = setting(
        "",
        "held-out long documents, one source in the data.path syntax "
        "(e.g. code-heldout:DIR); empty: validation.path",
    )
    lengths: str = setting(
        "stages",
        'lengths of the loss by position, e.g. "2k,8k,64k"; '
        "'stages': short_length, the starting weights' trained length and "
        "every stage's seq_len",
    )
    documents: int = setting(
        8,
        "held-out documents per length; a length with fewer long "
        "enough is refused before anything trains",
        rule=AT_LEAST_1,
    )
    buckets: int = setting(
        64,
        "equal position ranges of each length's loss (targets' ranges fall on their edges)",
        rule=AT_LEAST_1,
    )
    short_length: str = setting("2k", "the short-context loss's length (what the model kept)")
    trained_length: int = setting(
        0,
        "the context the starting weights count as trained at "
        "(the near positions' and YaRN's origin; a rehearsal below "
        "the model's own context lowers it)",
        rule=AT_LEAST_0,
        note="0: the starting weights' own",
    )
    passkey_samples: int = setting(2, "passkey prompts per depth bin", rule=AT_LEAST_1)
    passkey_depths: int = setting(5, "passkey depth bins", rule=AT_LEAST_1)
    ruler_tasks: str = setting(
        "niah_single_1,niah_multikey_1,vt,fwe",
        "the RULER subset (lclm.data.ruler.TASKS, comma-separated); empty: none",
    )
    ruler_samples: int = setting(4, "RULER prompts per task", rule=AT_LEAST_1)
    ruler_chat: bool = setting(
        False, "RULER prompts as a user turn of the tokenizer's chat template (an instruct model)"
    )
    yarn: bool = setting(
        True,
        "also the starting weights with YaRN at inference, scaled from "
        "their trained length to the final one (what training must beat)",
    )
    device: str = setting(
        "",
        "the accelerator the time plan is for (lclm.hardware: h100, "
        "h200, a100, v5p, ...); empty: this machine's first device (a CPU's "
        "matmul speed is measured)",
    )
    mfu: float = setting(
        0.3,
        "the share of the device's peak FLOP/s the time plan assumes for steps and forwards",
        rule=FRACTION,
    )
    compile_seconds: float = setting(
        30.0,
        "the time plan's seconds per program compiled (plan --compile prints the compile times)",
        rule=FINITE_NON_NEGATIVE,
    )


@dataclasses.dataclass(frozen=True)
class Targets:
    """What a context extension must reach, judged by `python -m lclm.extend` on its report
    (met, not met, or not measured); a negative value is not judged"""

    far_near: float = setting(
        1.0,
        "after training, at the final length: the mean loss over "
        "far_positions at most this x the mean over near_positions",
    )
    near_positions: str = setting(
        "",
        "START:END token positions, e.g. 4k:8k; empty: the "
        "second half of the starting weights' trained length",
    )
    far_positions: str = setting(
        "", "START:END, e.g. 32k:64k; empty: the second half of the final length"
    )
    passkey: float = setting(
        0.9, "after training: passkey accuracy at the final length at least this in every depth bin"
    )
    short_loss: float = setting(
        0.02,
        "after training: the loss at extension.short_length at "
        "most (1 + this) x the starting weights'",
    )
    ruler: float = setting(
        -1.0,
        "after training: RULER's average over extension.ruler_tasks "
        "at the final length at least this (percent)",
    )
    beat_yarn: bool = setting(
        True,
        "after training: the loss at the final length below the "
        "starting weights' with YaRN at inference (extension.yarn)",
    )


# section name -> its dataclass, in --help's order ("" holds the top-level fields)
SECTIONS: dict[str, type] = {
    "": Run,
    "mesh": Mesh,
    "model": Model,
    "attention": AttentionConfig,
    "data": Data,
    "train": Train,
    "log": Log,
    "checkpoint": Checkpoint,
    "validation": Validation,
    "stages": Stages,
    "extension": Extension,
    "targets": Targets,
}


def base_config() -> ml_collections.ConfigDict:
    """All fields with their defaults (a tiny model; presets fill real shapes)."""
    c = ml_collections.ConfigDict(dataclasses.asdict(Run()))
    for name, section in SECTIONS.items():
        if name:
            c[name] = ml_collections.ConfigDict(dataclasses.asdict(section()))
    return c


def apply_preset(config: ml_collections.ConfigDict, name: str) -> ml_collections.ConfigDict:
    """Set the model shape fields (and token ids) of `config.model` from `MODEL_PRESETS[name]`."""
    if name not in MODEL_PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; use one of {sorted(MODEL_PRESETS)}")
    config.model.update(MODEL_PRESETS[name])
    return config


def _fail(msg: str):
    raise ConfigError(msg)


def mesh_device_count(config) -> int | None:
    """Devices the mesh needs, or None when one axis is -1 (= all devices)."""
    sizes = [config.mesh[a] for a in MESH_AXES]
    return None if -1 in sizes else math.prod(sizes)


def _check_values(config) -> None:
    """Every declared field's accepted names and range (`fields.setting`)."""
    for name, section in SECTIONS.items():
        for f in fields_of(section):
            key = f"{name}.{f.name}" if name else f.name
            node, leaf = field(config, key)
            why = f.problem(node[leaf])
            if why is not None:
                _fail(f"{key}={node[leaf]!r}{why}")


def _check_rope_and_ids(m) -> None:
    if m.rope_scaling == "llama3" and not m.rope_high_freq_factor > m.rope_low_freq_factor:
        _fail(
            f"model.rope_high_freq_factor={m.rope_high_freq_factor!r} must be greater than "
            f"model.rope_low_freq_factor={m.rope_low_freq_factor!r} for llama3 RoPE scaling"
        )
    if not -1 <= m.bos_id < m.vocab_size:
        _fail(
            f"model.bos_id={m.bos_id!r} must be a token id below model.vocab_size="
            f"{m.vocab_size} (or -1: none)"
        )
    for i in m.eos_ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < m.vocab_size:
            _fail(
                f"model.eos_ids={tuple(m.eos_ids)!r}: {i!r} is not a token id below "
                f"model.vocab_size={m.vocab_size}"
            )


def check_fields(config) -> None:
    """Fail with a one-line ConfigError on the first field that is wrong on its own terms:
    a count below 1, a value out of range, an unknown name, a head shape that cannot be."""
    m = config.model
    _check_values(config)
    _check_rope_and_ids(m)
    if config.validation.at_start and not config.validation.path:
        _fail(
            "validation.at_start=True measures the held-out loss before the first step, but "
            "validation.path is empty; set validation.path, or validation.at_start=False"
        )
    if m.n_heads % m.n_kv_heads:
        _fail(f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads={m.n_kv_heads}")
    if m.head_dim and m.head_dim % 2:
        _fail(f"model.head_dim={m.head_dim} must be even (RoPE rotates pairs)")
    if not m.head_dim and (m.dim % m.n_heads or (m.dim // m.n_heads) % 2):
        _fail(
            f"model.dim={m.dim} must be n_heads={m.n_heads} x an even head dim (or set "
            "model.head_dim)"
        )

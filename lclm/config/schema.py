"""The config schema: every field with its default, the model presets, the accepted names,
and the checks a config can pass or fail on its own (no devices, no other component).

Config files (`configs/*.py`) define `get_config()` returning `base_config()` with fields
changed (`apply_preset` fills a real model shape). The `config.model` and `config.attention`
sections are built from the `LlamaConfig`/`AttentionConfig` dataclasses (lclm.config.model),
the one model schema. The checks that need other components (the mesh, kernels, data) are
`lclm.train.checks.validate`'s. No JAX here: train.py reads the config before JAX starts.
"""

from __future__ import annotations

import dataclasses
import math

import ml_collections

from lclm.config.files import field
from lclm.config.model import AttentionConfig, LlamaConfig
from lclm.errors import ConfigError

DTYPES = ("float32", "bfloat16")
# the device mesh's axes, outermost first (lclm.parallel.mesh builds the mesh in this order)
MESH_AXES = ("dp", "fsdp", "tp", "sp")
REMAT_POLICIES = ("none", "full", "attention", "offload", "dots", "dots_no_batch")
# the RoPE scalings lclm.models.llama computes; model.rope_scaling also takes "auto"
ROPE_SCALINGS = ("none", "linear", "llama3")
# kinds of data.path entries (lclm.data.loader reads each; line_retrieval is synthetic,
# generated: lclm/data/line_retrieval.py)
SOURCE_KINDS = ("text", "sharegpt", "tokenized", "line_retrieval")
# the one list of each: lclm.ops.layout and lclm.ops.context_parallel import them
LAYOUTS = ("striped", "contiguous", "zigzag")
STRATEGIES = ("ring", "all_gather", "ulysses", "usp")

# LLaMA shapes (and the tokenizer's bos/eos ids). 1b/3b are LLaMA-3.2 (1.24B / 3.2B params),
# 7b/13b are LLaMA-2 (bos 1, eos 2: the defaults).
MODEL_PRESETS = {
    "llama3_1b": dict(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                      ffn_dim=8192, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=True,
                      bos_id=128000, eos_ids=(128001,)),
    "llama3_3b": dict(vocab_size=128256, dim=3072, n_layers=28, n_heads=24, n_kv_heads=8,
                      ffn_dim=8192, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=True,
                      bos_id=128000, eos_ids=(128001,)),
    # the 1B model of Striped Attention, LLaMA-2 style: the issue-14 bench shape
    "striped_attention_1b": dict(vocab_size=32000, dim=2048, n_layers=22, n_heads=16,
                                 n_kv_heads=16, ffn_dim=5504, rope_theta=10000.0, norm_eps=1e-5,
                                 tie_embeddings=False),
    "llama2_7b": dict(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                      ffn_dim=11008, rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False),
    "llama2_13b": dict(vocab_size=32000, dim=5120, n_layers=40, n_heads=40, n_kv_heads=40,
                       ffn_dim=13824, rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False),
}


def base_config() -> ml_collections.ConfigDict:
    """All fields with their defaults (a tiny model; presets fill real shapes)."""
    c = ml_collections.ConfigDict()
    c.workdir = "runs/default"
    # the workdir lock is a lease its run renews; one not renewed for this long (a dead host,
    # a requeued job) may be taken over by the next run (lclm.train.lock)
    c.workdir_lease_minutes = 10.0
    c.seed = 0

    c.mesh = ml_collections.ConfigDict({axis: 1 for axis in MESH_AXES})

    c.model = ml_collections.ConfigDict({
        **dataclasses.asdict(LlamaConfig()),
        "rope_scaling": "auto",    # the init_from_hf source's scaling (none without a source)
        # a HuggingFace LLaMA directory: its shapes and weights start the run (model.rope_theta
        # still applies: long-context recipes raise it)
        "init_from_hf": "",
        # an lclm workdir: its latest parameters start the run (fresh optimizer); staged
        # recipes chain their stages with it
        "init_from_checkpoint": "",
    })

    c.attention = ml_collections.ConfigDict(dataclasses.asdict(AttentionConfig()))

    c.data = ml_collections.ConfigDict(dict(
        source="text",          # data.path entries' default kind: text|sharegpt|tokenized
        path="",                # comma-separated [kind:]path[@weight] entries (a mixture)
        text_field="text", chat_template="vicuna", tokenizer="",
        seq_len=2048, batch_size=8, document_mask=True, reset_positions=True))

    c.train = ml_collections.ConfigDict(dict(
        steps=1000, lr=3e-4, min_lr_ratio=0.1, warmup=100, grad_accum=1, clip=1.0,
        weight_decay=0.1, b1=0.9, b2=0.95,
        max_bad_steps=3))   # the run stops after this many consecutive non-finite steps

    c.log = ml_collections.ConfigDict(dict(
        every=10, wandb=False, wandb_project="lclm", wandb_mode="online", progress=True))

    c.checkpoint = ml_collections.ConfigDict(dict(
        every=0,              # steps between saves (0: none by step count)
        every_minutes=30.0,   # training minutes between saves (0: none by time); a kill -9
                              # or an OOM then loses at most this much
        keep=3,
        # comma-separated config keys a resume may change from the config its checkpoints were
        # written with (e.g. "data.batch_size"); the change is logged. See lclm.train.resume
        allow_changed=""))

    # held-out data (the data.path syntax; empty: none): the mean loss over its first `batches`
    # batches (the same ones every time) is logged as val_loss every `every` steps and at the end.
    # lengths: more sequence lengths to measure it at, each logged as val_loss@LEN, e.g.
    # "2k,8k", or "stages": this stage's and every earlier stage's (a staged run then shows what
    # it gained at its new length and whether it forgot the old ones); empty: data.seq_len only
    c.validation = ml_collections.ConfigDict(dict(path="", every=200, batches=4, lengths=""))

    # staged context extension (lclm.train.stages): "seq_len:rope_theta:steps, ..." runs one
    # stage after another, each from the previous one's final weights; empty = a single run.
    # extend_lr: the peak learning rate of every stage after the first (each fine-tunes its
    # predecessor's weights with a fresh optimizer); 0 = train.lr
    c.stages = ml_collections.ConfigDict(dict(schedule="", tokens_per_batch=0, extend_lr=0.0))
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


# Counts and sizes that must be >= 1; checked before anything divides by them (the mesh
# sizes are checked by resolve_mesh_shape, the first thing that reads them).
_POSITIVE = (
    "model.vocab_size", "model.dim", "model.n_layers", "model.n_heads", "model.n_kv_heads",
    "model.ffn_dim", "model.ffn_chunk", "model.loss_chunk", "model.rope_original_max_positions",
    "model.max_position_embeddings", "attention.q_chunk", "attention.kv_chunk",
    "attention.ulysses", "data.seq_len", "data.batch_size", "train.steps", "train.grad_accum",
    "train.max_bad_steps", "checkpoint.keep", "log.every", "validation.every",
    "validation.batches")

# field -> (accepted, the rule the message states); a nan fails every comparison
_RANGES = {
    "model.rope_theta": (lambda x: 0 < x < math.inf, "must be a finite number > 0"),
    "model.rope_factor": (lambda x: 0 < x < math.inf, "must be a finite number > 0"),
    "model.rope_low_freq_factor": (lambda x: 0 < x < math.inf, "must be a finite number > 0"),
    "model.rope_high_freq_factor": (lambda x: 0 < x < math.inf, "must be a finite number > 0"),
    "train.lr": (lambda x: 0 < x < math.inf, "must be a finite number > 0"),
    "train.clip": (lambda x: 0 <= x < math.inf, "must be a finite number >= 0 (0: no clipping)"),
    "train.b1": (lambda x: 0 <= x < 1, "must be in [0, 1)"),
    "train.b2": (lambda x: 0 <= x < 1, "must be in [0, 1)"),
    "train.weight_decay": (lambda x: 0 <= x < math.inf, "must be a finite number >= 0"),
    "train.min_lr_ratio": (lambda x: 0 <= x <= 1, "must be in [0, 1]"),
    "train.warmup": (lambda x: x >= 0, "must be >= 0"),
    "checkpoint.every": (lambda x: x >= 0, "must be >= 0 (0: no saves by step count)"),
    "checkpoint.every_minutes": (lambda x: 0 <= x < math.inf,
                                 "must be a finite number >= 0 (0: no saves by time)"),
    "workdir_lease_minutes": (lambda x: 0 < x < math.inf, "must be a finite number > 0"),
    "stages.extend_lr": (lambda x: 0 <= x < math.inf,
                         "must be a finite number >= 0 (0: the stages after the first use "
                         "train.lr)"),
}


def _value(config, key: str):
    node, name = field(config, key)
    return node[name]


def _check_values(config) -> None:
    for key in _POSITIVE:
        value = _value(config, key)
        if value < 1:
            _fail(f"{key}={value!r} must be >= 1")
    for key, (accepted, rule) in _RANGES.items():
        value = _value(config, key)
        if not accepted(value):
            _fail(f"{key}={value!r} {rule}")


def _check_rope_and_ids(m) -> None:
    if m.rope_scaling not in ("auto", *ROPE_SCALINGS):
        _fail(f"model.rope_scaling={m.rope_scaling!r}; use one of {('auto', *ROPE_SCALINGS)}")
    if m.rope_scaling == "llama3" and not m.rope_high_freq_factor > m.rope_low_freq_factor:
        _fail(f"model.rope_high_freq_factor={m.rope_high_freq_factor!r} must be greater than "
              f"model.rope_low_freq_factor={m.rope_low_freq_factor!r} for llama3 RoPE scaling")
    if not -1 <= m.bos_id < m.vocab_size:
        _fail(f"model.bos_id={m.bos_id!r} must be a token id below model.vocab_size="
              f"{m.vocab_size} (or -1: none)")
    for i in m.eos_ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < m.vocab_size:
            _fail(f"model.eos_ids={tuple(m.eos_ids)!r}: {i!r} is not a token id below "
                  f"model.vocab_size={m.vocab_size}")


def check_fields(config) -> None:
    """Fail with a one-line ConfigError on the first field that is wrong on its own terms:
    a count below 1, a value out of range, an unknown name, a head shape that cannot be."""
    m = config.model
    _check_values(config)
    for key in ("dtype", "param_dtype"):
        if m[key] not in DTYPES:
            _fail(f"model.{key}={m[key]!r}; use one of {DTYPES}")
    if m.remat not in REMAT_POLICIES:
        _fail(f"model.remat={m.remat!r}; use one of {REMAT_POLICIES}")
    _check_rope_and_ids(m)
    if config.attention.layout not in LAYOUTS:
        _fail(f"attention.layout={config.attention.layout!r}; use one of {LAYOUTS}")
    if config.attention.strategy not in STRATEGIES:
        _fail(f"attention.strategy={config.attention.strategy!r}; use one of {STRATEGIES}")
    if m.n_heads % m.n_kv_heads:
        _fail(f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads={m.n_kv_heads}")
    if m.dim % m.n_heads or (m.dim // m.n_heads) % 2:
        _fail(f"model.dim={m.dim} must be n_heads={m.n_heads} x an even head dim")

"""What a resumed run may change from the config its checkpoint was written with.

Checkpoints are layout-free, so the mesh, the attention kernel and layout, chunk sizes, remat
and logging may change freely between a run and its resume. The optimizer's hyperparameters
and the step count may change too: the schedule is a function of the step, so the new values
apply from the resumed step on (logged). The model's definition and the fields that fix the
data order (tokenizer, sources, sequence length, batch size, seed) may not: the resume stops
with one line naming them, unless `checkpoint.allow_changed` lists them (comma-separated
keys), in which case the change is logged, and a changed data-order field restarts the data
pipeline from the start of the new order (the saved position means nothing in another order).

A checkpoint that `lclm.convert --to-checkpoint` wrote (step 0, its config's `identity` names
the HuggingFace directory it came from) holds weights, not a training config: a run with its
own config trains from it when the config describes the same model (`WEIGHT_KEYS`, the fields
a source model fixes, as `model.init_from_hf` takes them) and the same tokenizer (compared by
what it does); RoPE theta and scaling and the parameter dtype are the run's (logged), as with
`init_from_hf`, but `rope_scaling='auto'`, which follows `init_from_hf` only, may not drop the
weights' scaling; everything else, the data order among it, is the run's and the data
pipeline starts at its beginning.

Every config key has exactly one class here (a test holds `CLASSES` to `base_config()`); keys
a checkpoint's config lacks (written by an older lclm) are not compared.
"""

from __future__ import annotations

import hashlib
import json
import logging

from lclm.config.fields import fields_of
from lclm.config.schema import Extension, Targets
from lclm.errors import ConfigError
from lclm.hf.config import SCALING_FIELDS, SOURCE_FIELDS

log = logging.getLogger(__name__)

FREE, SCHEDULE, DATA_ORDER, MODEL = "free", "schedule", "data order", "model"

_FREE = (
    "workdir",
    "workdir_lease_minutes",
    "storage_patience_seconds",
    "compile_cache",
    "attention.impl",
    "attention.layout",
    "attention.q_chunk",
    "attention.kv_chunk",
    "attention.strategy",
    "attention.ulysses",
    "mesh.dp",
    "mesh.fsdp",
    "mesh.tp",
    "mesh.sp",
    "mesh.fit",
    "checkpoint.every",
    "checkpoint.every_minutes",
    "checkpoint.keep",
    "checkpoint.allow_changed",
    "log.every",
    "log.progress",
    "log.wandb",
    "log.wandb_mode",
    "log.wandb_project",
    "model.remat",
    "model.scan_layers",
    "model.ffn_chunk",
    "model.loss_chunk",
    "model.dtype",
    "model.init_std",
    "model.init_from_hf",
    "model.init_from_checkpoint",
    "train.max_bad_steps",
    "train.grad_accum",
    "validation.path",
    "validation.every",
    "validation.batches",
    "validation.at_start",
    "validation.lengths",
    # a stage's own config (seq_len, steps, lr, init) is compared; these only derive it
    "stages.schedule",
    "stages.tokens_per_batch",
    "stages.extend_lr",
    "stages.list",
    "stages.optimizer",
    "train.optimizer_from_checkpoint",
    # which device trains which row of a step: the rows themselves and the loss are the same
    "data.balance",
    # what lclm.extend measures and judges once the training is done
    *(
        f"{name}.{f.name}"
        for name, section in (("extension", Extension), ("targets", Targets))
        for f in fields_of(section)
    ),
)
_SCHEDULE = (
    "train.steps",
    "train.lr",
    "train.warmup",
    "train.decay",
    "train.min_lr_ratio",
    "train.clip",
    "train.weight_decay",
    "train.b1",
    "train.b2",
)
_DATA_ORDER = (
    "seed",
    "data.source",
    "data.path",
    "data.text_field",
    "data.chat_template",
    "data.tokenizer",
    "data.seq_len",
    "data.batch_size",
    "data.mixture_unit",
)
_MODEL = (
    "model.family",
    "model.vocab_size",
    "model.dim",
    "model.head_dim",
    "model.n_layers",
    "model.n_heads",
    "model.n_kv_heads",
    "model.ffn_dim",
    "model.norm_eps",
    "model.param_dtype",
    "model.tie_embeddings",
    "model.bos_id",
    "model.eos_ids",
    "model.max_position_embeddings",
    "model.rope_theta",
    "model.rope_scaling",
    "model.rope_factor",
    "model.rope_low_freq_factor",
    "model.rope_high_freq_factor",
    "model.rope_original_max_positions",
    "model.rope_beta_fast",
    "model.rope_beta_slow",
    "model.rope_attention_factor",
    "model.rope_truncate",
    "data.document_mask",
    "data.reset_positions",
)

# `identity` of a converted checkpoint: the HuggingFace directory its weights came from
CONVERTED_FROM = "converted_from"
# what converted weights fix (shapes, and what an export states again); the RoPE fields and
# param_dtype are the run's, as `model.init_from_hf` makes them
WEIGHT_KEYS = tuple(f"model.{name}" for name in SOURCE_FIELDS)
_RUNS_OWN = ("model.rope_theta", "model.param_dtype", *(f"model.{name}" for name in SCALING_FIELDS))

CLASSES = {
    key: cls
    for keys, cls in (
        (_FREE, FREE),
        (_SCHEDULE, SCHEDULE),
        (_DATA_ORDER, DATA_ORDER),
        (_MODEL, MODEL),
    )
    for key in keys
}

# Text whose token ids tell two tokenizers apart: letters, digits, spaces, punctuation, code
# and non-Latin scripts (a path may stay the same while the file behind it changes).
_PROBE = (
    "The quick brown fox jumps over 13 lazy dogs, 2,048 times!\n\tdef f(x): return "
    "x ** 2  # ok\nÜber café naïve — 東京 москва 123.45e-6 "
)


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of what `tokenizer` does (its vocabulary size and the ids of a probe)."""
    ids = [tokenizer.vocab_size, *tokenizer.encode(_PROBE)]
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


_MISSING = object()


def _value(tree: dict, key: str):
    node = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return list(node) if isinstance(node, tuple) else node


def _head_dim(tree: dict):
    """model.head_dim as the weights have it (0 means dim / n_heads), and whether it is
    that default: a default one follows dim and n_heads, which are compared themselves."""
    value, dim, heads = (_value(tree, f"model.{k}") for k in ("head_dim", "dim", "n_heads"))
    if _MISSING in (dim, heads):
        return value, True
    derived = dim // heads
    return (derived if value in (0, _MISSING) else value), value in (0, _MISSING, derived)


def changes(saved: dict, current: dict) -> dict[str, tuple]:
    """key -> (saved value, current value) for every classified key that differs; the
    tokenizer is compared by fingerprint where both configs have one (`identity`)."""
    differing = {}
    for key in CLASSES:
        old, new = _value(saved, key), _value(current, key)
        if key == "model.head_dim":
            (old, old_default), (new, new_default) = _head_dim(saved), _head_dim(current)
            if old_default and new_default:
                continue
        if old is not _MISSING and new is not _MISSING and old != new:
            differing[key] = (old, new)
    old_fp = _value(saved, "identity.tokenizer")
    new_fp = _value(current, "identity.tokenizer")
    if old_fp is not _MISSING and new_fp is not _MISSING:
        differing.pop("data.tokenizer", None)  # a moved file is the same tokenizer
        if old_fp != new_fp:
            old_path, new_path = _value(saved, "data.tokenizer"), _value(current, "data.tokenizer")
            differing["data.tokenizer"] = (f"{old_path} ({old_fp})", f"{new_path} ({new_fp})")
    return differing


def allowed_keys(allow_changed: str) -> set[str]:
    """The keys of `checkpoint.allow_changed` (start-up validation checks that each names a
    config field)."""
    return {k.strip() for k in allow_changed.split(",") if k.strip()}


def check_resume(saved: dict, current: dict, allowed: set[str], step: int) -> bool:
    """Refuse (ConfigError, one line) a resume whose config changes a model or data-order key
    that `allowed` does not list; log every change. Returns whether the data pipeline must
    start afresh (an allowed data-order change, or a converted checkpoint)."""
    if _value(saved, f"identity.{CONVERTED_FROM}") is not _MISSING:
        return _check_converted(saved, current, allowed, step)
    differing = changes(saved, current)
    refused = [
        k for k, _ in differing.items() if CLASSES[k] in (MODEL, DATA_ORDER) and k not in allowed
    ]
    if refused:
        listed = "; ".join(f"{k} {differing[k][0]!r} -> {differing[k][1]!r}" for k in refused)
        raise ConfigError(
            f"the checkpoint (step {step}) was written with another config: {listed}; resume "
            "with the old values, use a new workdir (model.init_from_checkpoint starts from "
            "these weights), or allow the change with "
            f"--config.checkpoint.allow_changed={','.join(refused)}"
        )
    restart_data = False
    for key, (old, new) in differing.items():
        cls = CLASSES[key]
        if cls == FREE:
            log.info("resuming with %s %r (the checkpoint's run used %r)", key, new, old)
        elif cls == SCHEDULE:
            log.warning(
                "resuming with %s %r (was %r): the new value applies from step %d on",
                key,
                new,
                old,
                step + 1,
            )
        else:
            restart_data = restart_data or cls == DATA_ORDER
            log.warning(
                "resuming with %s %r (was %r), allowed by checkpoint.allow_changed%s",
                key,
                new,
                old,
                "; the data order restarts from its beginning" if cls == DATA_ORDER else "",
            )
    return restart_data


def _check_converted(saved: dict, current: dict, allowed: set[str], step: int) -> bool:
    """`check_resume` of a checkpoint that `lclm.convert --to-checkpoint` wrote: refuse a
    config that describes another model or tokenizer; the rest is the run's. Returns True:
    the data order starts at its beginning."""
    source = _value(saved, f"identity.{CONVERTED_FROM}")
    differing = {
        k: v for k, v in changes(saved, current).items() if k in WEIGHT_KEYS or k in _RUNS_OWN
    }
    refused = [k for k in differing if k in WEIGHT_KEYS]
    old_fp = _value(saved, "identity.tokenizer")
    new_fp = _value(current, "identity.tokenizer")
    if old_fp is not _MISSING and new_fp is not _MISSING and old_fp != new_fp:
        differing["data.tokenizer"] = (
            f"{_value(saved, 'data.tokenizer')} ({old_fp})",
            f"{_value(current, 'data.tokenizer')} ({new_fp})",
        )
        refused.append("data.tokenizer")
    scaling, new_scaling = (
        _value(saved, "model.rope_scaling"),
        _value(current, "model.rope_scaling"),
    )
    if new_scaling == "auto" and scaling not in ("none", _MISSING):
        # 'auto' takes a scaling from model.init_from_hf alone: here it would drop this one
        differing["model.rope_scaling"] = (scaling, "auto (none without init_from_hf)")
        refused.append("model.rope_scaling")
    elif new_scaling in ("auto", "none") and scaling in ("none", _MISSING):
        for key in ("model.rope_scaling", *(f"model.{name}" for name in SCALING_FIELDS)):
            differing.pop(key, None)  # no scaling either way: its factors apply to nothing
    refused = [k for k in refused if k not in allowed]
    if refused:
        listed = "; ".join(f"{k} {differing[k][0]!r} -> {differing[k][1]!r}" for k in refused)
        raise ConfigError(
            f"the checkpoint (step {step}) holds the weights converted from {source}, which "
            f"the config does not describe: {listed}; set these to the converted model's "
            "values (shapes must match; --config.checkpoint.allow_changed="
            f"{','.join(refused)} applies the config's value of any other)"
        )
    for key, (old, new) in differing.items():
        log.info(
            "training the weights converted from %s with %s %r (theirs: %r)", source, key, new, old
        )
    log.info(
        "starting from the weights converted from %s (step %d): the run's data, schedule "
        "and layout apply, the data order from its beginning",
        source,
        step,
    )
    return True

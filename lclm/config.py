"""The one typed configuration of lclm: defaults, model presets and start-up validation.

Config files (`configs/*.py`) define `get_config()` returning `base_config()` with fields
changed; `config_from_argv` reads `--config FILE --config.a.b=V`, which overrides any field:
train.py's command line and, through `parse_cli`, that of every other CLI. `validate` turns
every inconsistency into a `ConfigError` with a one-line message that names the fix; CLIs
print the message of any `StartupError` (its base) and exit with status 2.

This module does not import JAX (train.py reads the config before JAX starts).
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import re
import sys
import tempfile

import ml_collections
from absl import flags
from ml_collections import config_flags

from lclm.errors import StartupError

DTYPES = ("float32", "bfloat16")
REMAT_POLICIES = ("none", "full", "attention", "offload", "dots", "dots_no_batch")
ROPE_SCALINGS = ("auto", "none", "linear", "llama3")  # llama.ROPE_SCALINGS and "auto"
LAYOUTS = ("striped", "contiguous", "zigzag")  # lclm.ops.layout.LAYOUTS is checked against this in tests

# LLaMA shapes (and the tokenizer's bos/eos ids). 1b/3b are LLaMA-3.2 (1.24B / 3.2B params),
# 7b/13b are LLaMA-2 (bos 1, eos 2: the defaults).
MODEL_PRESETS = {
    "llama3_1b": dict(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                      ffn_dim=8192, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=True,
                      bos_id=128000, eos_ids=(128001,)),
    "llama3_3b": dict(vocab_size=128256, dim=3072, n_layers=28, n_heads=24, n_kv_heads=8,
                      ffn_dim=8192, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=True,
                      bos_id=128000, eos_ids=(128001,)),
    # the 1B model of Striped Attention (seed 000), LLaMA-2 style: the issue-14 bench shape
    "striped_attention_1b": dict(vocab_size=32000, dim=2048, n_layers=22, n_heads=16,
                                 n_kv_heads=16, ffn_dim=5504, rope_theta=10000.0, norm_eps=1e-5,
                                 tie_embeddings=False),
    "llama2_7b": dict(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                      ffn_dim=11008, rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False),
    "llama2_13b": dict(vocab_size=32000, dim=5120, n_layers=40, n_heads=40, n_kv_heads=40,
                       ffn_dim=13824, rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False),
}


class ConfigError(StartupError):
    """An invalid configuration; the message is one line that says how to fix it."""


def base_config() -> ml_collections.ConfigDict:
    """All fields with their defaults (a tiny model; presets fill real shapes)."""
    c = ml_collections.ConfigDict()
    c.workdir = "runs/default"
    c.seed = 0

    c.mesh = ml_collections.ConfigDict(dict(dp=1, fsdp=1, tp=1, sp=1))

    c.model = ml_collections.ConfigDict(dict(
        vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192,
        rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False, init_std=0.02,
        dtype="bfloat16", param_dtype="float32",
        scan_layers=True, remat="attention",
        ffn_chunk=2048,     # tokens per blockwise feed-forward chunk (per sp shard)
        loss_chunk=2048,    # tokens per blockwise cross-entropy chunk (per sp shard)
        init_from_hf="",    # a HuggingFace LLaMA directory: its shapes and weights start the
                            # run (model.rope_theta still applies: long-context recipes raise it)
        init_from_checkpoint="",  # an lclm workdir: its latest parameters start the run (fresh
                                  # optimizer); staged recipes chain their stages with it
        # RoPE frequency scaling applied over rope_theta: none | linear | llama3, or auto (the
        # init_from_hf source's scaling with its parameters; none without a source). The
        # factors are HF's rope_scaling fields (llama3: Llama-3.1's 8 / 1 / 4 / 8192)
        rope_scaling="auto", rope_factor=8.0, rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0, rope_original_max_positions=8192,
        # written to an export's config.json; init_from_hf takes them from the source
        bos_id=1,           # -1: none
        eos_ids=(2,),       # one or more end-of-sequence ids
        max_position_embeddings=4096,  # an export states max(this, data.seq_len trained)
    ))

    c.attention = ml_collections.ConfigDict(dict(
        impl="auto", layout="striped", q_chunk=512, kv_chunk=512))

    c.data = ml_collections.ConfigDict(dict(
        source="text",          # default kind of each data.path entry: text|sharegpt|tokenized
        path="",                # comma-separated [kind:]path[@weight] entries (a mixture)
        text_field="text", chat_template="vicuna", tokenizer="",
        seq_len=2048, batch_size=8, document_mask=True, reset_positions=True))

    c.train = ml_collections.ConfigDict(dict(
        steps=1000, lr=3e-4, min_lr_ratio=0.1, warmup=100, grad_accum=1, clip=1.0,
        weight_decay=0.1, b1=0.9, b2=0.95,
        max_bad_steps=3))   # the run stops after this many consecutive non-finite steps

    c.log = ml_collections.ConfigDict(dict(
        every=10, wandb=False, wandb_project="lclm", wandb_mode="online", progress=True))

    c.checkpoint = ml_collections.ConfigDict(dict(every=0, keep=3))  # every=0: final save only

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
    sizes = [config.mesh[a] for a in ("dp", "fsdp", "tp", "sp")]
    return None if -1 in sizes else math.prod(sizes)


# Counts and sizes that must be >= 1; checked before anything divides by them (the mesh
# sizes are checked by resolve_mesh_shape, the first thing that reads them).
_POSITIVE = (
    "model.vocab_size", "model.dim", "model.n_layers", "model.n_heads", "model.n_kv_heads",
    "model.ffn_dim", "model.ffn_chunk", "model.loss_chunk", "model.rope_original_max_positions",
    "model.max_position_embeddings", "attention.q_chunk",
    "attention.kv_chunk", "data.seq_len", "data.batch_size", "train.steps", "train.grad_accum",
    "train.max_bad_steps", "checkpoint.keep", "log.every")

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
    "checkpoint.every": (lambda x: x >= 0, "must be >= 0 (0: save at the end only)"),
    "stages.extend_lr": (lambda x: 0 <= x < math.inf,
                         "must be a finite number >= 0 (0: the stages after the first use "
                         "train.lr)"),
}


def _value(config, key: str):
    node, name = _field(config, key)
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


def _check_workdir(workdir: str) -> None:
    """Fail at start, not at the first save, when the run cannot write its workdir. Leaves
    nothing behind: the probe is a temporary file in the deepest directory that exists."""
    if not workdir:
        _fail("workdir is empty; set config.workdir to the run's directory")
    existing = os.path.abspath(workdir)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        _fail(f"workdir={workdir!r}: {existing!r} is not a directory; set config.workdir to a "
              "directory path")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        _fail(f"workdir={workdir!r}: cannot write in {existing!r} ({e.strerror}); set "
              "config.workdir to a writable directory")


def _check_rope_and_ids(m) -> None:
    if m.rope_scaling not in ROPE_SCALINGS:
        _fail(f"model.rope_scaling={m.rope_scaling!r}; use one of {ROPE_SCALINGS}")
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


def validate(config, device_count: int) -> dict[str, int]:
    """Check `config` against itself and `device_count`; returns the resolved mesh sizes."""
    m, a, d, t = config.model, config.attention, config.data, config.train
    _check_values(config)
    _check_workdir(config.workdir)
    from lclm.parallel.mesh import resolve_mesh_shape  # imports JAX: validate runs after start-up
    try:
        sizes = resolve_mesh_shape(**{k: config.mesh[k] for k in ("dp", "fsdp", "tp", "sp")},
                                   device_count=device_count)
    except ValueError as e:
        _fail(f"config.mesh: {e}")
    dp, fsdp, tp, sp = sizes["dp"], sizes["fsdp"], sizes["tp"], sizes["sp"]

    for key in ("dtype", "param_dtype"):
        if m[key] not in DTYPES:
            _fail(f"model.{key}={m[key]!r}; use one of {DTYPES}")
    if m.remat not in REMAT_POLICIES:
        _fail(f"model.remat={m.remat!r}; use one of {REMAT_POLICIES}")
    _check_rope_and_ids(m)
    if a.layout not in LAYOUTS:
        _fail(f"attention.layout={a.layout!r}; use one of {LAYOUTS}")
    from lclm.ops.attention import IMPLS
    if a.impl not in IMPLS:
        _fail(f"attention.impl={a.impl!r} is not available; use one of {IMPLS}")
    from lclm.data.chat import TEMPLATES
    from lclm.data.loader import SOURCE_KINDS
    if d.source not in SOURCE_KINDS:
        _fail(f"data.source={d.source!r}; use one of {SOURCE_KINDS}")
    if d.chat_template not in TEMPLATES:
        _fail(f"data.chat_template={d.chat_template!r}; use one of {sorted(TEMPLATES)}")
    if m.n_heads % m.n_kv_heads:
        _fail(f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads={m.n_kv_heads}")
    if m.dim % m.n_heads or (m.dim // m.n_heads) % 2:
        _fail(f"model.dim={m.dim} must be n_heads={m.n_heads} x an even head dim")
    if m.n_heads % tp:
        _fail(f"model.n_heads={m.n_heads} is not divisible by mesh.tp={tp}; "
              "pick a tp that divides the head count")
    from lclm.ops.ring_attention import kv_repeats  # the ring's own rule for K/V heads on tp
    try:
        kv_repeats(m.n_heads, m.n_kv_heads, tp)
    except ValueError:
        _fail(f"model.n_kv_heads={m.n_kv_heads} cannot be split over mesh.tp={tp}; "
              "pick a tp that divides or is a multiple of n_kv_heads")
    if m.ffn_dim % tp:
        _fail(f"model.ffn_dim={m.ffn_dim} is not divisible by mesh.tp={tp}")

    if d.seq_len % sp:
        _fail(f"data.seq_len={d.seq_len} is not divisible by mesh.sp={sp}; "
              f"use a multiple of {sp}")
    local = d.seq_len // sp
    # zigzag: each shard holds two runs of consecutive positions; tiles stay inside one
    runs = 2 if a.layout == "zigzag" and sp > 1 else 1
    if local % runs:
        _fail(f"data.seq_len={d.seq_len} is not divisible by 2 x mesh.sp = {2 * sp}, as "
              f"attention.layout='zigzag' needs; use a multiple of {2 * sp}")
    for key in ("q_chunk", "kv_chunk"):
        chunk = min(a[key], local // runs)
        if local % (chunk * runs):
            what = "2 x mesh.sp" if runs == 2 else "mesh.sp"
            _fail(f"data.seq_len={d.seq_len} is not divisible by {what} x attention.{key} = "
                  f"{runs * sp} x {chunk}; use a multiple of {runs * sp * chunk}")
    for key in ("ffn_chunk", "loss_chunk"):
        chunk = min(m[key], local)
        if local % chunk:
            _fail(f"data.seq_len={d.seq_len} is not divisible by mesh.sp x model.{key} = "
                  f"{sp} x {chunk}; use a multiple of {sp * chunk}")
    from lclm.ops.attention import kernel_limits  # the rules every platform shares
    why = kernel_limits(a.impl, head_dim=m.dim // m.n_heads, q_chunk=a.q_chunk,
                        kv_chunk=a.kv_chunk, block=local // runs, dtype=m.dtype)
    if why is not None:
        _fail(f"attention.impl={a.impl!r} cannot serve this model: {why}; "
              "attention.impl='auto' picks a kernel that can")
    if d.batch_size % t.grad_accum:
        _fail(f"data.batch_size={d.batch_size} is not divisible by train.grad_accum="
              f"{t.grad_accum}")
    micro = d.batch_size // t.grad_accum
    if micro % (dp * fsdp):
        _fail(f"micro-batch data.batch_size/train.grad_accum={micro} is not divisible by "
              f"mesh.dp x mesh.fsdp = {dp * fsdp}; change the batch size or the mesh")
    return sizes


def load_config(path: str, overrides: dict | None = None) -> ml_collections.ConfigDict:
    """`get_config()` of a config file, with `{"section.field": value}` overrides applied.

    For programs other than train.py (benchmarks, tests); a missing file, an unknown key or a
    value of the wrong type is a ConfigError.
    """
    import importlib.util

    spec = importlib.util.spec_from_file_location("lclm_user_config", path)
    if spec is None or not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} not found")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    for key, value in (overrides or {}).items():
        node, name = _field(config, key)
        try:
            node[name] = value
        except TypeError:
            raise ConfigError(f"config key {key}={value!r}: expected type "
                              f"{type(node[name]).__name__}") from None
    return config


def config_from_argv(argv: list[str], default: str,
                     runs_stages: bool = True) -> ml_collections.ConfigDict:
    """The config of a command line `PROG [--config FILE] [--config.a.b=V ...]` (ml_collections
    syntax: typed, locked against new keys); FILE defaults to `default`.

    Every mistake (missing file, unknown key, bad value, stray argument) is one ConfigError
    line; an unknown key names the closest existing one. When the program runs the stages of
    `stages.schedule` (`runs_stages`; the benchmarks measure the file's own fields instead),
    an override of a field that a stage replaces is one too.
    """
    path = _config_path(argv) or default
    known = load_config(path)
    for key in _override_keys(argv):
        _field(known, key)
    values = flags.FlagValues()
    holder = config_flags.DEFINE_config_file("config", path, "config file", flag_values=values,
                                             sys_argv=argv)
    try:
        rest = values(argv)
    except flags.UnrecognizedFlagError as e:
        raise ConfigError(f"{e}; set config fields with --config.<key>=<value>") from None
    except flags.Error as e:
        raise ConfigError(str(e)) from None
    if rest[1:]:
        raise ConfigError(f"unexpected arguments {rest[1:]}; pass only --config FILE and "
                          "--config.<key>=<value>")
    config = holder.value
    if runs_stages:
        _check_stage_overrides(config, _override_keys(argv))
    return config


def _check_stage_overrides(config, keys: list[str]) -> None:
    """An override of a key that every (or some) stage of `stages.schedule` replaces would
    be silently lost: refuse it (the schedule, where the stages are, is what to change)."""
    if not config.stages.schedule:
        return
    from lclm.train.stages import keys_set_by_stages  # no JAX: fine before start-up
    replaced = keys_set_by_stages(config)
    for key in keys:
        if key in replaced:
            raise ConfigError(f"config.{key} is {replaced[key]}")


def parse_cli(parser: argparse.ArgumentParser, argv: list[str] | None, default: str | None = None,
              runs_stages: bool = True) -> tuple[argparse.Namespace, ml_collections.ConfigDict]:
    """(the CLI's own arguments, its config) of `PROG --config FILE [--config.a.b=V ...]
    [the parser's own arguments]`: every CLI configures the run the way train.py does.

    `parser` defines only the CLI's own arguments; `--config` (required unless `default`) is
    added here. The `--config.*` arguments go to `config_from_argv` (its checks, its one-line
    errors) and are kept in `args.overrides`, to be passed on as they are (to child processes).
    """
    parser.add_argument("--config", metavar="FILE", default=default, required=default is None,
                        help="config file" + (f" (default {default})" if default else "")
                        + "; override its fields with --config.<key>=<value>")
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    for arg in rest:
        if arg.startswith("-") and not re.match(r"-{1,2}(?:no)?config\.|-[\d.]", arg):
            raise ConfigError(f"unrecognized argument {arg!r}; see --help (config fields: "
                              "--config.<key>=<value>)")
    args.overrides = rest
    return args, config_from_argv([parser.prog, "--config", args.config, *rest], args.config,
                                  runs_stages)


def _config_path(argv: list[str]) -> str | None:
    """FILE of `--config FILE` / `--config=FILE` (also with one dash, as absl allows)."""
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name in ("--config", "-config"):
            return value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return None


def _override_keys(argv: list[str]) -> list[str]:
    """`a.b` of every `--config.a.b=V`, `--config.a.b V` and boolean `--[no]config.a.b`."""
    found = (re.match(r"-{1,2}(?:no)?config\.([^=]+)", arg) for arg in argv)
    return [m.group(1) for m in found if m]


def _field(config, key: str) -> tuple[ml_collections.ConfigDict, str]:
    """(the section holding `key`, its last name); an unknown key is a ConfigError."""
    parts = key.split(".")
    node = config
    for i, part in enumerate(parts):
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            raise ConfigError(_unknown_key(parts, i, node))
        if i < len(parts) - 1:
            node = node[part]
    return node, parts[-1]


def _unknown_key(parts: list[str], i: int, node) -> str:
    """'unknown config key model.n_layer (did you mean model.n_layers?)'."""
    message = f"unknown config key {'.'.join(parts)}"
    names = list(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
    close = difflib.get_close_matches(parts[i], names, n=1)
    if close:
        return f"{message} (did you mean {'.'.join([*parts[:i], close[0], *parts[i + 1:]])}?)"
    if names:
        return f"{message} ({'.'.join(parts[:i]) or 'the config'} has {', '.join(sorted(names))})"
    return f"{message} ({'.'.join(parts[:i])} is a value, not a section)"


def parse_tokens(text: str) -> int:
    """A token count: '2k' -> 2048, '512' -> 512, '1m' -> 1048576 (k = 1024)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", text)
    if not m:
        raise ValueError(f"bad length {text!r}; use e.g. 512, 2k or 1m")
    n = int(float(m.group(1)) * {"": 1, "k": 1024, "m": 1024 ** 2}[m.group(2).lower()])
    if n < 1:
        raise ValueError(f"length {text!r} must be positive")
    return n

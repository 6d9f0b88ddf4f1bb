"""Staged context extension as configs: what a stage may set, the complete training config of
every stage, the keys the stages set (a command-line override of one would be lost), and the
lengths each stage validates at. Running the stages is lclm.train.stages'.

A stage is a record of what changes at its start, written in a config file as
`config.stages.list`: a dict of config fields nested by section, as the config itself is,

    dict(name="64k", tokens=20 * 10**9, tokens_per_batch=4 << 20,
         data=dict(seq_len="64k", path="code@0.3,books@0.3,short@0.4"),
         model=dict(rope_theta=8e6), train=dict(lr=1e-5, warmup=500, decay="cosine"))

plus keys of the stage's own (`STAGE_KEYS`): `name` (shown in logs), `tokens` (the stage's
length in tokens: train.steps = tokens / tokens per step, rounded up; or set train.steps),
`tokens_per_batch` (data.batch_size = this / seq_len), `optimizer` ('carry' or 'fresh': what
a stage after the first takes from its predecessor besides the weights, `stages.optimizer`
by default) and `gate` (what the stage must reach before the next starts:
lclm.train.gates). A field a stage leaves out keeps the previous stage's value
(the first stage's: the config's), so a stage says only what changes; `tokens`, `name` and
`optimizer` are the stage's alone. Any field may change but those that fix the weights'
shapes and where they come from (`FIXED`). The one-line form `stages.schedule`
("seq_len:rope_theta:steps[:sp], ...", with `stages.extend_lr` for the stages after the
first) is read into the same records.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

from lclm import storage
from lclm.config.loading import field, flat_items, set_field
from lclm.config.schema import STAGE_OPTIMIZER, Stages
from lclm.config.secrets import public_config
from lclm.config.syntax import parse_schedule, parse_tokens
from lclm.errors import ConfigError

STAGE_KEYS = ("name", "tokens", "tokens_per_batch", "optimizer", "gate")
# fields no stage may set: the weights' shapes and dtype (the next stage reads its
# predecessor's weights and optimizer state), where the first weights come from, the run's
# place and the stages themselves
FIXED = (
    "workdir",
    "model.family",
    "model.vocab_size",
    "model.dim",
    "model.n_layers",
    "model.n_heads",
    "model.n_kv_heads",
    "model.head_dim",
    "model.ffn_dim",
    "model.tie_embeddings",
    "model.norm_eps",
    "model.param_dtype",
    "model.init_from_hf",
    "model.init_from_checkpoint",
    "train.optimizer_from_checkpoint",
)
# fields whose values may be written as token counts ('64k')
_TOKEN_COUNTS = ("data.seq_len", "tokens", "tokens_per_batch")
STAGES = "stages"
# a stage's gate (evaluated by lclm.train.gates)
GATE_KEYS = ("short_loss", "ruler", "on_fail")
ON_FAIL = ("stop", "warn")
# a gate's RULER subset: what `python -m lclm.eval ruler` takes, scored on the stage's final
# checkpoint at `length` (default: the stage's seq_len)
GATE_RULER_KEYS = ("min_score", "tasks", "samples", "length", "seed", "chat", "batch_size")
GATE_RULER_DEFAULTS = dict(
    tasks="niah_single_1,niah_multikey_1,vt", samples=10, seed=42, chat=None, batch_size=None
)


def _check_dict(value, complete: bool, keys: tuple[str, ...], what: str, example: str) -> None:
    """`value` is a dict (`complete`: with what it needs) of `keys` only: else a one-line
    ConfigError naming `what` and an `example`."""
    if not isinstance(value, dict) or not complete:
        raise ConfigError(f"{what}={value!r} is not a dict such as {example}")
    unknown = sorted(set(value) - set(keys))
    if unknown:
        raise ConfigError(f"{what} key {unknown[0]!r} is unknown; it has {', '.join(keys)}")


def check_gate(gate, where: str) -> dict:
    """`gate` as written in a stage record, checked: a one-line ConfigError naming `where`."""
    _check_dict(
        gate, bool(gate), GATE_KEYS, f"{where}: gate", "dict(short_loss=0.02, on_fail='stop')"
    )
    if "short_loss" not in gate and "ruler" not in gate:
        raise ConfigError(
            f"{where}: the gate names nothing to reach; set short_loss (e.g. "
            "0.02: the short-length held-out loss at most 2% above the "
            "stage's start) or ruler (e.g. dict(min_score=80): RULER's "
            "average at the stage's length)"
        )
    if "short_loss" in gate:
        fraction = gate["short_loss"]
        if (
            isinstance(fraction, bool)
            or not isinstance(fraction, (int, float))
            or not math.isfinite(fraction)
            or fraction < 0
        ):  # NaN compares False
            raise ConfigError(f"{where}: gate short_loss={fraction!r} must be a finite number >= 0")
    if "ruler" in gate:
        _check_gate_ruler(gate["ruler"], where)
    if gate.get("on_fail", "stop") not in ON_FAIL:
        raise ConfigError(f"{where}: gate on_fail={gate['on_fail']!r}; use 'stop' or 'warn'")
    return gate


def _check_gate_ruler(spec, where: str) -> None:
    """A gate's `ruler` dict: its keys and their types (task names are checked with the
    tokenizer at start: lclm.train.stages)."""
    _check_dict(
        spec,
        isinstance(spec, dict) and "min_score" in spec,
        GATE_RULER_KEYS,
        f"{where}: gate ruler",
        "dict(min_score=80, tasks='niah_single_1,vt', samples=10)",
    )
    score = spec["min_score"]
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not 0 <= score <= 100:
        raise ConfigError(
            f"{where}: gate ruler min_score={score!r} must be a percentage (0-100), RULER's scale"
        )
    for key in ("samples", "seed", "batch_size"):
        value = spec.get(key)
        if value is not None and (
            isinstance(value, bool)
            or not isinstance(value, int)
            or value < (0 if key == "seed" else 1)
        ):
            raise ConfigError(f"{where}: gate ruler {key}={value!r} must be a positive integer")
    if not isinstance(spec.get("tasks", ""), str):
        raise ConfigError(
            f"{where}: gate ruler tasks={spec['tasks']!r} must be a comma-separated string"
        )
    if spec.get("chat") not in (None, "tokenizer"):
        raise ConfigError(
            f"{where}: gate ruler chat={spec['chat']!r}; use None (RULER's base "
            "prompts) or 'tokenizer' (its chat template)"
        )


def gate_ruler(gate: dict, seq_len: int) -> dict | None:
    """A gate's RULER subset with its defaults filled in (`length` the stage's `seq_len`
    unless it sets one), or None when it has none."""
    if "ruler" not in gate:
        return None
    spec = dict(GATE_RULER_DEFAULTS, **gate["ruler"])
    spec["length"] = parse_tokens(str(spec.get("length") or seq_len))
    return spec


def _flat(record: dict, where: str, prefix: str = "") -> dict[str, Any]:
    """{dotted key: value} of a stage record nested by section."""
    flat: dict[str, Any] = {}
    for key, value in record.items():
        if not isinstance(key, str):
            raise ConfigError(f"{where}: key {key!r} is not a field name")
        if isinstance(value, dict) and not (prefix == "" and key in STAGE_KEYS):
            flat.update(_flat(value, where, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _token_count(value, key: str, where: str) -> int:
    try:
        if isinstance(value, str):
            return parse_tokens(value)
        if isinstance(value, bool) or not float(value).is_integer() or value < 1:
            raise ValueError
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(
            f"{where}: {key}={value!r} is not a token count (e.g. 65536 or '64k')"
        ) from None


def stage_records(config) -> list[dict[str, Any]]:
    """Each stage as {dotted config key or stage key: value}, from `stages.list` or the
    one-line `stages.schedule` ([] for a single run). Keys are checked here: an unknown or
    fixed one is a ConfigError naming the stage."""
    listed, schedule = tuple(config.stages.list), config.stages.schedule
    if listed and schedule.strip():
        raise ConfigError(
            "config.stages.list and config.stages.schedule are both set; a run "
            "has one list of stages: keep one of them"
        )
    if not listed:
        records: list[dict[str, Any]] = []
        stages = parse_schedule(schedule)
        if not stages:
            _check_no_stage_settings(config)
        any_sp = any(stage.sp for stage in stages)
        for i, stage in enumerate(stages):
            record: dict[str, Any] = {
                "data.seq_len": stage.seq_len,
                "model.rope_theta": stage.rope_theta,
                "train.steps": stage.steps,
            }
            if any_sp:  # a stage without sp runs on the config's mesh.sp
                record["mesh.sp"] = stage.sp or config.mesh.sp
            if i and config.stages.extend_lr:
                record["train.lr"] = config.stages.extend_lr
            records.append(record)
        return records
    records = []
    for i, entry in enumerate(listed):
        where = f"config.stages.list[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(
                f"{where} is {type(entry).__name__}, not a dict of the fields the "
                "stage sets (e.g. dict(data=dict(seq_len='64k'), train="
                "dict(steps=100)))"
            )
        record = _flat(entry, where)
        for key in record:
            if key in STAGE_KEYS:
                continue
            if key in FIXED or key.startswith("stages."):
                raise ConfigError(
                    f"{where} sets {key}, which no stage may change (the weights' "
                    "shape, their source and the stages are the run's); set it "
                    "in the config outside stages.list"
                )
            field(config, key)  # an unknown key: a ConfigError naming the closest one
        if "tokens" in record and "train.steps" in record:
            raise ConfigError(
                f"{where} sets both tokens and train.steps; a stage's length is one of them"
            )
        if "gate" in record:
            check_gate(record["gate"], where)
        if i == 0 and "optimizer" in record:
            raise ConfigError(
                f"{where} sets optimizer, but the first stage has no predecessor "
                "to take an optimizer from"
            )
        if record.get("optimizer", "carry") not in STAGE_OPTIMIZER:
            raise ConfigError(
                f"{where}: optimizer={record['optimizer']!r}; use one of {STAGE_OPTIMIZER}"
            )
        for key in _TOKEN_COUNTS:
            if key in record:
                record[key] = _token_count(record[key], key, where)
        records.append(record)
    return records


def _check_no_stage_settings(config) -> None:
    """A run without stages (an empty `stages.list` reads as none) would ignore the settings
    that only stages use: one set is a ConfigError rather than a run that looks staged."""
    unset = Stages()
    for key in ("tokens_per_batch", "extend_lr", "optimizer"):
        value, default = config.stages[key], getattr(unset, key)
        if value != default:
            raise ConfigError(
                f"stages.{key}={value!r} is set but the run has no stages "
                "(stages.list and stages.schedule are empty); list the stages, "
                f"or set stages.{key}={default!r} for a single run"
            )


def _unstaged(config):
    """A copy of `config` with every `stages` field at its default: what a stage's config
    starts from (a stage is a single run; the stage settings were applied to it)."""
    base = copy.deepcopy(config)
    base.stages.update(dataclasses.asdict(Stages()))
    return base


def stage_name(record: dict, index: int) -> str:
    return str(record.get("name") or index)


def stage_workdir(config, index: int, seq_len: int) -> str:
    return storage.join(config.workdir, f"stage{index}_{seq_len}")


def stage_configs(config) -> list:
    """One complete training config per stage (chained through `model.init_from_checkpoint`;
    `train.optimizer_from_checkpoint` where the stage carries its predecessor's optimizer)."""
    records = stage_records(config)
    base = _unstaged(config)
    tokens_per_batch = config.stages.tokens_per_batch
    warmup = config.train.warmup  # as set, before a short stage clamps it
    configs: list = []
    for i, record in enumerate(records):
        where = f"stage {stage_name(record, i)}"
        c = copy.deepcopy(configs[-1] if configs else base)
        for key, value in record.items():
            if key not in STAGE_KEYS:
                set_field(c, key, value, f"{where}:")
        tokens_per_batch = int(record.get("tokens_per_batch", tokens_per_batch))
        seq_len = c.data.seq_len
        if tokens_per_batch:
            if tokens_per_batch % seq_len:
                raise ConfigError(
                    f"tokens_per_batch={tokens_per_batch} is not a multiple of "
                    f"{where}'s seq_len={seq_len}"
                )
            c.data.batch_size = tokens_per_batch // seq_len
        if "tokens" in record:
            c.train.steps = math.ceil(int(record["tokens"]) / (c.data.batch_size * seq_len))
        if "train.warmup" in record:
            warmup = int(record["train.warmup"])
            if warmup and warmup >= c.train.steps:
                raise ConfigError(
                    f"{where} sets train.warmup={warmup}, not below its "
                    f"{c.train.steps} steps: its learning rate would never reach "
                    "train.lr; set a shorter warm-up or more steps (or tokens)"
                )
        # a warm-up the stage inherits is clamped: the stage reaches its peak by its last step
        c.train.warmup = min(warmup, c.train.steps - 1)
        c.workdir = stage_workdir(config, i, seq_len)
        # 'stages' names lengths only the schedule knows: this stage's and the earlier ones'
        lengths = [*(s.data.seq_len for s in configs), seq_len]
        c.validation.lengths = ",".join(
            ",".join(map(str, lengths)) if item.strip() == STAGES else item
            for item in config.validation.lengths.split(",")
        )
        if "short_loss" in record.get("gate", {}):
            # judged against the held-out loss of the stage's first weights
            if not c.validation.path:
                raise ConfigError(f"{where}'s gate compares held-out losses; set validation.path")
            c.validation.at_start = True
        if configs:  # weights come from the previous stage, not from HF
            c.model.init_from_checkpoint = configs[-1].workdir
            c.train.optimizer_from_checkpoint = (
                record.get("optimizer", config.stages.optimizer) == "carry"
            )
        configs.append(c)
    return configs


def keys_set_by_stages(config) -> dict[str, str]:
    """{config key that a stage replaces: why, and what to change instead} of a staged config
    ({} without stages). A command-line override of one of these keys would be silently
    replaced by the stages (train.warmup is only clamped, so it is not one of them)."""
    records = stage_records(config)
    if not records:
        return {}
    if config.stages.schedule.strip():
        every = "set by every stage of stages.schedule"
        change = "change the schedule (stages.schedule=...) instead"
        keys = {
            k: f"{every}; {change}" for k in ("data.seq_len", "model.rope_theta", "train.steps")
        }
        with_sp = [str(i) for i, s in enumerate(parse_schedule(config.stages.schedule)) if s.sp]
        if with_sp:
            keys["mesh.sp"] = (
                f"set by stage{'s' if len(with_sp) > 1 else ''} "
                f"{', '.join(with_sp)} of stages.schedule "
                f"(seq_len:rope_theta:steps:sp); {change}"
            )
        if config.stages.tokens_per_batch:
            keys["data.batch_size"] = (
                f"{every} (stages.tokens_per_batch // seq_len); change "
                "stages.tokens_per_batch instead"
            )
        return keys
    setters: dict[str, list[str]] = {}
    for i, record in enumerate(records):
        derived = [k for k in record if k not in STAGE_KEYS]
        if "tokens" in record:
            derived.append("train.steps")
        if "tokens_per_batch" in record or config.stages.tokens_per_batch:
            derived.append("data.batch_size")
        for key in derived:
            setters.setdefault(key, []).append(str(i))
    return {
        key: (
            f"set by stage{'s' if len(who) > 1 else ''} {', '.join(who)} of stages.list "
            "(a stage keeps it for the stages after it); change it there instead"
        )
        for key, who in setters.items()
    }


# what a stage's config holds to chain it to the others (not what its step computes)
CHAINING = (
    "workdir",
    "model.init_from_checkpoint",
    "train.optimizer_from_checkpoint",
    "validation.lengths",
)


def stage_changes(config) -> list[dict[str, Any]]:
    """Per stage, {dotted key: resolved value} of every field where the stage's config
    differs from `config` (secrets left out); [] without stages."""
    configs = stage_configs(config)
    base = _unstaged(config)
    flat_base = dict(flat_items(public_config(base)))
    return [
        {
            key: value
            for key, value in flat_items(public_config(c))
            if flat_base.get(key, object()) != value
        }
        for c in configs
    ]


def stage_lines(config) -> list[str]:
    """`stages[i].key=value` lines of every field each stage resolves to a value other than
    the config's: what `--print-config` adds for a staged config."""
    lines = []
    for i, (record, changed) in enumerate(zip(stage_records(config), stage_changes(config))):
        lines.append(f"# stage {i}" + (f" ({record['name']})" if record.get("name") else ""))
        lines += [f"stages[{i}].{key}={value!r}" for key, value in changed.items()]
    return lines


def validation_lengths(seq_len: int, lengths: str) -> list[int]:
    """The sequence lengths the held-out loss is measured at: `seq_len` (`data.seq_len`) and
    those of `lengths` (`validation.lengths`; 'stages' outside a schedule is the run's own
    length), ascending. A bad entry is a ConfigError naming the key."""
    found = {seq_len}
    for item in filter(None, (i.strip() for i in lengths.split(","))):
        if item == STAGES:
            continue
        try:
            found.add(parse_tokens(item))
        except ValueError as e:
            raise ConfigError(
                f"validation.lengths={lengths!r}: {e}, or "
                f"'{STAGES}' (this stage's and every earlier stage's)"
            ) from None
    return sorted(found)

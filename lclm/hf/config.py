"""HuggingFace `config.json` <-> lclm's ModelConfig, for every family lclm knows: the file's
`model_type` picks the family (`lclm.families`), whose defaults fill what the file
leaves out and whose fields an export writes.

Whatever a config.json asks for that lclm's decoder does not compute (another architecture,
biases the family lacks, an activation other than SiLU, sliding windows, RoPE scaling other
than linear/llama3/yarn) is refused with an HFFormatError naming the field, never silently
dropped.
"""

import json
import math

from lclm import storage
from lclm.config import ModelConfig
from lclm.config.model import yarn_mscale
from lclm.families import FAMILIES, Family, by_model_type, get_family
from lclm.hf.errors import HFFormatError

# float16 checkpoints are computed in float32
_TORCH_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float32"}


def _field(hf: dict, name: str, kind, default=None, where: str = ""):
    """`hf[name]` checked to be a positive `kind`; `default` where it is absent or null (a
    field without a default is required). `where` prefixes the name (`rope_scaling.`)."""
    value = hf.get(name)
    if value is None:
        if default is None:
            raise HFFormatError(f"config.json lacks required field {where + name!r}")
        return default
    # JSON true/false are Python ints: a bool is never a size
    if isinstance(value, bool) or not isinstance(value, kind) or value <= 0:
        what = "integer" if kind is int else "number"
        raise HFFormatError(
            f"config.json field {where + name!r} must be a positive {what}, not {value!r}"
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise HFFormatError(f"config.json field {where + name!r} must be finite, not {value!r}")
    return value


_NUMBER = (int, float)
_ROPE_THETA = 10000.0  # every family's transformers config assumes it where the file is silent


def family_of(hf: dict) -> Family:
    """The family of a config.json: its `model_type` (absent: LLaMA), checked against its
    `architectures`."""
    model_type = hf.get("model_type", "llama")
    family = by_model_type(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise HFFormatError(
            f"config.json model_type={model_type!r} is not supported; lclm "
            "implements model_type " + ", ".join(repr(f.model_type) for f in FAMILIES.values())
        )
    architectures = hf.get("architectures")
    if architectures is not None and architectures != [family.architecture]:
        raise HFFormatError(
            f"config.json architectures={architectures!r} is not supported for "
            f"model_type {model_type!r}; lclm implements "
            f"[{family.architecture!r}]"
        )
    return family


def _default(hf: dict, family: Family, name: str):
    """`hf[name]`, or what the family's transformers config assumes where it is absent."""
    return hf[name] if name in hf else family.hf_default(name)


def _check_supported(hf: dict, family: Family) -> None:
    """Refuse, naming the field, whatever config.json asks for that lclm's decoder does not
    compute for this family: loading it anyway would silently drop it."""
    if family.accepts_attention_bias and hf.get("attention_bias") and not family.qkv_bias:
        raise HFFormatError(
            f"config.json asks for attention_bias={hf['attention_bias']!r}, "
            f"which lclm's {family.name} layer lacks"
        )
    if hf.get("mlp_bias"):  # no family's feed-forward has biases: loading would drop them
        raise HFFormatError(
            f"config.json asks for mlp_bias={hf['mlp_bias']!r}, which lclm "
            "lacks (its feed-forward has no biases)"
        )
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):  # transformers' "swish" is the same function
        raise HFFormatError(
            f"config.json hidden_act={act!r} is not supported; lclm's "
            "feed-forward is SwiGLU (hidden_act 'silu')"
        )
    size = _default(hf, family, "sliding_window")
    layers = hf.get("layer_types")
    window = size not in (None, 0)
    if (
        hf.get("use_sliding_window")
        or (window and hf.get("use_sliding_window") is not False)
        or (isinstance(layers, list) and set(layers) - {"full_attention"})
    ):
        raise HFFormatError(
            f"config.json asks for sliding-window attention (sliding_window="
            f"{size!r}, use_sliding_window={hf.get('use_sliding_window')!r}"
            + (f", layer_types {sorted(set(layers))}" if isinstance(layers, list) else "")
            + "); lclm attends to the whole causal "
            "context: set sliding_window to null"
        )


def _rope_from_hf(hf: dict, family: Family) -> dict:
    """lclm's RoPE fields of a config.json in either layout: transformers 4 (`rope_theta` +
    `rope_scaling`) or 5 (`rope_parameters` with rope_type, rope_theta and the factors). Both
    versions let a non-empty `rope_scaling` win over `rope_parameters`."""
    for name in ("rope_scaling", "rope_parameters"):
        if hf.get(name) is not None and not isinstance(hf[name], dict):
            raise HFFormatError(
                f"config.json field {name!r} must be an object, not {hf[name]!r:.100}"
            )
    name = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    rope = hf.get(name) or {}
    where = name + "."
    nested = [k for k, v in rope.items() if isinstance(v, dict)]
    if nested:
        raise HFFormatError(
            f"config.json {where}{nested[0]} holds per-layer RoPE parameters, "
            "which lclm does not support"
        )
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = _field(rope, "rope_theta", _NUMBER, 0, where) or None
    top = _field(hf, "rope_theta", _NUMBER, 0) or None
    if theta and top and theta != top:
        raise HFFormatError(
            f"config.json rope_theta={top!r} and {where}rope_theta={theta!r} "
            "disagree (transformers 4 and 5 would use different ones)"
        )
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1:
        raise HFFormatError(
            f"config.json partial_rotary_factor={partial!r} is not supported; "
            "lclm rotates every head dimension"
        )
    fields = dict(rope_theta=float(theta or top or _ROPE_THETA), rope_scaling="none")
    if kind in (None, "default"):
        return fields
    if kind not in ("linear", "llama3", "yarn"):
        raise HFFormatError(
            f"config.json {where}rope_type={kind!r} is not supported; lclm "
            "implements RoPE scaling 'default', 'linear', 'llama3' and 'yarn'"
        )
    if kind == "yarn":
        fields.update(_yarn_from_hf(hf, rope, where, family))
        return fields
    fields.update(
        rope_scaling=kind, rope_factor=float(_field(rope, "factor", _NUMBER, None, where))
    )
    if kind == "llama3":
        low = _field(rope, "low_freq_factor", _NUMBER, None, where)
        high = _field(rope, "high_freq_factor", _NUMBER, None, where)
        if not high > low:
            raise HFFormatError(
                f"config.json {where}high_freq_factor={high!r} must be greater "
                f"than {where}low_freq_factor={low!r}"
            )
        # transformers 5 falls back to max_position_embeddings
        original = _field(
            rope, "original_max_position_embeddings", int, _max_positions(hf, family), where
        )
        fields.update(
            rope_low_freq_factor=float(low),
            rope_high_freq_factor=float(high),
            rope_original_max_positions=original,
        )
    return fields


def _max_positions(hf: dict, family: Family) -> int:
    return _field(hf, "max_position_embeddings", int, family.hf_default("max_position_embeddings"))


def _yarn_from_hf(hf: dict, rope: dict, where: str, family: Family) -> dict:
    """lclm's yarn fields of a config.json's RoPE object, with transformers' defaults: the
    original context falls back to max_position_embeddings, factor to max / original,
    beta_fast/slow to 32/1; an attention factor DeepSeek-style configs derive from mscale
    and mscale_all_dim is computed here (0: lclm's own default, from factor)."""
    positions = _max_positions(hf, family)
    original = _field(rope, "original_max_position_embeddings", int, positions, where)
    factor = _field(rope, "factor", _NUMBER, 0, where) or positions / original
    attention = _field(rope, "attention_factor", _NUMBER, 0, where)
    mscale, all_dims = (_field(rope, k, _NUMBER, 0, where) for k in ("mscale", "mscale_all_dim"))
    if not attention and mscale and all_dims and factor > 1:
        attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dims)
    truncate = rope.get("truncate", True)
    if not isinstance(truncate, bool):
        raise HFFormatError(
            f"config.json {where}truncate must be true or false, not {truncate!r:.100}"
        )
    return dict(
        rope_scaling="yarn",
        rope_factor=float(factor),
        rope_original_max_positions=original,
        rope_beta_fast=float(_field(rope, "beta_fast", _NUMBER, 0, where) or 32.0),
        rope_beta_slow=float(_field(rope, "beta_slow", _NUMBER, 0, where) or 1.0),
        rope_attention_factor=float(attention),
        rope_truncate=truncate,
    )


def _token_ids(hf: dict, family: Family) -> dict:
    """bos_id (-1: none) and eos_ids (a tuple: config.json may hold one id or a list)."""

    def token_id(name, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise HFFormatError(
                f"config.json field {name!r} must hold non-negative integer "
                f"token ids, not {hf[name]!r:.100}"
            )
        return value

    bos, eos = (_default(hf, family, name) for name in ("bos_token_id", "eos_token_id"))
    eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
    return dict(
        bos_id=-1 if bos is None else token_id("bos_token_id", bos),
        eos_ids=tuple(token_id("eos_token_id", i) for i in eos),
    )


def config_from_hf(hf: dict, **overrides) -> ModelConfig:
    """ModelConfig from a HuggingFace `config.json` dict of a family lclm knows (its
    `model_type`). The compute and parameter dtypes follow `torch_dtype` (float16 checkpoints
    are computed in float32). Whatever lclm cannot compute as the file asks (another
    architecture, biases, an activation other than SiLU, sliding windows, RoPE scaling other
    than linear/llama3/yarn, ...) raises HFFormatError naming the field."""
    if not isinstance(hf, dict):
        raise HFFormatError("config.json must hold a JSON object")
    family = family_of(hf)
    _check_supported(hf, family)
    n_heads = _field(hf, "num_attention_heads", int)
    dim = _field(hf, "hidden_size", int)
    head_dim = _field(hf, "head_dim", int, family.hf_default("head_dim") or dim // n_heads)
    if head_dim % 2:
        raise HFFormatError(f"config.json head_dim={head_dim} is odd; RoPE rotates pairs")
    n_kv_heads = _field(hf, "num_key_value_heads", int, n_heads)
    if n_heads % n_kv_heads:
        raise HFFormatError(
            "config.json num_attention_heads is not a multiple of num_key_value_heads"
        )
    dtype = _TORCH_DTYPES.get(str(hf.get("torch_dtype", hf.get("dtype", "float32"))), "float32")
    fields = dict(
        family=family.name,
        vocab_size=_field(hf, "vocab_size", int),
        dim=dim,
        head_dim=head_dim,
        n_layers=_field(hf, "num_hidden_layers", int),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        ffn_dim=_field(hf, "intermediate_size", int),
        norm_eps=float(_field(hf, "rms_norm_eps", _NUMBER, family.hf_default("rms_norm_eps"))),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=_max_positions(hf, family),
        dtype=dtype,
        param_dtype=dtype,
        **_rope_from_hf(hf, family),
        **_token_ids(hf, family),
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def read_config(hf_dir: str, **overrides) -> ModelConfig:
    """`config_from_hf` of `hf_dir/config.json` (local, gs:// or s3://), every failure one line
    naming the directory."""
    path = storage.join(hf_dir, "config.json")
    if not storage.isfile(path):
        raise FileNotFoundError(
            f"{hf_dir!r} has no config.json; expected a HuggingFace model directory"
        )
    raw = storage.read_bytes(path)
    try:
        hf = json.loads(raw)
    except (ValueError, RecursionError) as e:  # undecodable bytes, bad or absurdly nested JSON
        raise HFFormatError(f"{path!r} is not valid JSON ({e})") from None
    try:
        return config_from_hf(hf, **overrides)
    except ValueError as e:
        raise HFFormatError(f"{hf_dir!r}: {e}") from None


def rope_to_hf(c: ModelConfig) -> dict:
    """The RoPE fields of a config.json for `c`, in both layouts: `rope_theta` + `rope_scaling`
    (transformers 4) and `rope_parameters` (transformers 5)."""
    scaling = None
    if c.rope_scaling != "none":
        scaling = {"rope_type": c.rope_scaling, "factor": c.rope_factor}
        if c.rope_scaling == "llama3":
            scaling.update(
                low_freq_factor=c.rope_low_freq_factor,
                high_freq_factor=c.rope_high_freq_factor,
                original_max_position_embeddings=c.rope_original_max_positions,
            )
        if c.rope_scaling == "yarn":
            scaling.update(
                original_max_position_embeddings=c.rope_original_max_positions,
                beta_fast=c.rope_beta_fast,
                beta_slow=c.rope_beta_slow,
                truncate=c.rope_truncate,
            )
            if c.rope_attention_factor:
                scaling.update(attention_factor=c.rope_attention_factor)
    parameters = {"rope_type": "default", "rope_theta": c.rope_theta, **(scaling or {})}
    return {"rope_theta": c.rope_theta, "rope_scaling": scaling, "rope_parameters": parameters}


def config_to_hf(c: ModelConfig) -> dict:
    """The config.json of an export of `c`, which transformers 4 and 5 both read as `c`'s
    family (its model_type, architecture and the fields that make its layer lclm's)."""
    eos = list(c.eos_ids)
    family = get_family(c.family)
    return {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.dim,
        "intermediate_size": c.ffn_dim,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.norm_eps,
        **rope_to_hf(c),
        "tie_word_embeddings": c.tie_embeddings,
        **family.hf_fields,
        "bos_token_id": None if c.bos_id < 0 else c.bos_id,
        "eos_token_id": (eos[0] if len(eos) == 1 else eos) if eos else None,
        "torch_dtype": c.param_dtype,
    }


# what a checkpoint determines: its shapes and what an export must state again
SOURCE_FIELDS = (
    "family",
    "vocab_size",
    "dim",
    "head_dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "ffn_dim",
    "norm_eps",
    "tie_embeddings",
    "bos_id",
    "eos_ids",
    "max_position_embeddings",
)
SCALING_FIELDS = (
    "rope_scaling",
    "rope_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_positions",
    "rope_beta_fast",
    "rope_beta_slow",
    "rope_attention_factor",
    "rope_truncate",
)


def model_fields(fields: dict, rope_scaling: bool = True) -> dict:
    """The fields of `config.model` that a source model determines, taken from its model
    fields (an HF checkpoint's `ModelConfig` as a dict, or an lclm checkpoint's saved
    `model`): shapes, token ids, max positions and (with `rope_scaling`) its RoPE scaling.
    Never rope_theta: the run's `model.rope_theta` applies over the source's. JSON lists
    come back as tuples."""
    keep = SOURCE_FIELDS + (SCALING_FIELDS if rope_scaling else ())
    return {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items() if k in keep}

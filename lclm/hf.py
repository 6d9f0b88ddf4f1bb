"""HuggingFace LLaMA directories (config.json + safetensors) in and out.

RoPE convention: lclm applies RoPE in HuggingFace's *rotate-half* form (the first and second
halves of each head's dims form the rotation pairs). HuggingFace LLaMA checkpoints already
store q/k projections permuted for that form (`convert_llama_weights_to_hf.py` permutes Meta's
interleaved-pair weights), so weights are copied without any permutation in either direction.
Meta's original `consolidated.*.pth` checkpoints use interleaved pairs and must first be
converted by HuggingFace's script (lclm never loads pickled .pth files).

Only JSON and safetensors are read: nothing is unpickled or executed.
"""

from __future__ import annotations

import json
import math
import os
import re

import jax.numpy as jnp
import numpy as np

from lclm.errors import StartupError
from lclm.models.llama import LlamaConfig

_LAYER = "model.layers.{i}."
_TORCH_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float32"}


class HFFormatError(StartupError):
    """A HuggingFace directory that lclm refuses to load. The message is one line that names
    the file and, where one is at fault, the tensor."""


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
        raise HFFormatError(f"config.json field {where + name!r} must be a positive {what}, "
                            f"not {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise HFFormatError(f"config.json field {where + name!r} must be finite, not {value!r}")
    return value


_NUMBER = (int, float)
# what transformers' LlamaConfig assumes where config.json is silent
_HF_DEFAULTS = dict(rope_theta=10000.0, max_position_embeddings=2048, bos_token_id=1,
                    eos_token_id=2)


def _check_supported(hf: dict) -> None:
    """Refuse, naming the field, whatever config.json asks for that lclm's LLaMA does not
    compute: loading it anyway would silently drop it."""
    model_type = hf.get("model_type", "llama")
    if model_type != "llama":
        raise HFFormatError(f"config.json model_type={model_type!r} is not supported; lclm "
                            "implements LLaMA (model_type 'llama') only")
    architectures = hf.get("architectures")
    if architectures is not None and architectures != ["LlamaForCausalLM"]:
        raise HFFormatError(f"config.json architectures={architectures!r} is not supported; "
                            "lclm implements ['LlamaForCausalLM'] only")
    for name in ("attention_bias", "mlp_bias"):
        if hf.get(name):  # lclm's layers have no biases: loading would silently drop them
            raise HFFormatError(f"config.json asks for {name}={hf[name]!r}, which lclm lacks "
                                "(its layers have no biases)")
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):  # transformers' "swish" is the same function
        raise HFFormatError(f"config.json hidden_act={act!r} is not supported; lclm's "
                            "feed-forward is SwiGLU (hidden_act 'silu')")
    if hf.get("use_sliding_window") or (
            hf.get("sliding_window") not in (None, 0) and hf.get("use_sliding_window") is not False):
        raise HFFormatError(f"config.json asks for sliding-window attention (sliding_window="
                            f"{hf.get('sliding_window')!r}, use_sliding_window="
                            f"{hf.get('use_sliding_window')!r}); lclm attends to the whole "
                            "causal context")


def _rope_from_hf(hf: dict) -> dict:
    """lclm's RoPE fields of a config.json in either layout: transformers 4 (`rope_theta` +
    `rope_scaling`) or 5 (`rope_parameters` with rope_type, rope_theta and the factors). Both
    versions let a non-empty `rope_scaling` win over `rope_parameters`."""
    for name in ("rope_scaling", "rope_parameters"):
        if hf.get(name) is not None and not isinstance(hf[name], dict):
            raise HFFormatError(f"config.json field {name!r} must be an object, not "
                                f"{hf[name]!r:.100}")
    name = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    rope = hf.get(name) or {}
    where = name + "."
    nested = [k for k, v in rope.items() if isinstance(v, dict)]
    if nested:
        raise HFFormatError(f"config.json {where}{nested[0]} holds per-layer RoPE parameters, "
                            "which lclm does not support")
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = _field(rope, "rope_theta", _NUMBER, 0, where) or None
    top = _field(hf, "rope_theta", _NUMBER, 0) or None
    if theta and top and theta != top:
        raise HFFormatError(f"config.json rope_theta={top!r} and {where}rope_theta={theta!r} "
                            "disagree (transformers 4 and 5 would use different ones)")
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1:
        raise HFFormatError(f"config.json partial_rotary_factor={partial!r} is not supported; "
                            "lclm rotates every head dimension")
    fields = dict(rope_theta=float(theta or top or _HF_DEFAULTS["rope_theta"]),
                  rope_scaling="none")
    if kind in (None, "default"):
        return fields
    if kind not in ("linear", "llama3"):
        raise HFFormatError(f"config.json {where}rope_type={kind!r} is not supported; lclm "
                            "implements RoPE scaling 'default', 'linear' and 'llama3'")
    fields.update(rope_scaling=kind, rope_factor=float(_field(rope, "factor", _NUMBER, None,
                                                                where)))
    if kind == "llama3":
        low = _field(rope, "low_freq_factor", _NUMBER, None, where)
        high = _field(rope, "high_freq_factor", _NUMBER, None, where)
        if not high > low:
            raise HFFormatError(f"config.json {where}high_freq_factor={high!r} must be greater "
                                f"than {where}low_freq_factor={low!r}")
        # transformers 5 falls back to max_position_embeddings
        original = _field(rope, "original_max_position_embeddings", int,
                          _field(hf, "max_position_embeddings", int,
                                 _HF_DEFAULTS["max_position_embeddings"]), where)
        fields.update(rope_low_freq_factor=float(low), rope_high_freq_factor=float(high),
                      rope_original_max_positions=original)
    return fields


def _token_ids(hf: dict) -> dict:
    """bos_id (-1: none) and eos_ids (a tuple: config.json may hold one id or a list)."""
    def token_id(name, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise HFFormatError(f"config.json field {name!r} must hold non-negative integer "
                                f"token ids, not {hf[name]!r:.100}")
        return value

    bos = hf.get("bos_token_id", _HF_DEFAULTS["bos_token_id"])
    eos = hf.get("eos_token_id", _HF_DEFAULTS["eos_token_id"])
    eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
    return dict(bos_id=-1 if bos is None else token_id("bos_token_id", bos),
                eos_ids=tuple(token_id("eos_token_id", i) for i in eos))


def config_from_hf(hf: dict, **overrides) -> LlamaConfig:
    """LlamaConfig from a HuggingFace LLaMA `config.json` dict. The compute and parameter
    dtypes follow `torch_dtype` (float16 checkpoints are computed in float32). Whatever lclm
    cannot compute as the file asks (another architecture, biases, an activation other than
    SiLU, sliding windows, RoPE scaling other than linear/llama3, ...) raises HFFormatError
    naming the field."""
    if not isinstance(hf, dict):
        raise HFFormatError("config.json must hold a JSON object")
    _check_supported(hf)
    n_heads = _field(hf, "num_attention_heads", int)
    dim = _field(hf, "hidden_size", int)
    head_dim = _field(hf, "head_dim", int, dim // n_heads)
    if head_dim * n_heads != dim:
        raise HFFormatError(f"config.json head_dim={head_dim} x num_attention_heads={n_heads} "
                            f"!= hidden_size={dim} is not supported")
    n_kv_heads = _field(hf, "num_key_value_heads", int, n_heads)
    if n_heads % n_kv_heads:
        raise HFFormatError("config.json num_attention_heads is not a multiple of "
                            "num_key_value_heads")
    dtype = _TORCH_DTYPES.get(str(hf.get("torch_dtype", hf.get("dtype", "float32"))), "float32")
    fields = dict(
        vocab_size=_field(hf, "vocab_size", int), dim=dim,
        n_layers=_field(hf, "num_hidden_layers", int), n_heads=n_heads, n_kv_heads=n_kv_heads,
        ffn_dim=_field(hf, "intermediate_size", int),
        norm_eps=float(_field(hf, "rms_norm_eps", _NUMBER, 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=_field(hf, "max_position_embeddings", int,
                                       _HF_DEFAULTS["max_position_embeddings"]),
        dtype=dtype, param_dtype=dtype, **_rope_from_hf(hf), **_token_ids(hf))
    fields.update(overrides)
    return LlamaConfig(**fields)


def read_config(hf_dir: str, **overrides) -> LlamaConfig:
    """`config_from_hf` of `hf_dir/config.json`, every failure one line naming the directory."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{hf_dir!r} has no config.json; expected a HuggingFace LLaMA "
                                "directory")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        hf = json.loads(raw)
    except (ValueError, RecursionError) as e:  # undecodable bytes, bad or absurdly nested JSON
        raise HFFormatError(f"{path!r} is not valid JSON ({e})") from None
    try:
        return config_from_hf(hf, **overrides)
    except ValueError as e:
        raise HFFormatError(f"{hf_dir!r}: {e}") from None


def rope_to_hf(c: LlamaConfig) -> dict:
    """The RoPE fields of a config.json for `c`, in both layouts: `rope_theta` + `rope_scaling`
    (transformers 4) and `rope_parameters` (transformers 5)."""
    scaling = None
    if c.rope_scaling != "none":
        scaling = {"rope_type": c.rope_scaling, "factor": c.rope_factor}
        if c.rope_scaling == "llama3":
            scaling.update(low_freq_factor=c.rope_low_freq_factor,
                           high_freq_factor=c.rope_high_freq_factor,
                           original_max_position_embeddings=c.rope_original_max_positions)
    parameters = {"rope_type": "default", "rope_theta": c.rope_theta, **(scaling or {})}
    return {"rope_theta": c.rope_theta, "rope_scaling": scaling, "rope_parameters": parameters}


def config_to_hf(c: LlamaConfig) -> dict:
    eos = list(c.eos_ids)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": c.vocab_size, "hidden_size": c.dim, "intermediate_size": c.ffn_dim,
        "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads, "head_dim": c.head_dim, "hidden_act": "silu",
        "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.norm_eps,
        **rope_to_hf(c),
        "tie_word_embeddings": c.tie_embeddings, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": None if c.bos_id < 0 else c.bos_id,
        "eos_token_id": (eos[0] if len(eos) == 1 else eos) if eos else None,
        "torch_dtype": c.param_dtype,
    }


def hf_shapes(c: LlamaConfig) -> dict:
    """HuggingFace tensor name -> the shape `c` implies for it."""
    D, F, V = c.dim, c.ffn_dim, c.vocab_size
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not c.tie_embeddings:
        shapes["lm_head.weight"] = (V, D)
    for i in range(c.n_layers):
        p = _LAYER.format(i=i)
        shapes.update({
            p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
            p + "self_attn.q_proj.weight": (q, D), p + "self_attn.k_proj.weight": (kv, D),
            p + "self_attn.v_proj.weight": (kv, D), p + "self_attn.o_proj.weight": (D, q),
            p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
            p + "mlp.down_proj.weight": (D, F)})
    return shapes


# bytes per element of every safetensors dtype; lclm's weights must be one of _FLOATS
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2,
             "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_FLOATS = ("F32", "BF16", "F16")
_MAX_HEADER = 100 << 20  # what safetensors itself accepts


def _tensor_entry(path: str, name: str, entry, data_size: int) -> tuple:
    """`(dtype, shape, begin, end)` of one header entry, checked to lie inside the data."""
    def bad(why):
        return HFFormatError(f"{path!r}: tensor {name!r} {why}")

    def ints(x, n=None):
        return (isinstance(x, list) and (n is None or len(x) == n)
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in x))

    if not isinstance(entry, dict) or entry.get("dtype") not in _ITEMSIZE:
        raise bad(f"has no known dtype (header entry {entry!r:.200})")
    if not ints(entry.get("shape")) or not ints(entry.get("data_offsets"), 2):
        raise bad("needs a shape and two data_offsets, all non-negative integers")
    dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
    if end > data_size:
        raise bad(f"has data_offsets [{begin}, {end}] past the end of the file's "
                  f"{data_size} data bytes (truncated file?)")
    need = _ITEMSIZE[dtype] * math.prod(shape)
    if end - begin != need:
        raise bad(f"has data_offsets [{begin}, {end}] ({end - begin} bytes) but {dtype} "
                  f"{list(shape)} needs {need} bytes")
    return dtype, shape, begin, end


def safetensors_header(path: str) -> dict:
    """name -> `(dtype, shape)` of the tensors in the safetensors file `path`, read without
    safetensors and checked so that whatever safetensors later reads lies inside the file.

    The format: an 8-byte little-endian header length N, N bytes of JSON mapping each
    tensor name to its dtype, shape and `data_offsets` (relative to the data after the
    header), then the data, which the tensors tile without gaps or overlaps."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise HFFormatError(f"{path!r} is {size} bytes: too short for a safetensors file")
        n = int.from_bytes(prefix, "little")
        if n > size - 8:
            raise HFFormatError(f"{path!r}: header claims {n} bytes but the file holds "
                                f"{size - 8} after the length (truncated or not safetensors)")
        if n > _MAX_HEADER:
            raise HFFormatError(f"{path!r}: header claims {n} bytes, over safetensors' limit "
                                f"of {_MAX_HEADER}")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise HFFormatError(f"{path!r}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise HFFormatError(f"{path!r}: header is not a JSON object")
    data_size = size - 8 - n
    entries = {name: _tensor_entry(path, name, entry, data_size)
               for name, entry in header.items() if name != "__metadata__"}
    cursor = 0
    for name, (_, _, begin, end) in sorted(entries.items(), key=lambda e: e[1][2:]):
        if begin != cursor:
            raise HFFormatError(f"{path!r}: tensor {name!r} starts at data byte {begin}, not "
                                f"{cursor} (tensors overlap or leave a gap)")
        cursor = end
    if cursor != data_size:
        raise HFFormatError(f"{path!r}: tensors end at data byte {cursor} of {data_size}")
    return {name: (dtype, shape) for name, (dtype, shape, _, _) in entries.items()}


def _weight_files(hf_dir: str) -> list:
    """The safetensors files of `hf_dir`: those its index names, or model.safetensors. An
    index may only name .safetensors files inside `hf_dir` (never a pickle, never a path)."""
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, "rb") as f:
            raw = f.read()
        try:
            weight_map = json.loads(raw)["weight_map"]
        except (ValueError, RecursionError, KeyError, TypeError) as e:
            raise HFFormatError(f"{index!r} has no valid weight_map ({type(e).__name__}: "
                                f"{e})") from None
        if not isinstance(weight_map, dict):
            raise HFFormatError(f"{index!r}: weight_map is not a JSON object")
        for tensor, name in weight_map.items():
            if not (isinstance(name, str) and name.endswith(".safetensors")
                    and os.path.basename(name) == name):
                raise HFFormatError(f"{index!r} maps tensor {tensor!r} to {name!r}; lclm reads "
                                    "only .safetensors files inside the directory")
            if not os.path.isfile(os.path.join(hf_dir, name)):
                raise HFFormatError(f"{index!r} maps tensor {tensor!r} to {name!r}, which "
                                    "does not exist")
        return [os.path.join(hf_dir, name) for name in sorted(set(weight_map.values()))]
    if os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
        return [os.path.join(hf_dir, "model.safetensors")]
    raise FileNotFoundError(f"no model.safetensors(.index.json) in {hf_dir!r}; lclm reads "
                            "safetensors only (never pickled .bin/.pth files)")


def _read_tensors(hf_dir: str, shapes: dict) -> dict:
    """The tensors named in `shapes` from `hf_dir`, each checked against its header (dtype,
    shape, bounds) before safetensors reads any data."""
    from safetensors import SafetensorError, safe_open

    where = {}
    for path in _weight_files(hf_dir):
        for name, (dtype, shape) in safetensors_header(path).items():
            if name in where:
                raise HFFormatError(f"{path!r}: tensor {name!r} is also in {where[name][0]!r}")
            where[name] = (path, dtype, shape)
    for name, shape in shapes.items():
        if name not in where:
            raise HFFormatError(f"{hf_dir!r} lacks tensor {name!r}")
        path, dtype, found = where[name]
        if found != shape:
            raise HFFormatError(f"{path!r}: tensor {name!r} has shape {list(found)} but "
                                f"config.json implies {list(shape)}")
        if dtype not in _FLOATS:
            raise HFFormatError(f"{path!r}: tensor {name!r} is {dtype}; weights must be "
                                f"{'/'.join(_FLOATS)}")
    tensors = {}
    for path in sorted({where[name][0] for name in shapes}):
        names = [name for name in shapes if where[name][0] == path]
        try:
            with safe_open(path, framework="flax") as f:
                tensors.update({name: f.get_tensor(name) for name in names})
        except SafetensorError as e:  # whatever safetensors checks beyond the header above
            raise HFFormatError(f"{path!r}: {e}") from None
    return tensors


def load(hf_dir: str, **overrides):
    """`(LlamaConfig, params)` from a HuggingFace LLaMA directory (sharded or not), params in
    lclm's canonical layout and the checkpoint's dtype. A malformed directory raises
    `HFFormatError` (or FileNotFoundError) before any tensor data is read."""
    c = read_config(hf_dir, **overrides)
    t = _read_tensors(hf_dir, hf_shapes(c))
    dtype = jnp.dtype(c.param_dtype)
    H, K, Dh, D = c.n_heads, c.n_kv_heads, c.head_dim, c.dim

    def get(name):
        return jnp.asarray(t[name]).astype(dtype)

    def stack(suffix, fn):
        return jnp.stack([fn(get(_LAYER.format(i=i) + suffix)) for i in range(c.n_layers)])

    params = {
        "embed": get("model.embed_tokens.weight"),
        "final_norm": get("model.norm.weight"),
        "layers": {
            "attn_norm": stack("input_layernorm.weight", lambda w: w),
            "ffn_norm": stack("post_attention_layernorm.weight", lambda w: w),
            "wq": stack("self_attn.q_proj.weight", lambda w: w.T.reshape(D, H, Dh)),
            "wk": stack("self_attn.k_proj.weight", lambda w: w.T.reshape(D, K, Dh)),
            "wv": stack("self_attn.v_proj.weight", lambda w: w.T.reshape(D, K, Dh)),
            "wo": stack("self_attn.o_proj.weight", lambda w: w.T.reshape(H, Dh, D)),
            "w_gate": stack("mlp.gate_proj.weight", lambda w: w.T),
            "w_up": stack("mlp.up_proj.weight", lambda w: w.T),
            "w_down": stack("mlp.down_proj.weight", lambda w: w.T),
        },
    }
    if not c.tie_embeddings:
        params["lm_head"] = get("lm_head.weight").T
    return c, params


def _world_readable(path: str, directory: bool = False) -> None:
    os.chmod(path, 0o755 if directory else 0o644)


def _make_dir(path: str) -> None:
    """`os.makedirs`, with every directory it creates 0o755 whatever the umask."""
    missing = []
    path = os.path.abspath(path)
    while not os.path.exists(path):
        missing.append(path)
        path = os.path.dirname(path)
    os.makedirs(missing[0] if missing else path, exist_ok=True)
    for d in missing:
        _world_readable(d, directory=True)


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    _world_readable(path)


_WEIGHT_FILE = re.compile(r"model(-\d+-of-\d+)?\.safetensors(\.index\.json)?")


def save(hf_dir: str, c: LlamaConfig, params, max_shard_bytes: int = 4 << 30) -> list:
    """Write `params` (canonical layout) as a HuggingFace LLaMA directory that
    `transformers.LlamaForCausalLM.from_pretrained` loads (sharded above `max_shard_bytes`);
    returns the names of the files written (0o644; directories it creates 0o755). Weight files
    already in `hf_dir` (an earlier export's) are replaced, never mixed with the new ones."""
    from safetensors.flax import save_file

    _make_dir(hf_dir)
    for name in os.listdir(hf_dir):
        if _WEIGHT_FILE.fullmatch(name):
            os.remove(os.path.join(hf_dir, name))
    dtype = jnp.dtype(c.param_dtype)
    L = params["layers"]
    out = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["final_norm"]}
    if not c.tie_embeddings:
        out["lm_head.weight"] = params["lm_head"].T
    for i in range(c.n_layers):
        p = _LAYER.format(i=i)
        out[p + "input_layernorm.weight"] = L["attn_norm"][i]
        out[p + "post_attention_layernorm.weight"] = L["ffn_norm"][i]
        out[p + "self_attn.q_proj.weight"] = L["wq"][i].reshape(c.dim, -1).T
        out[p + "self_attn.k_proj.weight"] = L["wk"][i].reshape(c.dim, -1).T
        out[p + "self_attn.v_proj.weight"] = L["wv"][i].reshape(c.dim, -1).T
        out[p + "self_attn.o_proj.weight"] = L["wo"][i].reshape(-1, c.dim).T
        out[p + "mlp.gate_proj.weight"] = L["w_gate"][i].T
        out[p + "mlp.up_proj.weight"] = L["w_up"][i].T
        out[p + "mlp.down_proj.weight"] = L["w_down"][i].T
    out = {k: jnp.asarray(np.asarray(v)).astype(dtype) for k, v in out.items()}

    shards, current, size = [], {}, 0
    for name, tensor in out.items():
        if current and size + tensor.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor
        size += tensor.nbytes
    shards.append(current)
    written = []
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{n:05d}-of-{len(shards):05d}.safetensors"
                 for n in range(1, len(shards) + 1)]
    for name, shard in zip(names, shards):
        save_file(shard, os.path.join(hf_dir, name), metadata={"format": "pt"})
        _world_readable(os.path.join(hf_dir, name))
        written.append(name)
    if len(shards) > 1:
        weight_map = {k: name for name, shard in zip(names, shards) for k in shard}
        _write_json(os.path.join(hf_dir, "model.safetensors.index.json"),
                    {"metadata": {"total_size": sum(t.nbytes for t in out.values())},
                     "weight_map": weight_map})
        written.append("model.safetensors.index.json")
    _write_json(os.path.join(hf_dir, "config.json"), config_to_hf(c))
    written.append("config.json")
    return written


# what a checkpoint determines: its shapes and what an export must state again
SOURCE_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
                  "norm_eps", "tie_embeddings", "bos_id", "eos_ids", "max_position_embeddings")
SCALING_FIELDS = ("rope_scaling", "rope_factor", "rope_low_freq_factor",
                   "rope_high_freq_factor", "rope_original_max_positions")


def model_fields(fields: dict, rope_scaling: bool = True) -> dict:
    """The fields of `config.model` that a source model determines, taken from its model
    fields (an HF checkpoint's `LlamaConfig` as a dict, or an lclm checkpoint's saved
    `model`): shapes, token ids, max positions and (with `rope_scaling`) its RoPE scaling.
    Never rope_theta: the run's `model.rope_theta` applies over the source's. JSON lists
    come back as tuples."""
    keep = SOURCE_FIELDS + (SCALING_FIELDS if rope_scaling else ())
    return {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items() if k in keep}


# --- tokenizers ------------------------------------------------------------------------

# what an export holds of a tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model")
# SentencePiece ModelProto piece types and model types
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_UNIGRAM, _BPE = 1, 2


def _regex_replace(pattern: str, content: str) -> dict:
    return {"type": "Replace", "pattern": {"Regex": pattern}, "content": content}


def sentencepiece_to_hf(model_path: str, add_bos: bool = True) -> tuple[dict, dict]:
    """(tokenizer.json, the special tokens) for a SentencePiece BPE or unigram model: the
    `tokenizers` pipeline that encodes as SentencePiece does. The normalizer is the model's
    own: its precompiled character map (e.g. nmt_nfkc), its whitespace rules (collapsing runs
    and trimming the ends where `remove_extra_whitespaces`), the dummy prefix, spaces as
    "▁"; BPE merges rank as SentencePiece scores the merged pieces; unknown characters fall
    back to byte pieces where the model has them. BOS is prepended when `add_bos`."""
    import base64

    from sentencepiece import sentencepiece_model_pb2

    from google.protobuf.message import DecodeError

    with open(model_path, "rb") as f:
        raw = f.read()
    try:
        proto = sentencepiece_model_pb2.ModelProto.FromString(raw)
    except DecodeError as e:
        raise HFFormatError(f"{model_path!r} is not a SentencePiece model ({e})") from None
    kind = proto.trainer_spec.model_type
    norm = proto.normalizer_spec
    if kind not in (_BPE, _UNIGRAM):
        raise HFFormatError(f"{model_path!r}: SentencePiece model_type {kind} cannot be "
                            "exported; lclm converts BPE and unigram models")
    if proto.trainer_spec.treat_whitespace_as_suffix:
        raise HFFormatError(f"{model_path!r}: treat_whitespace_as_suffix is not supported")
    pieces = [(p.piece, p.score, p.type) for p in proto.pieces]
    by_type = lambda t: [i for i, p in enumerate(pieces) if p[2] == t]
    unk = by_type(_UNKNOWN)
    specials = {}
    for name, piece_id in (("unk_token", proto.trainer_spec.unk_id),
                           ("bos_token", proto.trainer_spec.bos_id),
                           ("eos_token", proto.trainer_spec.eos_id),
                           ("pad_token", proto.trainer_spec.pad_id)):
        if 0 <= piece_id < len(pieces):
            specials[name] = pieces[piece_id][0]

    normalizers = []
    if norm.precompiled_charsmap:
        normalizers.append({"type": "Precompiled", "precompiled_charsmap":
                            base64.b64encode(norm.precompiled_charsmap).decode()})
    if norm.remove_extra_whitespaces:
        normalizers += [_regex_replace(" {2,}", " "), _regex_replace(r"\A | \z", "")]
    if norm.add_dummy_prefix:
        normalizers.append({"type": "Prepend", "prepend": "\u2581"})
    if norm.escape_whitespaces:
        normalizers.append({"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"})

    byte_fallback = bool(proto.trainer_spec.byte_fallback and by_type(_BYTE))
    if kind == _BPE:
        vocab = {piece: i for i, (piece, _, _) in enumerate(pieces)}
        merges = []
        for i, (piece, score, t) in enumerate(pieces):
            if t != _NORMAL:
                continue
            for cut in range(1, len(piece)):
                left, right = piece[:cut], piece[cut:]
                if left in vocab and right in vocab:
                    merges.append((-score, i, vocab[left], [left, right]))
        model = {"type": "BPE", "dropout": None, "unk_token": pieces[unk[0]][0] if unk else None,
                 "continuing_subword_prefix": None, "end_of_word_suffix": None,
                 "fuse_unk": True, "byte_fallback": byte_fallback, "ignore_merges": False,
                 "vocab": vocab, "merges": [m[-1] for m in sorted(merges)]}
    else:
        model = {"type": "Unigram", "unk_id": unk[0] if unk else None,
                 "vocab": [[piece, score] for piece, score, _ in pieces],
                 "byte_fallback": byte_fallback}
    # control pieces become special tokens: unlike SentencePiece, transformers matches their
    # text ("<s>") in its input
    added = [{"id": i, "content": pieces[i][0], "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": pieces[i][2] != _USER_DEFINED}
             for i in sorted(by_type(_UNKNOWN) + by_type(_CONTROL) + by_type(_USER_DEFINED))]
    decoders = [{"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}]
    if byte_fallback:
        decoders.append({"type": "ByteFallback"})
    decoders.append({"type": "Fuse"})
    if norm.add_dummy_prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    post = None
    bos = specials.get("bos_token")
    if add_bos and bos is not None:
        token = lambda name, type_id: {"SpecialToken": {"id": name, "type_id": type_id}}
        seq = lambda name, type_id: {"Sequence": {"id": name, "type_id": type_id}}
        post = {"type": "TemplateProcessing",
                "single": [token(bos, 0), seq("A", 0)],
                "pair": [token(bos, 0), seq("A", 0), token(bos, 1), seq("B", 1)],
                "special_tokens": {bos: {"id": bos, "ids": [proto.trainer_spec.bos_id],
                                         "tokens": [bos]}}}
    tokenizer = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
                 "normalizer": {"type": "Sequence", "normalizers": normalizers},
                 "pre_tokenizer": None, "post_processor": post,
                 "decoder": {"type": "Sequence", "decoders": decoders}, "model": model}
    return tokenizer, specials


def save_tokenizer(source: str, hf_dir: str, c: LlamaConfig) -> tuple[list, list]:
    """Put the tokenizer the model was trained with into the export `hf_dir` so that
    `transformers.AutoTokenizer.from_pretrained(hf_dir)` loads it; returns (the files written,
    warnings). `source` is a SentencePiece `.model` (copied as tokenizer.model, with a
    tokenizer.json that encodes like it and its tokenizer_config.json), a HuggingFace
    tokenizer.json or a directory holding one (copied with the tokenizer_config.json and
    special_tokens_map.json beside it)."""
    import shutil

    def copy(src, name):
        shutil.copyfile(src, os.path.join(hf_dir, name))
        _world_readable(os.path.join(hf_dir, name))
        return name

    folder = source if os.path.isdir(source) else os.path.dirname(source)
    if os.path.isdir(source):
        if os.path.isfile(os.path.join(source, "tokenizer.json")):
            source = os.path.join(source, "tokenizer.json")
        elif os.path.isfile(os.path.join(source, "tokenizer.model")):
            source = os.path.join(source, "tokenizer.model")
        else:
            raise FileNotFoundError(f"tokenizer directory {source!r} holds neither "
                                    "tokenizer.json nor tokenizer.model")
    if not os.path.isfile(source):
        raise FileNotFoundError(f"tokenizer {source!r} not found")
    written, warnings = [], []
    if source.endswith(".json"):  # a HuggingFace tokenizer: its own files, as they are
        written.append(copy(source, "tokenizer.json"))
        for name in TOKENIZER_FILES[1:]:
            if os.path.isfile(os.path.join(folder, name)):
                written.append(copy(os.path.join(folder, name), name))
        if "tokenizer_config.json" not in written:
            _write_json(os.path.join(hf_dir, "tokenizer_config.json"),
                        {"tokenizer_class": "PreTrainedTokenizerFast",
                         "model_max_length": c.max_position_embeddings})
            written.append("tokenizer_config.json")
        return written, warnings

    written.append(copy(source, "tokenizer.model"))
    tokenizer, specials = sentencepiece_to_hf(source)
    _write_json(os.path.join(hf_dir, "tokenizer.json"), tokenizer)
    written.append("tokenizer.json")
    _write_json(os.path.join(hf_dir, "tokenizer_config.json"), {
        "tokenizer_class": "PreTrainedTokenizerFast", **specials, "add_bos_token": True,
        "add_eos_token": False, "model_max_length": c.max_position_embeddings,
        "clean_up_tokenization_spaces": False})
    _write_json(os.path.join(hf_dir, "special_tokens_map.json"), specials)
    written += ["tokenizer_config.json", "special_tokens_map.json"]
    ids = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    bos, eos = ids.get(specials.get("bos_token"), -1), ids.get(specials.get("eos_token"))
    if bos != c.bos_id or (eos is not None and eos not in c.eos_ids):
        warnings.append(f"the tokenizer's bos/eos ids ({bos}/{eos}) differ from the model's "
                        f"bos_id/eos_ids ({c.bos_id}/{list(c.eos_ids)}) in config.json")
    return written, warnings

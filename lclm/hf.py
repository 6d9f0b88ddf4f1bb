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

import dataclasses
import json
import math
import os

import jax.numpy as jnp
import numpy as np

from lclm.errors import StartupError
from lclm.models.llama import LlamaConfig

_LAYER = "model.layers.{i}."
_TORCH_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float32"}


class HFFormatError(StartupError):
    """A HuggingFace directory that lclm refuses to load. The message is one line that names
    the file and, where one is at fault, the tensor."""


def _field(hf: dict, name: str, kind, default=None):
    """`hf[name]` checked to be a positive `kind`; `default` where it is absent or null (a
    field without a default is required)."""
    value = hf.get(name)
    if value is None:
        if default is None:
            raise ValueError(f"config.json lacks required field {name!r}")
        return default
    # JSON true/false are Python ints: a bool is never a size
    if isinstance(value, bool) or not isinstance(value, kind) or value <= 0:
        what = "integer" if kind is int else "number"
        raise ValueError(f"config.json field {name!r} must be a positive {what}, not {value!r}")
    return value


def config_from_hf(hf: dict, **overrides) -> LlamaConfig:
    """LlamaConfig from a HuggingFace LLaMA `config.json` dict. The compute and parameter
    dtypes follow `torch_dtype` (float16 checkpoints are computed in float32)."""
    if not isinstance(hf, dict):
        raise ValueError("config.json must hold a JSON object")
    if hf.get("model_type", "llama") != "llama":
        raise ValueError(f"not a LLaMA checkpoint (model_type={hf.get('model_type')!r})")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        # lclm's layers have no biases: loading would silently drop them
        raise ValueError("config.json asks for attention_bias/mlp_bias, which lclm lacks")
    # transformers < 5: rope_theta + rope_scaling; >= 5: rope_parameters
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or rope
    if not isinstance(rope, dict) or not isinstance(scaling, dict):
        raise ValueError("config.json fields rope_parameters and rope_scaling must be objects")
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        raise ValueError(f"RoPE scaling {scaling} is not supported; lclm extends context by "
                         "raising rope_theta (config.model.rope_theta)")
    number = (int, float)
    theta = _field(hf, "rope_theta", number, _field(rope, "rope_theta", number, 10000.0))
    n_heads = _field(hf, "num_attention_heads", int)
    dim = _field(hf, "hidden_size", int)
    head_dim = _field(hf, "head_dim", int, dim // n_heads)
    if head_dim * n_heads != dim:
        raise ValueError("head_dim x num_attention_heads != hidden_size is not supported")
    n_kv_heads = _field(hf, "num_key_value_heads", int, n_heads)
    if n_heads % n_kv_heads:
        raise ValueError("config.json num_attention_heads is not a multiple of num_key_value_heads")
    dtype = _TORCH_DTYPES.get(str(hf.get("torch_dtype", hf.get("dtype", "float32"))), "float32")
    fields = dict(
        vocab_size=_field(hf, "vocab_size", int), dim=dim,
        n_layers=_field(hf, "num_hidden_layers", int), n_heads=n_heads, n_kv_heads=n_kv_heads,
        ffn_dim=_field(hf, "intermediate_size", int), rope_theta=float(theta),
        norm_eps=float(_field(hf, "rms_norm_eps", number, 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        dtype=dtype, param_dtype=dtype)
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


def config_to_hf(c: LlamaConfig) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": c.vocab_size, "hidden_size": c.dim, "intermediate_size": c.ffn_dim,
        "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads, "head_dim": c.head_dim, "hidden_act": "silu",
        "max_position_embeddings": 4096, "rms_norm_eps": c.norm_eps, "rope_theta": c.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "tie_word_embeddings": c.tie_embeddings, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": c.param_dtype,
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


def save(hf_dir: str, c: LlamaConfig, params, max_shard_bytes: int = 4 << 30) -> None:
    """Write `params` (canonical layout) as a HuggingFace LLaMA directory that
    `transformers.LlamaForCausalLM.from_pretrained` loads (sharded above `max_shard_bytes`)."""
    from safetensors.flax import save_file

    os.makedirs(hf_dir, exist_ok=True)
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
    if len(shards) == 1:
        save_file(shards[0], os.path.join(hf_dir, "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for n, shard in enumerate(shards, 1):
            name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(hf_dir, name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
        with open(os.path.join(hf_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": sum(t.nbytes for t in out.values())},
                       "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(config_to_hf(c), f, indent=1)


def model_fields(c: LlamaConfig) -> dict:
    """The shape fields of `config.model` that a loaded checkpoint determines."""
    keep = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "norm_eps",
            "tie_embeddings")
    return {k: v for k, v in dataclasses.asdict(c).items() if k in keep}

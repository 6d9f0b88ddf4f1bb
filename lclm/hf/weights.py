"""HuggingFace LLaMA safetensors weights <-> lclm's canonical parameters.

RoPE convention: lclm applies RoPE in HuggingFace's *rotate-half* form (the first and second
halves of each head's dims form the rotation pairs). HuggingFace LLaMA checkpoints already
store q/k projections permuted for that form (`convert_llama_weights_to_hf.py` permutes Meta's
interleaved-pair weights), so weights are copied without any permutation in either direction.
Meta's original `consolidated.*.pth` checkpoints use interleaved pairs and must first be
converted by HuggingFace's script (lclm never loads pickled .pth files).

Only safetensors files are read: nothing is unpickled or executed.
"""

import json
import os
import re

import jax.numpy as jnp
import numpy as np
from huggingface_hub import split_state_dict_into_shards_factory
from safetensors import SafetensorError, safe_open
from safetensors.flax import save_file

from lclm.config import LlamaConfig
from lclm.hf.config import config_to_hf, read_config
from lclm.hf.errors import HFFormatError
from lclm.hf.files import make_dir, world_readable, write_json

_LAYER = "model.layers.{i}."
_INDEX = "model.safetensors.index.json"
# transformers' names: model.safetensors, or model-00001-of-00003.safetensors and the index
_SHARD_PATTERN = "model{suffix}.safetensors"
_WEIGHT_FILE = re.compile(r"model(-\d+-of-\d+)?\.safetensors(\.index\.json)?")
# safetensors dtypes lclm computes with; safetensors itself accepts integers, bools, fp8, ...
_FLOATS = ("F32", "BF16", "F16")


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


def _weight_files(hf_dir: str) -> list:
    """The safetensors files of `hf_dir`: those its index names, or model.safetensors. An
    index may only name .safetensors files inside `hf_dir` (never a pickle, never a path)."""
    index = os.path.join(hf_dir, _INDEX)
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


def _damaged(path: str, e: SafetensorError) -> HFFormatError:
    # safetensors quotes tensor names from the file as they are: keep the message one line
    reason = " ".join(str(e).split())
    return HFFormatError(f"{path!r} is truncated, damaged or not a safetensors file "
                         f"(safetensors: {reason})")


def _header(path: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> `(dtype, shape)` of every tensor in the safetensors file `path`. Opening it is
    safetensors' own check of the whole header before any data is read: its size (at most
    100 MB, and within the file), JSON, known dtypes, and offsets that tile the data exactly,
    each tensor's bytes matching its dtype and shape."""
    try:
        with safe_open(path, framework="numpy") as f:
            slices = {name: f.get_slice(name) for name in f.keys()}
            return {name: (s.get_dtype(), tuple(s.get_shape())) for name, s in slices.items()}
    except SafetensorError as e:
        raise _damaged(path, e) from None


def _read_tensors(hf_dir: str, shapes: dict) -> dict:
    """The tensors named in `shapes` from `hf_dir`, read once every file's header is valid and
    holds them with these shapes, each exactly once, as floats."""
    where: dict[str, tuple[str, str, tuple[int, ...]]] = {}  # name -> (file, dtype, shape)
    for path in _weight_files(hf_dir):
        for name, (dtype, shape) in _header(path).items():
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
        try:  # as jax arrays: safetensors 0.4.0 gives no numpy bfloat16
            with safe_open(path, framework="flax") as f:
                tensors.update({name: f.get_tensor(name) for name in names})
        except SafetensorError as e:  # the file changed since its header was read
            raise _damaged(path, e) from None
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


def save(hf_dir: str, c: LlamaConfig, params, max_shard_bytes: int = 4 << 30) -> list:
    """Write `params` (canonical layout) as a HuggingFace LLaMA directory that
    `transformers.LlamaForCausalLM.from_pretrained` loads (sharded above `max_shard_bytes`);
    returns the names of the files written (0o644; directories it creates 0o755). Weight files
    already in `hf_dir` (an earlier export's) are replaced, never mixed with the new ones."""
    make_dir(hf_dir)
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

    split = split_state_dict_into_shards_factory(
        out, get_storage_size=lambda t: t.nbytes, filename_pattern=_SHARD_PATTERN,
        max_shard_size=max_shard_bytes)
    for name, names in split.filename_to_tensors.items():
        save_file({k: out[k] for k in names}, os.path.join(hf_dir, name),
                  metadata={"format": "pt"})
        world_readable(os.path.join(hf_dir, name))
    written = list(split.filename_to_tensors)
    if split.is_sharded:
        write_json(os.path.join(hf_dir, _INDEX),
                   {"metadata": split.metadata, "weight_map": split.tensor_to_filename})
        written.append(_INDEX)
    write_json(os.path.join(hf_dir, "config.json"), config_to_hf(c))
    written.append("config.json")
    return written


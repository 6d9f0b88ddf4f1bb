"""HuggingFace LLaMA safetensors weights <-> lclm's canonical parameters.

RoPE convention: lclm applies RoPE in HuggingFace's *rotate-half* form (the first and second
halves of each head's dims form the rotation pairs). HuggingFace LLaMA checkpoints already
store q/k projections permuted for that form (`convert_llama_weights_to_hf.py` permutes Meta's
interleaved-pair weights), so weights are copied without any permutation in either direction.
Meta's original `consolidated.*.pth` checkpoints use interleaved pairs and must first be
converted by HuggingFace's script (lclm never loads pickled .pth files).

Only safetensors files are read: nothing is unpickled or executed.
"""

import glob
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from huggingface_hub import split_state_dict_into_shards_factory
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from lclm.config import LlamaConfig
from lclm.files import write_json
from lclm.hf.config import config_to_hf, read_config
from lclm.hf.errors import HFFormatError
from lclm.hf.files import make_dir, world_readable
from lclm.models.llama import param_shapes

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


def _locate(hf_dir: str, shapes: dict) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """name -> (file, dtype, shape) of every tensor named in `shapes`, once every file's header
    is valid and holds them with these shapes, each exactly once, as floats."""
    where: dict[str, tuple[str, str, tuple[int, ...]]] = {}
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
    return {name: where[name] for name in shapes}


_NUMPY = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
          "BF16": np.dtype(jnp.bfloat16)}


class _Reader:
    """Whole tensors of validated safetensors files, read with `pread`: nothing is mapped, so
    only the tensor asked for passes through this process's memory. The last tensor read is
    kept, since every device's shard of a parameter is cut from the same one."""

    def __init__(self, where: dict[str, tuple[str, str, tuple[int, ...]]]):
        self.where = where
        self._headers: dict[str, tuple[int, dict]] = {}   # file -> (data start, header)
        self._last: tuple[str, np.ndarray] | None = None

    def _offsets(self, path: str, name: str) -> tuple[int, int]:
        """(first byte, end) of tensor `name` in `path` (the header safetensors validated)."""
        if path not in self._headers:
            with open(path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                self._headers[path] = (8 + size, json.loads(f.read(size)))
        start, header = self._headers[path]
        begin, end = header[name]["data_offsets"]
        return start + begin, start + end

    def get(self, name: str) -> np.ndarray:
        if self._last is not None and self._last[0] == name:
            return self._last[1]
        path, dtype, shape = self.where[name]
        begin, end = self._offsets(path, name)
        buffer = bytearray(end - begin)
        with open(path, "rb") as f:
            read = f.readinto(memoryview(buffer)) if f.seek(begin) == begin else 0
        if read != end - begin:   # the file changed since its header was read
            raise HFFormatError(f"{path!r} is truncated (tensor {name!r})")
        tensor = np.frombuffer(buffer, _NUMPY[dtype]).reshape(shape)
        self._last = (name, tensor)
        return tensor


def _canonical(c: LlamaConfig):
    """lclm parameter -> (HF tensor name, or a function of the layer index giving it; the map
    from that tensor `[out, in]` to lclm's layout)."""
    H, K, Dh, D = c.n_heads, c.n_kv_heads, c.head_dim, c.dim

    def layer(suffix):
        return lambda i: _LAYER.format(i=i) + suffix

    tree = {
        "embed": ("model.embed_tokens.weight", lambda w: w),
        "final_norm": ("model.norm.weight", lambda w: w),
        "layers": {
            "attn_norm": (layer("input_layernorm.weight"), lambda w: w),
            "ffn_norm": (layer("post_attention_layernorm.weight"), lambda w: w),
            "wq": (layer("self_attn.q_proj.weight"), lambda w: w.T.reshape(D, H, Dh)),
            "wk": (layer("self_attn.k_proj.weight"), lambda w: w.T.reshape(D, K, Dh)),
            "wv": (layer("self_attn.v_proj.weight"), lambda w: w.T.reshape(D, K, Dh)),
            "wo": (layer("self_attn.o_proj.weight"), lambda w: w.T.reshape(H, Dh, D)),
            "w_gate": (layer("mlp.gate_proj.weight"), lambda w: w.T),
            "w_up": (layer("mlp.up_proj.weight"), lambda w: w.T),
            "w_down": (layer("mlp.down_proj.weight"), lambda w: w.T),
        },
    }
    if not c.tie_embeddings:
        tree["lm_head"] = ("lm_head.weight", lambda w: w.T)
    return tree


def _is_entry(x) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and callable(x[1])


def _block(reader: _Reader, entry, stacked: bool, n_layers: int, index: tuple, dtype):
    """The block `index` of one lclm parameter, built from the HF tensors it needs (for a
    stacked parameter, one layer's tensor at a time), in `dtype`."""
    name, to_lclm = entry
    if not stacked:
        return np.asarray(to_lclm(reader.get(name))[index], dtype)
    layers = range(n_layers)[index[0]]
    return np.stack([np.asarray(to_lclm(reader.get(name(i)))[index[1:]], dtype)
                     for i in layers])


def load(hf_dir: str, shardings=None, dtype=None, **overrides):
    """`(LlamaConfig, params)` from a HuggingFace LLaMA directory (sharded or not), params in
    lclm's canonical layout and `dtype` (default: the config's `param_dtype`). A malformed
    directory raises `HFFormatError` (or FileNotFoundError) before any tensor data is read.

    `shardings`: a tree of `jax.sharding.Sharding` like the params (lclm.train.state's
    `param_shardings`): each device's block is read from the files and placed directly, so no
    device ever holds more than its block and the host never holds the whole model (on
    several processes each reads only the blocks of its own devices). Without it, host numpy
    arrays."""
    c = read_config(hf_dir, **overrides)
    reader = _Reader(_locate(hf_dir, hf_shapes(c)))
    dtype = np.dtype(jnp.dtype(dtype or c.param_dtype))
    entries = _canonical(c)
    shapes = param_shapes(c)
    stacked = {"layers"}

    def build(path, entry, shape, sharding=None):
        is_stacked = path[0].key in stacked
        if sharding is None:
            return _block(reader, entry, is_stacked, c.n_layers, (slice(None),) * len(shape),
                          dtype)
        return jax.make_array_from_callback(
            shape, sharding, lambda index: _block(reader, entry, is_stacked, c.n_layers,
                                                  index, dtype))

    if shardings is None:
        params = jax.tree_util.tree_map_with_path(build, entries, shapes, is_leaf=_is_entry)
    else:
        params = jax.tree_util.tree_map_with_path(build, entries, shapes, shardings,
                                                  is_leaf=_is_entry)
    return c, params


def _exports(c: LlamaConfig, params) -> dict[str, Callable[[], np.ndarray]]:
    """HF tensor name -> a function giving it as a host array `[out, in]`: one layer of one
    parameter at a time, so the model is never whole on the host."""
    L = params["layers"]

    def read(get: Callable[[], object], to_hf: Callable = lambda w: w):
        return lambda: to_hf(np.asarray(jax.device_get(get())))

    def to_rows(w):   # [dim, heads, head_dim] -> [heads * head_dim, dim]
        return w.reshape(c.dim, -1).T

    out = {"model.embed_tokens.weight": read(lambda: params["embed"]),
           "model.norm.weight": read(lambda: params["final_norm"])}
    if not c.tie_embeddings:
        out["lm_head.weight"] = read(lambda: params["lm_head"], np.transpose)
    for i in range(c.n_layers):
        p = _LAYER.format(i=i)

        def layer(key: str, i: int = i):
            return lambda: L[key][i]

        out.update({
            p + "input_layernorm.weight": read(layer("attn_norm")),
            p + "post_attention_layernorm.weight": read(layer("ffn_norm")),
            p + "self_attn.q_proj.weight": read(layer("wq"), to_rows),
            p + "self_attn.k_proj.weight": read(layer("wk"), to_rows),
            p + "self_attn.v_proj.weight": read(layer("wv"), to_rows),
            p + "self_attn.o_proj.weight": read(layer("wo"),
                                                lambda w: w.reshape(-1, c.dim).T),
            p + "mlp.gate_proj.weight": read(layer("w_gate"), np.transpose),
            p + "mlp.up_proj.weight": read(layer("w_up"), np.transpose),
            p + "mlp.down_proj.weight": read(layer("w_down"), np.transpose),
        })
    return out


def save(hf_dir: str, c: LlamaConfig, params, max_shard_bytes: int = 4 << 30) -> list:
    """Write `params` (canonical layout) as a HuggingFace LLaMA directory that
    `transformers.LlamaForCausalLM.from_pretrained` loads (sharded above `max_shard_bytes`);
    returns the names of the files written (0o644; directories it creates 0o755).

    Streams: one output file's tensors are on the host at a time. Atomic per export: every
    file is written into a hidden directory inside `hf_dir` and moved into place only when
    all are complete, config.json last; an earlier export's weight files that this one does
    not have are removed after that. A failed or killed export leaves the earlier one whole."""
    make_dir(hf_dir)
    for leftover in glob.glob(os.path.join(glob.escape(hf_dir), ".export-*")):
        shutil.rmtree(leftover, ignore_errors=True)   # of an export that was killed
    dtype = np.dtype(jnp.dtype(c.param_dtype))
    exports = _exports(c, params)
    shapes = hf_shapes(c)
    split = split_state_dict_into_shards_factory(
        {name: shapes[name] for name in exports},
        get_storage_size=lambda shape: math.prod(shape) * dtype.itemsize,
        filename_pattern=_SHARD_PATTERN, max_shard_size=max_shard_bytes)
    staging = tempfile.mkdtemp(prefix=".export-", dir=hf_dir)
    try:
        for name, names in split.filename_to_tensors.items():
            path = os.path.join(staging, name)
            save_file({k: np.ascontiguousarray(exports[k]().astype(dtype)) for k in names},
                      path, metadata={"format": "pt"})
            world_readable(path)
        written = list(split.filename_to_tensors)
        if split.is_sharded:
            write_json(os.path.join(staging, _INDEX),
                       {"metadata": split.metadata, "weight_map": split.tensor_to_filename})
            written.append(_INDEX)
        write_json(os.path.join(staging, "config.json"), config_to_hf(c))
        written.append("config.json")
        for name in written:   # config.json last: it names the weights' shapes
            os.replace(os.path.join(staging, name), os.path.join(hf_dir, name))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    for name in os.listdir(hf_dir):
        if _WEIGHT_FILE.fullmatch(name) and name not in written:
            os.remove(os.path.join(hf_dir, name))   # the earlier export's, now replaced
    return written

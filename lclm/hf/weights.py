"""HuggingFace safetensors weights <-> lclm's canonical parameters, for every family (the
tensor names are the family's, `Family.layer_names`; each parameter's conversion is here).

RoPE convention: lclm applies RoPE in HuggingFace's *rotate-half* form (the first and second
halves of each head's dims form the rotation pairs). HuggingFace LLaMA checkpoints already
store q/k projections permuted for that form (`convert_llama_weights_to_hf.py` permutes Meta's
interleaved-pair weights), so weights are copied without any permutation in either direction.
Meta's original `consolidated.*.pth` checkpoints use interleaved pairs and must first be
converted by HuggingFace's script (lclm never loads pickled .pth files).

Only safetensors files are read: nothing is unpickled or executed.
"""

import contextlib
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
from jax.experimental import multihost_utils
from safetensors import SafetensorError, safe_open

from lclm import storage
from lclm.config import ModelConfig
from lclm.families import get_family
from lclm.hf.config import config_to_hf, read_config
from lclm.hf.directories import local_copy, make_dir, world_readable
from lclm.hf.errors import HFFormatError
from lclm.models.decoder import param_shapes
from lclm.writes import write_json

_LAYER = "model.layers.{i}."
_INDEX = "model.safetensors.index.json"
# transformers' names: model.safetensors, or model-00001-of-00003.safetensors and the index
_SHARD_PATTERN = "model{suffix}.safetensors"
_WEIGHT_FILE = re.compile(r"model(-\d+-of-\d+)?\.safetensors(\.index\.json)?")
# safetensors dtypes lclm computes with; safetensors itself accepts integers, bools, fp8, ...
_FLOATS = ("F32", "BF16", "F16")


def _layer_shapes(c: ModelConfig) -> dict:
    """lclm layer parameter -> the shape of its HF tensor `[out, in]` (or `[out]`), for every
    parameter of `c`'s family."""
    D, F, Dh = c.dim, c.ffn_dim, c.head_dim
    q, kv = c.n_heads * Dh, c.n_kv_heads * Dh
    shapes = {
        "attn_norm": (D,),
        "ffn_norm": (D,),
        "wq": (q, D),
        "wk": (kv, D),
        "wv": (kv, D),
        "wo": (D, q),
        "w_gate": (F, D),
        "w_up": (F, D),
        "w_down": (D, F),
        "bq": (q,),
        "bk": (kv,),
        "bv": (kv,),
        "q_norm": (Dh,),
        "k_norm": (Dh,),
    }
    return {name: shapes[name] for name in get_family(c.family).layer_names()}


def hf_shapes(c: ModelConfig) -> dict:
    """HuggingFace tensor name -> the shape `c` implies for it."""
    D, V = c.dim, c.vocab_size
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not c.tie_embeddings:
        shapes["lm_head.weight"] = (V, D)
    names, layer = get_family(c.family).layer_names(), _layer_shapes(c)
    for i in range(c.n_layers):
        shapes.update({_LAYER.format(i=i) + names[k]: shape for k, shape in layer.items()})
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
            raise HFFormatError(
                f"{index!r} has no valid weight_map ({type(e).__name__}: {e})"
            ) from None
        if not isinstance(weight_map, dict):
            raise HFFormatError(f"{index!r}: weight_map is not a JSON object")
        for tensor, name in weight_map.items():
            if not (
                isinstance(name, str)
                and name.endswith(".safetensors")
                and os.path.basename(name) == name
            ):
                raise HFFormatError(
                    f"{index!r} maps tensor {tensor!r} to {name!r}; lclm reads "
                    "only .safetensors files inside the directory"
                )
            if not os.path.isfile(os.path.join(hf_dir, name)):
                raise HFFormatError(
                    f"{index!r} maps tensor {tensor!r} to {name!r}, which does not exist"
                )
        return [os.path.join(hf_dir, name) for name in sorted(set(weight_map.values()))]
    if os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
        return [os.path.join(hf_dir, "model.safetensors")]
    raise FileNotFoundError(
        f"no model.safetensors(.index.json) in {hf_dir!r}; lclm reads "
        "safetensors only (never pickled .bin/.pth files)"
    )


def _damaged(path: str, e: SafetensorError) -> HFFormatError:
    # safetensors quotes tensor names from the file as they are: keep the message one line
    reason = " ".join(str(e).split())
    return HFFormatError(
        f"{path!r} is truncated, damaged or not a safetensors file (safetensors: {reason})"
    )


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
            raise HFFormatError(
                f"{path!r}: tensor {name!r} has shape {list(found)} but "
                f"config.json implies {list(shape)}"
            )
        if dtype not in _FLOATS:
            raise HFFormatError(
                f"{path!r}: tensor {name!r} is {dtype}; weights must be {'/'.join(_FLOATS)}"
            )
    return {name: where[name] for name in shapes}


_NUMPY = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": np.dtype(jnp.bfloat16)}


class _Reader:
    """Runs of rows of tensors in validated safetensors files, read with `pread` into one
    buffer that is reused: nothing is mapped and nothing allocated per read, so the host holds
    at most one HF tensor at a time. What `get` returns is a view of that buffer, valid until
    the next `get`; the same rows asked for again (another device's block of them) are not
    read again."""

    def __init__(self, where: dict[str, tuple[str, str, tuple[int, ...]]]):
        self.where = where
        self._headers: dict[str, tuple[int, dict]] = {}  # file -> (data start, header)
        self._buffer = bytearray()
        self._last: tuple[tuple, np.ndarray] | None = None

    def _offset(self, path: str, name: str) -> int:
        """Where tensor `name` begins in `path` (per the header safetensors validated)."""
        if path not in self._headers:
            with open(path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                self._headers[path] = (8 + size, json.loads(f.read(size)))
        start, header = self._headers[path]
        return start + header[name]["data_offsets"][0]

    def get(self, name: str, rows: slice = slice(None)) -> np.ndarray:
        """Rows `rows` of tensor `name` (`[rows, ...]`: of a row-major tensor, one run of
        bytes)."""
        path, dtype, shape = self.where[name]
        kept = range(shape[0])[rows]
        if self._last is not None and self._last[0] == (name, kept):
            return self._last[1]
        row = math.prod(shape[1:]) * _NUMPY[dtype].itemsize
        size = len(kept) * row
        if len(self._buffer) < size:
            self._last, self._buffer = None, bytearray(size)
        view = memoryview(self._buffer)[:size]
        begin = self._offset(path, name) + kept.start * row
        with open(path, "rb") as f:
            read = f.readinto(view) if f.seek(begin) == begin else 0
        if read != size:  # the file changed since its header was read
            raise HFFormatError(f"{path!r} is truncated (tensor {name!r})")
        tensor = np.frombuffer(view, _NUMPY[dtype]).reshape(len(kept), *shape[1:])
        self._last = ((name, kept), tensor)
        return tensor


def _canonical(c: ModelConfig):
    """lclm parameter -> (HF tensor name, or a function of the layer index giving it; the map
    from rows of that tensor `[out, in]` to lclm's layout of one layer; the axes of that
    layout that flatten to HF's rows `out`). The map takes any run of whole rows: the first of
    the row axes is -1 in its reshape."""
    Dh, D = c.head_dim, c.dim

    def layer(suffix):
        return lambda i: _LAYER.format(i=i) + suffix

    def heads_last(w):  # [heads * head_dim, dim] -> [dim, heads, head_dim] (kv heads)
        return w.T.reshape(D, -1, Dh)

    def as_is(w):
        return w

    def heads(w):  # [heads * head_dim] -> [heads, head_dim] (a bias)
        return w.reshape(-1, Dh)

    # lclm parameter -> (the map from HF rows to its layout, the axes flattening to rows)
    maps = {
        "attn_norm": (as_is, (0,)),
        "ffn_norm": (as_is, (0,)),
        "q_norm": (as_is, (0,)),
        "k_norm": (as_is, (0,)),
        "wq": (heads_last, (1, 2)),
        "wk": (heads_last, (1, 2)),
        "wv": (heads_last, (1, 2)),
        "bq": (heads, (0, 1)),
        "bk": (heads, (0, 1)),
        "bv": (heads, (0, 1)),
        "wo": (lambda w: w.T.reshape(c.n_heads, Dh, -1), (2,)),
        "w_gate": (np.transpose, (1,)),
        "w_up": (np.transpose, (1,)),
        "w_down": (np.transpose, (1,)),
    }
    tree = {
        "embed": ("model.embed_tokens.weight", as_is, (0,)),
        "final_norm": ("model.norm.weight", as_is, (0,)),
        "layers": {
            name: (layer(hf_name), *maps[name])
            for name, hf_name in get_family(c.family).layer_names().items()
        },
    }
    if not c.tie_embeddings:
        tree["lm_head"] = ("lm_head.weight", np.transpose, (1,))
    return tree


def _is_entry(x) -> bool:
    return isinstance(x, tuple) and len(x) == 3 and callable(x[1])


def _rows(shape: tuple, index: tuple, axes: tuple) -> tuple[slice, tuple]:
    """(The HF rows that the block `index` of a one-layer lclm tensor of `shape` needs, where
    its `axes` flatten to HF's rows; `index` within those rows). All rows unless the block
    spans whole trailing row axes (e.g. whole heads of `[dim, heads, head_dim]`)."""
    first, rest = axes[0], axes[1:]
    if any(range(shape[a])[index[a]] != range(shape[a]) for a in rest):
        return slice(None), index
    kept = range(shape[first])[index[first]]
    inner = math.prod(shape[a] for a in rest)
    within = (*index[:first], slice(0, len(kept)), *index[first + 1 :])
    return slice(kept.start * inner, kept.stop * inner), within


def _fill(out: np.ndarray, src: np.ndarray) -> np.ndarray:
    """`out[...] = src` (cast to `out`'s dtype), copied in strips of 256 along the last axis:
    `src` is often a transpose, which numpy copies about 3x faster when the part of it one
    strip reads stays in cache."""
    for a in range(0, out.shape[-1], 256):
        out[..., a : a + 256] = src[..., a : a + 256]
    return out


def _block(reader: _Reader, entry, stacked: bool, shape: tuple, index: tuple, dtype):
    """The block `index` (a tuple of slices) of the lclm parameter of `shape`, as a new host
    array in `dtype`, read from the HF rows it needs: for a stacked parameter
    `[layers, ...]`, one layer at a time, so the host holds the block and one HF tensor."""
    name, to_lclm, axes = entry
    block = np.empty([len(range(n)[i]) for n, i in zip(shape, index)], dtype)
    if not stacked:
        rows, within = _rows(shape, index, axes)
        return _fill(block, to_lclm(reader.get(name, rows))[within])
    rows, within = _rows(shape[1:], index[1:], axes)
    for j, i in enumerate(range(shape[0])[index[0]]):
        _fill(block[j], to_lclm(reader.get(name(i), rows))[within])
    return block


def load(hf_dir: str, shardings=None, dtype=None, **overrides):
    """`(ModelConfig, params)` from a HuggingFace directory of a family lclm knows (sharded or
    not), params in
    lclm's canonical layout and `dtype` (default: the config's `param_dtype`). A malformed
    directory raises `HFFormatError` (or FileNotFoundError) before any tensor data is read.

    `shardings`: a tree of `jax.sharding.Sharding` like the params (lclm.workdir.state's
    `param_shardings`): each device's block is read from the files and placed directly with
    `jax.make_array_from_callback`, so no device ever holds more than its block and the host
    holds one block and one HF tensor at a time; on several processes each reads only the
    blocks of its own devices. Without it, host numpy arrays (the whole model on the host).
    A gs:// or s3:// `hf_dir` is read from a temporary local copy (`local_copy`)."""
    with local_copy(hf_dir) as local:
        return _load(local, shardings, dtype, overrides)


def _load(hf_dir: str, shardings, dtype, overrides: dict):
    c = read_config(hf_dir, **overrides)
    reader = _Reader(_locate(hf_dir, hf_shapes(c)))
    dtype = np.dtype(jnp.dtype(dtype or c.param_dtype))

    def build(path, entry, shape, sharding=None):
        stacked = path[0].key == "layers"
        if sharding is None:
            return _block(reader, entry, stacked, shape, (slice(None),) * len(shape), dtype)
        return jax.make_array_from_callback(
            shape, sharding, lambda index: _block(reader, entry, stacked, shape, index, dtype)
        )

    trees = [_canonical(c), param_shapes(c)] + ([] if shardings is None else [shardings])
    return c, jax.tree_util.tree_map_with_path(build, *trees, is_leaf=_is_entry)


def _host(x) -> np.ndarray:
    """`x` on this host; an array spanning several processes' devices is gathered from all of
    them (every process must ask for it, in the same order)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def _exports(c: ModelConfig, params, dtype) -> dict[str, Callable[[], np.ndarray]]:
    """HF tensor name -> a function giving it as a new host array `[out, in]` in `dtype`: one
    layer of one parameter is read at a time, so the model is never whole on the host."""
    L = params["layers"]

    def read(get: Callable[[], object], to_hf: Callable = lambda w: w):
        def tensor():
            w = to_hf(_host(get()))
            return _fill(np.empty(w.shape, dtype), w)

        return tensor

    def to_rows(w):  # [dim, heads, head_dim] -> [heads * head_dim, dim]
        return w.reshape(c.dim, -1).T

    out = {
        "model.embed_tokens.weight": read(lambda: params["embed"]),
        "model.norm.weight": read(lambda: params["final_norm"]),
    }
    if not c.tie_embeddings:
        out["lm_head.weight"] = read(lambda: params["lm_head"], np.transpose)

    def as_is(w):
        return w

    def layer(key: str, i: int) -> Callable[[], object]:
        return lambda: L[key][i]

    to_hf: dict[str, Callable] = {
        "wq": to_rows,
        "wk": to_rows,
        "wv": to_rows,
        "wo": lambda w: w.reshape(-1, c.dim).T,
        "w_gate": np.transpose,
        "w_up": np.transpose,
        "w_down": np.transpose,
        "bq": np.ravel,
        "bk": np.ravel,
        "bv": np.ravel,
    }  # norms: as they are
    names = get_family(c.family).layer_names()
    for i in range(c.n_layers):
        for key, hf_name in names.items():
            out[_LAYER.format(i=i) + hf_name] = read(layer(key, i), to_hf.get(key, as_is))
    return out


_CODES = {dtype: code for code, dtype in _NUMPY.items()}


def _write_file(path: str, names: list, shapes: dict, exports: dict, dtype: np.dtype) -> None:
    """A safetensors file of the tensors `names`, each made by `exports` and written in turn:
    the header is known from `shapes` beforehand, so one tensor is on the host at a time
    (safetensors' own writer takes them all, and copies them once more). Synced to disk and
    0o644, so that once renamed into place it is whole."""
    header: dict = {"__metadata__": {"format": "pt"}}
    end = 0
    for name in names:
        begin, end = end, end + math.prod(shapes[name]) * dtype.itemsize
        header[name] = {
            "dtype": _CODES[dtype],
            "shape": list(shapes[name]),
            "data_offsets": [begin, end],
        }
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the tensors' data 8-byte aligned, as safetensors writes
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for name in names:
            tensor = exports[name]()
            if tensor.shape != shapes[name]:
                raise ValueError(
                    f"the parameter exported as {name!r} has shape "
                    f"{list(tensor.shape)}; the config implies "
                    f"{list(shapes[name])}"
                )
            f.write(tensor.reshape(-1).view(np.uint8).data)
        f.flush()
        os.fsync(f.fileno())
    world_readable(path)


def _file_names(split) -> list:
    """The files an export of `split` (huggingface_hub's plan of the weight files) writes."""
    return [*split.filename_to_tensors, *([_INDEX] if split.is_sharded else []), "config.json"]


def _publish(hf_dir: str, c: ModelConfig, split, write: Callable[[str, list], None]) -> None:
    """Write the weight files of `split` (`write(path, tensor names)`), the index (when it has
    several files) and config.json into a hidden directory in `hf_dir`, then move them into
    place, config.json last (it names the weights' shapes); only then remove the weight files
    of an earlier export that this one does not have."""
    make_dir(hf_dir)
    for leftover in glob.glob(os.path.join(glob.escape(hf_dir), ".export-*")):
        shutil.rmtree(leftover, ignore_errors=True)  # of an export that was killed
    staging = tempfile.mkdtemp(prefix=".export-", dir=hf_dir)
    try:
        for name, names in split.filename_to_tensors.items():
            write(os.path.join(staging, name), names)
        if split.is_sharded:
            write_json(
                os.path.join(staging, _INDEX),
                {"metadata": split.metadata, "weight_map": split.tensor_to_filename},
            )
        write_json(os.path.join(staging, "config.json"), config_to_hf(c))
        for name in _file_names(split):
            os.replace(os.path.join(staging, name), os.path.join(hf_dir, name))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    for name in os.listdir(hf_dir):
        if _WEIGHT_FILE.fullmatch(name) and name not in _file_names(split):
            os.remove(os.path.join(hf_dir, name))  # the earlier export's, now replaced


def save(hf_dir: str, c: ModelConfig, params, max_shard_bytes: int = 4 << 30) -> list:
    """Write `params` (canonical layout: host arrays or `jax.Array`s in any sharding) as a
    HuggingFace directory of `c`'s family that transformers' `AutoModelForCausalLM` loads
    (sharded above `max_shard_bytes`); returns the names of the files written (0o644;
    directories it creates 0o755).

    Streams: the host holds one tensor at a time (a stacked parameter is read one layer at a
    time). Atomic: a failed or killed export leaves an earlier one in `hf_dir` whole (see
    `_publish`). With params spanning several processes every process calls it: each tensor
    is gathered onto every host in turn and process 0 alone writes."""
    dtype = np.dtype(jnp.dtype(c.param_dtype))
    exports = _exports(c, params, dtype)
    shapes = hf_shapes(c)
    split = split_state_dict_into_shards_factory(
        {name: shapes[name] for name in exports},
        get_storage_size=lambda shape: math.prod(shape) * dtype.itemsize,
        filename_pattern=_SHARD_PATTERN,
        max_shard_size=max_shard_bytes,
    )
    if jax.process_index() == 0:
        _publish(
            hf_dir, c, split, lambda path, names: _write_file(path, names, shapes, exports, dtype)
        )
    else:
        for name in exports:  # process 0's gathers need this process too
            exports[name]()
    return _file_names(split)


@contextlib.contextmanager
def exporting(hf_dir: str):
    """The local folder an export to `hf_dir` is written in: `hf_dir` itself, or for a gs://
    or s3:// `hf_dir` a temporary folder that is uploaded (`_upload`) when the block ends
    without an error, then removed."""
    if not storage.is_remote(hf_dir):
        yield hf_dir
        return
    with tempfile.TemporaryDirectory(prefix="lclm-export-") as local:
        yield local
        _upload(local, hf_dir)


def _upload(local: str, hf_dir: str) -> None:
    """The files of the export in `local` to the object-store `hf_dir`, in `_publish`'s order
    (object stores have no rename to publish them at once): every file but config.json, then
    the removal of an earlier export's weight files that this one does not have (a stale
    index would name them), then config.json, which names the weights' shapes."""
    names = sorted(os.listdir(local))
    for name in names:
        if name != "config.json":
            storage.upload(os.path.join(local, name), storage.join(hf_dir, name))
    for name in storage.listdir(hf_dir):
        if _WEIGHT_FILE.fullmatch(name) and name not in names:
            storage.remove(storage.join(hf_dir, name))
    if "config.json" in names:
        storage.upload(os.path.join(local, "config.json"), storage.join(hf_dir, "config.json"))

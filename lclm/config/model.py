"""The model schema: `LlamaConfig` (the network) and `AttentionConfig` (how attention runs).

Typed, hashable views of `config.model` and `config.attention`; their defaults are the
defaults of those config sections (`schema.base_config` builds the sections from them).
No JAX here: configs are read before JAX starts.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Model hyper-parameters (a tiny model by default; `MODEL_PRESETS` hold real shapes)."""
    vocab_size: int = 512
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 192
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    dtype: str = "bfloat16"         # compute dtype (matmul inputs); sums stay float32
    param_dtype: str = "float32"
    scan_layers: bool = True
    remat: str = "attention"        # one of schema.REMAT_POLICIES
    ffn_chunk: int = 2048           # tokens per blockwise feed-forward chunk (per sp shard)
    loss_chunk: int = 2048          # tokens per blockwise cross-entropy chunk (per sp shard)
    # RoPE frequency scaling over rope_theta: "none", "linear" (every frequency / factor) or
    # "llama3" (Llama-3.1's: wavelengths above original/low_freq_factor slowed by factor,
    # below original/high_freq_factor kept, blended between); "auto" (config.model's default:
    # the init_from_hf source's scaling) means "none" here. The factors are HF's
    # rope_scaling fields (llama3: Llama-3.1's 8 / 1 / 4 / 8192)
    rope_scaling: str = "none"
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192
    # what an export's config.json states (not used by the computation): the source
    # checkpoint's token ids (bos_id -1: none; one or more eos ids) and its maximum position
    # count (an export states max(this, the data.seq_len trained))
    bos_id: int = 1
    eos_ids: tuple = (2,)
    max_position_embeddings: int = 4096

    def __post_init__(self):
        # a JSON round trip (saved configs) gives lists; the config stays hashable
        ids = self.eos_ids
        ids = (ids,) if isinstance(ids, int) else tuple(int(i) for i in ids)
        object.__setattr__(self, "eos_ids", ids)
        if self.rope_scaling == "auto":
            object.__setattr__(self, "rope_scaling", "none")

    @classmethod
    def from_config(cls, model_config) -> LlamaConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in dict(model_config).items() if k in names})

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """How attention is computed (`config.attention`): the kernel (`impl`, 'auto' picks one
    per platform), the token layout over the sp ring, the blockwise/ring tile sizes, and the
    context-parallel strategy over sp (`lclm.ops.context_parallel`): 'ring' passes K/V
    blocks round the ring, 'all_gather' gathers them, 'ulysses' trades the sequence split
    for a head split with all-to-alls, 'usp' runs Ulysses over groups of `ulysses`
    consecutive sp devices and the ring across the groups."""
    impl: str = "auto"
    layout: str = "striped"
    q_chunk: int = 512
    kv_chunk: int = 512
    strategy: str = "ring"  # ring | all_gather | ulysses | usp
    ulysses: int = 1  # usp's Ulysses degree: mesh.sp = ring members x ulysses

    def ring_size(self, sp: int) -> int:
        """Members of the ring over `sp` devices, the shards the token layout splits a
        sequence into: sp, or sp / ulysses under usp (each shard cut over its group)."""
        return sp // self.ulysses if self.strategy == "usp" else sp

    @classmethod
    def from_config(cls, attention_config) -> AttentionConfig:
        return cls(**dict(attention_config))

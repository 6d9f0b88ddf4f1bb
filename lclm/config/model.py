"""The model schema: `ModelConfig` (the network) and `AttentionConfig` (how attention runs).

Typed, hashable views of `config.model` and `config.attention`; their fields (`setting`:
default, help, accepted names and range) are those config sections' (`schema.base_config`
builds the sections from them). No JAX here: configs are read before JAX starts.
"""

from __future__ import annotations

import dataclasses
import math

from lclm.config.fields import (
    AT_LEAST_0,
    AT_LEAST_1,
    FINITE_NON_NEGATIVE,
    FINITE_POSITIVE,
    from_saved,
    setting,
)
from lclm.families import FAMILIES

# the dtypes a model computes and keeps its parameters in, and their bytes per element
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
DTYPES = tuple(DTYPE_BYTES)


@dataclasses.dataclass(frozen=True)
class Remat:
    """What a remat policy (`model.remat`) keeps of a layer's forward for its backward; the
    rest the backward computes again. Every policy keeps each layer's input (the scan's
    carry). lclm.models.decoder gives each its JAX checkpoint policy; the strategies' costs
    and the planner's memory model read these."""

    everything: bool = False  # nothing is computed again (no jax.checkpoint)
    attention_residuals: bool = False  # the attention's output and log-sum-exp (the names
    # the strategies give them): its forward, and what crosses the devices there, runs once
    matmuls: bool = False  # the matmuls' outputs (XLA's dots)
    host: bool = False  # what it keeps lives in host memory, not the device's

    @property
    def reruns_attention(self) -> bool:
        """Whether the backward runs the attention's forward (its transfers too) again."""
        return not (self.everything or self.attention_residuals)


# model.remat -> what it keeps, in the order the docs list them
REMAT = {
    "none": Remat(everything=True),
    "full": Remat(),
    "attention": Remat(attention_residuals=True),
    "offload": Remat(attention_residuals=True, host=True),
    "dots": Remat(matmuls=True),
    "dots_no_batch": Remat(matmuls=True),
}
REMAT_POLICIES = tuple(REMAT)
REMAT_HELP = (
    "what the backward recomputes: 'attention' keeps the attention's output (the ring "
    "runs once), 'full' keeps only layer inputs, 'offload' moves them to host memory, "
    "'none' keeps all"
)
# model.remat='auto' (lclm.train.remat_choice) is resolved where a train step is compiled; a
# program that compiles none (evaluation, conversion, the planner without a device) reads it as
# this policy
REMAT_AUTO_FALLBACK = "attention"
# the RoPE scalings lclm.models.decoder computes; model.rope_scaling also takes "auto"
ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")
# token layouts over the sp devices (lclm.ops.layout)
LAYOUTS = ("striped", "contiguous", "zigzag")
# the names attention.strategy and attention.impl take, known here before JAX starts: the
# registries (lclm.ops.context_parallel.STRATEGIES, lclm.ops.kernels.KERNELS) hold exactly
# these, in this order (tests/test_attention_names.py)
STRATEGY_NAMES = ("ring", "all_gather", "ulysses", "usp")
KERNEL_NAMES = ("blockwise", "cudnn_gpu", "pallas_gpu", "pallas_tpu", "tokamax_gpu")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale for a context `factor`: 0.1 mscale ln(factor) + 1 (1 at
    factor <= 1), as transformers' `get_mscale`."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


# the model families (lclm.families: each one's layer options and HuggingFace names)
FAMILY_NAMES = tuple(FAMILIES)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Model hyper-parameters (a tiny model by default; `MODEL_PRESETS` hold real shapes)."""

    family: str = setting(
        "llama",
        "the model family: its layer's options (qwen2: q/k/v "
        "biases; qwen3: an RMSNorm on each head's q and k) and its "
        "HuggingFace names (lclm.families)",
        choices=FAMILY_NAMES,
    )
    vocab_size: int = setting(512, rule=AT_LEAST_1)
    dim: int = setting(64, "hidden size", rule=AT_LEAST_1)
    n_layers: int = setting(2, rule=AT_LEAST_1)
    n_heads: int = setting(4, "query heads", rule=AT_LEAST_1)
    n_kv_heads: int = setting(2, "K/V heads (GQA; divides n_heads)", rule=AT_LEAST_1)
    head_dim: int = setting(
        0,
        "size of each attention head, even; 0: dim / n_heads (HF's "
        "head_dim: Mistral-NeMo's and Qwen3's differ from it)",
        rule=AT_LEAST_0,
    )
    ffn_dim: int = setting(192, "SwiGLU hidden size", rule=AT_LEAST_1)
    rope_theta: float = setting(10000.0, "RoPE base", rule=FINITE_POSITIVE)
    norm_eps: float = setting(1e-5, "RMSNorm epsilon")
    tie_embeddings: bool = setting(False, "the output projection is the embedding")
    init_std: float = setting(0.02, "standard deviation of fresh weights")
    dtype: str = setting(
        "bfloat16", "compute dtype (matmul inputs); sums stay float32", choices=DTYPES
    )
    param_dtype: str = setting(
        "float32", "dtype of the parameters and optimizer state", choices=DTYPES
    )
    scan_layers: bool = setting(True, "the layers as one lax.scan (one layer compiled)")
    remat: str = setting("attention", REMAT_HELP, choices=REMAT_POLICIES)
    ffn_chunk: int = setting(
        2048, "tokens per blockwise feed-forward chunk (per sp shard)", rule=AT_LEAST_1
    )
    loss_chunk: int = setting(
        2048, "tokens per blockwise cross-entropy chunk (per sp shard)", rule=AT_LEAST_1
    )
    rope_scaling: str = setting(
        "none",
        "RoPE frequency scaling over rope_theta: 'none', 'linear' (every frequency / "
        "factor), 'llama3' (Llama-3.1's: wavelengths above original/low_freq_factor slowed "
        "by factor, below original/high_freq_factor kept, blended between) or 'yarn' (YaRN, "
        "as Qwen's long-context configs ask: dimensions that turn fewer than beta_slow times "
        "over the original context slowed by factor, more than beta_fast times kept, a "
        "linear ramp between; q and k scaled by the attention factor)",
        choices=ROPE_SCALINGS,
    )
    rope_factor: float = setting(
        8.0, "HF's rope_scaling factor (Llama-3.1: 8)", rule=FINITE_POSITIVE
    )
    rope_low_freq_factor: float = setting(
        1.0, "llama3 scaling (Llama-3.1: 1)", rule=FINITE_POSITIVE
    )
    rope_high_freq_factor: float = setting(
        4.0, "llama3 scaling (Llama-3.1: 4)", rule=FINITE_POSITIVE
    )
    rope_original_max_positions: int = setting(
        8192, "the context the scaling starts from (Llama-3.1: 8192)", rule=AT_LEAST_1
    )
    rope_beta_fast: float = setting(
        32.0,
        "yarn: rotations over the original context above which a dimension is kept",
        rule=FINITE_POSITIVE,
    )
    rope_beta_slow: float = setting(
        1.0, "yarn: rotations below which it is slowed by factor", rule=FINITE_POSITIVE
    )
    rope_attention_factor: float = setting(
        0.0,
        "yarn: cos and sin (so q and k) scaled by this; 0: 0.1 ln(factor) + 1, YaRN's own",
        rule=FINITE_NON_NEGATIVE,
    )
    rope_truncate: bool = setting(
        True, "yarn: the ramp's ends rounded to whole dimensions (HF's default)"
    )
    bos_id: int = setting(
        1,
        "what an export's config.json states: the source checkpoint's "
        "beginning-of-sequence id (-1: none)",
    )
    eos_ids: tuple = setting((2,), "and its end-of-sequence ids (one or more)")
    max_position_embeddings: int = setting(
        4096,
        "and its maximum position count (an export states max(this, the data.seq_len trained))",
        rule=AT_LEAST_1,
    )

    def __post_init__(self):
        # a JSON round trip (saved configs) gives lists; the config stays hashable
        ids = self.eos_ids
        ids = (ids,) if isinstance(ids, int) else tuple(int(i) for i in ids)
        object.__setattr__(self, "eos_ids", ids)
        if self.rope_scaling == "auto":
            object.__setattr__(self, "rope_scaling", "none")
        if self.remat == "auto":
            object.__setattr__(self, "remat", REMAT_AUTO_FALLBACK)
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)

    @classmethod
    def from_config(cls, model_config) -> ModelConfig:
        return from_saved(cls, dict(model_config))


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """How attention is computed: the kernel, the token layout over the sp devices, the
    blockwise tile sizes and the context-parallel strategy over sp."""

    impl: str = setting(
        "auto",
        "the attention kernel (lclm.ops.kernels.KERNELS); 'auto' picks "
        "the fastest that serves the shapes on each platform",
        choices=("auto", *KERNEL_NAMES),
    )
    layout: str = setting(
        "striped",
        "which tokens each sp device holds: 'striped' (token i on "
        "device i mod sp), 'contiguous' or 'zigzag'",
        choices=LAYOUTS,
    )
    q_chunk: int = setting(512, "query tile of the attention kernel", rule=AT_LEAST_1)
    kv_chunk: int = setting(512, "key/value tile of the attention kernel", rule=AT_LEAST_1)
    strategy: str = setting(
        "ring",
        "what crosses the sp devices (lclm.ops.context_parallel."
        "STRATEGIES): 'ring' passes K/V blocks round the ring, "
        "'all_gather' gathers them, 'ulysses' trades the sequence split for "
        "a head split with all-to-alls, 'usp' runs Ulysses over groups of "
        "`ulysses` consecutive sp devices and the ring across the groups",
        choices=STRATEGY_NAMES,
    )
    ulysses: int = setting(
        1, "usp's Ulysses degree: mesh.sp = ring members x ulysses", rule=AT_LEAST_1
    )

    @classmethod
    def from_config(cls, attention_config) -> AttentionConfig:
        return cls(**dict(attention_config))

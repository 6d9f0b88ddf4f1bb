"""Extend Qwen3-8B from its 32K to 262,144 tokens with YaRN, striped ring attention over sp=8.

    python train.py --config configs/qwen3_8b_256k.py \
        --config.model.init_from_hf=/path/to/Qwen3-8B --config.data.path=/path/to/books \
        --config.data.tokenizer=/path/to/Qwen3-8B
    python -m lclm.plan --config configs/qwen3_8b_256k.py --compile v4-64

Starts from the HuggingFace weights (`model.init_from_hf`: family qwen3, its q/k norms and
head_dim 128 come from config.json) and trains on long text documents with Qwen's own
tokenizer (tokenizer.json). Qwen3's model card reaches 131,072 tokens with YaRN factor 4 over
its native 32,768; this recipe asks YaRN for factor 8 over the same 32,768 (262,144 tokens)
and fine-tunes there, 1M tokens per step (4 x 256K) for 200 steps, at rope_theta 1e6 as
shipped. Fits 32 devices: 4 nodes x 8 H100, or a TPU v4-64 slice (32 chips of 32 GiB), with
FSDP over the 4 rows of 8 sequence shards; compiled ahead of time for both (README's tables).
Exports (`python -m lclm.convert --to-hf`) state the YaRN scaling in config.json, so
transformers and vLLM run the extended model as trained.
"""

import os

from lclm.config import apply_preset, load_config

BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_long_context_256k.py")


def get_config():
    c = apply_preset(load_config(BASE), "qwen3_8b")
    c.workdir = "runs/qwen3_8b_256k"
    # YaRN over the native context (the model card's form, with factor 8 for 256K). A loss
    # chunk of 2048 tokens: its float32 logits over Qwen's 151,936-token vocabulary are 1.2 GiB
    # (8192, LLaMA-2's chunk, would hold 4.6 GiB of them)
    c.model.update(
        init_from_hf="checkpoints/Qwen3-8B",
        rope_scaling="yarn",
        rope_factor=8.0,
        rope_original_max_positions=32768,
        loss_chunk=2048,
    )
    c.data.tokenizer = "checkpoints/Qwen3-8B"
    c.train.update(steps=200, lr=1e-5)
    return c

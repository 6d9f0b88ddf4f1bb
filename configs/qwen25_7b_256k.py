"""Extend Qwen2.5-7B-Instruct from its 32K to 262,144 tokens in two stages with striped ring
attention.

    python train.py --config configs/qwen25_7b_256k.py \
        --config.model.init_from_hf=/path/to/Qwen2.5-7B-Instruct \
        --config.data.tokenizer=/path/to/Qwen2.5-7B-Instruct --config.data.path=/path/to/books
    python -m lclm.plan --config configs/qwen25_7b_256k.py --compile h100:4x8

Starts from the HuggingFace weights (`model.init_from_hf`: family qwen2, its q/k/v biases from
the safetensors) and trains on long text documents with Qwen's own tokenizer (tokenizer.json;
chat data would take `data.chat_template='tokenizer'`, its ChatML). Stages 64K -> 256K, the
second from the first's final weights, at RoPE theta 1e7 (the base Qwen2.5-7B-Instruct-1M's
config.json states), and 1M tokens per step in both (16 x 64K, 4 x 256K). The ring grows
with the sequence: sp=4 at 64K and sp=8 at 256K, 16K-32K tokens per device; FSDP takes the
other devices: 32 H100s, 4 nodes of 8 (compiled ahead of time for them: README's GPU
table). Qwen2.5-7B's 28 query heads rule out Ulysses over 8 at 256K, not usp's 4 x ring 2
(python -m lclm.plan --strategies). Re-running the command resumes.

Each stage has its own remat: stage 0 offloads its saved activations to host memory
(`remat='offload'`: with them on the device it would not fit a v4-64's 32 GiB chips, 30.8
GiB planned), stage 1 keeps the attention's output on the device (`remat='attention'`): on a
TPU v4-64, libtpu 0.0.42.1 aborts on stage 1's host offload ("Strided host DMA (non iova) is
not supported", a check in its async_dynamic_index_emitter) and compiles it with 'attention'
(28.26 GiB of 32, measured when the stages were run as two invocations).
"""

import os

from lclm.config import apply_preset, load_config

BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_long_context_256k.py")


def get_config():
    c = apply_preset(load_config(BASE), "qwen25_7b")
    c.workdir = "runs/qwen25_7b_256k"
    # a loss chunk of 2048 tokens: its float32 logits over the 152,064-token vocabulary are
    # 1.2 GiB (LLaMA-2's 8192 would hold 4.6 GiB of them)
    c.model.update(init_from_hf="checkpoints/Qwen2.5-7B-Instruct", loss_chunk=2048)
    c.data.tokenizer = "checkpoints/Qwen2.5-7B-Instruct"
    c.stages.update(
        tokens_per_batch=1 << 20,
        list=[
            dict(
                data=dict(seq_len="64k"),
                train=dict(steps=300),
                mesh=dict(sp=4),
                model=dict(remat="offload", rope_theta=1e7),
            ),
            dict(
                data=dict(seq_len="256k"),
                train=dict(steps=150),
                mesh=dict(sp=8),
                model=dict(remat="attention"),
            ),
        ],
    )
    c.train.update(steps=150, lr=1e-5)
    c.validation.lengths = "stages"
    return c

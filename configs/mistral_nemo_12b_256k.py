"""Extend Mistral-NeMo-12B from its 128K to 262,144 tokens with striped ring attention over
sp=8.

    python train.py --config configs/mistral_nemo_12b_256k.py \
        --config.model.init_from_hf=/path/to/Mistral-Nemo-Base-2407 \
        --config.data.tokenizer=/path/to/Mistral-Nemo-Base-2407 --config.data.path=/path/to/books
    python -m lclm.plan --config configs/mistral_nemo_12b_256k.py --compile v4-64

Starts from the HuggingFace weights (`model.init_from_hf`: family mistral, head_dim 128 apart
from 5120 / 32; its config.json sets no sliding window) and trains on long text documents with
its own tokenizer (tokenizer.json, Tekken). NeMo was trained to 128K at RoPE theta 1e6; this
recipe doubles the context at theta 1e7 (as LWM raised it at 128K and 256K, Liu et al. 2024),
1M tokens per step (4 x 256K) for 200 steps. 12.2B parameters and their AdamW state in float32
are 6.1 GB per device over 32 devices: 4 nodes x 8 H100, or a v4-64 slice, FSDP over the 4
rows of 8 sequence shards. Re-running the command resumes.
"""

import os

from lclm.config import apply_preset, load_config

BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_long_context_256k.py")


def get_config():
    c = apply_preset(load_config(BASE), "mistral_nemo_12b")
    c.workdir = "runs/mistral_nemo_12b_256k"
    c.model.update(
        init_from_hf="checkpoints/Mistral-Nemo-Base-2407", rope_theta=1e7, loss_chunk=4096
    )
    c.data.tokenizer = "checkpoints/Mistral-Nemo-Base-2407"
    c.train.update(steps=200, lr=1e-5)
    return c

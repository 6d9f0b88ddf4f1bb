"""UltraLong-style extension (Xu et al., NVIDIA 2025, "From 128K to 4M: Efficient Training of
Ultra-Long Context Large Language Models"): Llama-3.1-8B-Instruct from 128K to 1M tokens in
one stage with YaRN.

    python -m lclm.plan --config configs/ultralong_llama31_8b_1m.py --devices 64 \
        --device h100-nvlink
    launch/submit_slurm.sh --nodes 8 --gpus-per-node 8 -- \
        --config configs/ultralong_llama31_8b_1m.py \
        --config.model.init_from_hf=/path/to/Llama-3.1-8B-Instruct \
        --config.data.tokenizer=/path/to/Llama-3.1-8B-Instruct --config.data.path=...

From UltraLong: one stage of about 1B tokens; YaRN over the original 8K context with alpha 1
and beta 4 (`rope_beta_slow`, `rope_beta_fast`) and factor 128 for 1M (256 for 2M, 512 for
4M: set `data.seq_len` and `model.rope_factor` together); documents separated by the end-of-
text token with no document masks (`data.document_mask=False`, positions running on across
the row); long documents upsampled. lclm's choices, not taken from the paper: RoPE theta
kept at Llama-3.1's 5e5, peak lr 3e-5 with a 10-step warm-up and cosine decay to 10%, 4
sequences (4M tokens) per step, so 1B tokens are 239 steps; documents of 64K tokens or more
drawn 3 times per epoch and those under 4K kept with probability 0.3.

Hardware: 64 H100s (8 nodes of 8), sp=16 (64K tokens per GPU) and FSDP over the other four;
the attention's output kept on the GPU (`remat='attention'`) fits there (`python -m lclm.plan`
prints the fit; `remat='offload'` moves the saved activations to host memory).
"""

import os

from lclm.config import apply_preset, load_config

BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_long_context.py")
# long documents upsampled (x3 at 64K+), short ones thinned (p 0.3 under 4K)
LONG = "long_above=64k&long_repeat=3&short_below=4k&short_keep=0.3"


def get_config():
    c = apply_preset(load_config(BASE), "llama3_8b")
    c.workdir = "runs/ultralong_llama31_8b_1m"
    c.mesh.sp = 16
    c.model.update(
        init_from_hf="checkpoints/Llama-3.1-8B-Instruct",
        remat="attention",
        ffn_chunk=8192,
        loss_chunk=2048,
        rope_theta=500000.0,
        rope_scaling="yarn",
        rope_factor=128.0,
        rope_original_max_positions=8192,
        rope_beta_fast=4.0,
        rope_beta_slow=1.0,
    )
    c.data.update(
        source="tokenized",
        path=f"data/long_documents?{LONG}",
        tokenizer="checkpoints/Llama-3.1-8B-Instruct",
        seq_len=1 << 20,
        batch_size=4,
        document_mask=False,
        reset_positions=False,
        mixture_unit="tokens",
        balance=True,
    )
    c.train.update(steps=239, lr=3e-5, warmup=10, decay="cosine")
    c.validation.update(every=50, lengths="128k,1m")
    c.checkpoint.every = 25
    return c

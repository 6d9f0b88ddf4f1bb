"""Fine-tune LLaMA-2-13B to 524,288 tokens on ShareGPT in four stages (Ring Attention, 5.3).

    python train.py --config configs/llama13b_512k.py \
        --config.model.init_from_hf=/path/to/Llama-2-13b-hf \
        --config.data.path=/path/to/sharegpt.json
    python -m lclm.plan --config configs/llama13b_512k.py --devices 32 --device a100-nvlink
    python -m lclm.eval line-retrieval --checkpoint runs/llama13b_512k/stage3_524288 \
        --lengths 32k,128k,256k,512k
    python -m lclm.eval perplexity --checkpoint runs/llama13b_512k/stage3_524288 \
        --data /path/to/heldout_books --lengths 32k,128k,256k,512k
    python -m lclm.eval passkey --checkpoint runs/llama13b_512k/stage3_524288 \
        --lengths 32k,128k,256k,512k

The Ring Attention paper fine-tuned LLaMA-13B to 512K on ShareGPT with 32 A100 80GB and
evaluated it by line retrieval; this is that run as an lclm recipe, judged by line retrieval
(as the paper), perplexity by position on held-out books and passkey to the full length
(the commands above; after each stage, its own workdir and lengths so far), with held-out
conversations validated at every stage's length so far while training
(--config.validation.path=/path/to/heldout.json, val_loss@LEN). Stages 32K -> 128K ->
256K -> 512K, each starting from the previous stage's final weights (stage 0 from the
HuggingFace weights), RoPE theta raised per stage as in LWM (Liu et al. 2024: 1e6 at 32K,
1e7 at 128K-256K, 2.5e7 at 512K), 2M tokens per step in every stage (64 x 32K ... 4 x 512K
sequences), loss only on the assistant replies (Vicuna template). The ring grows with the
sequence (sp 4 -> 8 -> 16 -> 32: 8K-16K tokens per device) and FSDP takes the rest of the 32
devices; parameters and optimizer state are sharded over fsdp x sp either way.

On TPUs: a v4-64 slice (32 chips), checked ahead of time with
`python -m lclm.plan --config configs/llama13b_512k.py --compile v4-64`.
"""

import os

from lclm.config import apply_preset, load_config

BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_long_context.py")


def get_config():
    c = apply_preset(load_config(BASE), "llama2_13b")
    c.workdir = "runs/llama13b_512k"
    c.mesh.sp = 32
    # remat='offload': each layer's saved input and ring output wait in host memory. With
    # 'attention' XLA:TPU needs 93.7 GiB per device in every stage (a v5p's 95; more than an
    # A100's 80); offloaded 30.1 GiB of a v4's 32 (plan --compile v4-64), with about 50 GiB
    # of host memory per device.
    c.model.update(
        init_from_hf="checkpoints/Llama-2-13b-hf", remat="offload", ffn_chunk=4096, loss_chunk=4096
    )
    c.data.update(
        source="sharegpt",
        path="data/sharegpt.json",
        chat_template="vicuna",
        seq_len=524288,
        batch_size=4,
    )
    c.stages.update(
        schedule="32k:1e6:200:4, 128k:1e7:100:8, 256k:1e7:60:16, 512k:2.5e7:60:32",
        tokens_per_batch=1 << 21,
    )
    c.train.update(steps=60, lr=2e-5, warmup=10)
    # held-out conversations (empty: none until given) at this and every earlier stage's length
    c.validation.update(every=20, lengths="stages")
    c.checkpoint.every = 20
    return c

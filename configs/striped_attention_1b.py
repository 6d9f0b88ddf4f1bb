"""The 1B model of Striped Attention (vocab 32000, 22 layers, 16 heads x 128, ffn 5504)
at 32K tokens on one device (sp=1) or a few.

One H100, or one TPU v5p chip: `python -m lclm.plan --config configs/striped_attention_1b.py
--compile v5p-2` (34.7 GiB of 95).
"""

from lclm.config import apply_preset, base_config


def get_config():
    c = apply_preset(base_config(), "striped_attention_1b")
    c.workdir = "runs/striped_attention_1b"
    c.mesh.update(dp=1, fsdp=-1, tp=1, sp=1)
    c.model.update(dtype="bfloat16", remat="attention", ffn_chunk=4096, loss_chunk=4096)
    c.attention.update(q_chunk=1024, kv_chunk=1024)
    c.data.update(seq_len=32768, batch_size=1)
    c.train.update(steps=1000, lr=3e-4, warmup=100)
    return c

"""LLaMA-3.2-3B shapes (3.2B params) at 64K tokens, sequence-parallel over sp=4.

Four devices: 4 H100s, or a TPU v4-8 slice (4 chips): `python -m lclm.plan --config
configs/llama3b.py --compile v4-8` (25.9 GiB of 32 per chip).
"""

from lclm.config import apply_preset, base_config


def get_config():
    c = apply_preset(base_config(), "llama3_3b")
    c.workdir = "runs/llama3b"
    c.mesh.update(dp=1, fsdp=-1, tp=1, sp=4)
    c.model.update(dtype="bfloat16", remat="attention", ffn_chunk=4096, loss_chunk=4096)
    c.attention.update(q_chunk=1024, kv_chunk=1024)
    c.data.update(seq_len=65536, batch_size=1)
    c.train.update(steps=1000, lr=2e-4, warmup=100)
    return c

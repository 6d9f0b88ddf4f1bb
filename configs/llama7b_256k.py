"""LLaMA-2-7B shapes at 262,144-token sequences with striped ring attention.

Mesh: sp=8 (32,768 tokens per device, well above the ~1-4K block needed to hide the ring's
K/V transfer behind compute on TPU v4 ICI / NVLink, seed 003 Table 2) times fsdp over the
remaining devices: 32 devices (a v4-64 slice = 32 chips, or 4 nodes x 8 H100) gives fsdp=4,
batch 4 x 256K = 1M tokens per step. RoPE theta 1e7, as LWM used at 128K-256K.
"""

from lclm.config import apply_preset, base_config


def get_config():
    c = apply_preset(base_config(), "llama2_7b")
    c.workdir = "runs/llama7b_256k"
    c.mesh.update(dp=1, fsdp=-1, tp=1, sp=8)
    c.model.update(rope_theta=1e7, dtype="bfloat16", param_dtype="float32", scan_layers=True,
                   remat="full", ffn_chunk=8192, loss_chunk=8192)
    c.attention.update(impl="blockwise", layout="striped", q_chunk=2048, kv_chunk=2048)
    c.data.update(source="text", seq_len=262144, batch_size=4)
    c.train.update(steps=2000, lr=2e-5, warmup=100, min_lr_ratio=0.1, weight_decay=0.0,
                   clip=1.0, grad_accum=1)
    c.log.every = 1
    c.checkpoint.update(every=100, keep=3)
    return c

"""LLaMA-3.2-3B shapes (3.2B params) at 64K tokens, sequence-parallel over sp=4.

Four devices: 4 H100s, or a TPU v4-8 slice (4 chips): `python -m lclm.plan --config
configs/llama3b.py --compile v4-8` (25.9 GiB of 32 per chip).
"""

import os

from lclm.config import apply_preset, load_config

BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_shapes.py")


def get_config():
    c = apply_preset(load_config(BASE), "llama3_3b")
    c.workdir = "runs/llama3b"
    c.mesh.sp = 4
    c.data.seq_len = 65536
    c.train.lr = 2e-4
    return c

"""The 1B model of Striped Attention (vocab 32000, 22 layers, 16 heads x 128, ffn 5504)
at 32K tokens on one device (sp=1) or a few.

One H100, or one TPU v5p chip: `python -m lclm.plan --config configs/striped_attention_1b.py
--compile v5p-2` (34.7 GiB of 95).
"""

import os

from lclm.config import apply_preset, load_config

BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_shapes.py")


def get_config():
    c = apply_preset(load_config(BASE), "striped_attention_1b")
    c.workdir = "runs/striped_attention_1b"
    return c

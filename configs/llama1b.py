"""LLaMA-3.2-1B shapes (1.24B params) at 32K tokens on one device (sp=1) or a few.

One H100, or one TPU v5p chip. `model.remat='auto'`: the least recomputation whose compiled
step fits the device (lclm.train.remat_choice). Compiled without the hardware
(`python -m lclm.plan --config configs/llama1b.py --compile v5p-2`, or `h100:1` with
lclm[gpu-aot]; jax 0.10.2, 2026-11-28): on a v5p chip 'none' (73.57 GiB of 95); on an H100
'attention' at 32K (24.76 GiB of the 58.3 GiB budget at JAX's default memory fraction; 'none'
needs 62.37) and 'none' at 8K (30.39 GiB).
"""

import os

from lclm.config import apply_preset, load_config

BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_shapes.py")


def get_config():
    c = apply_preset(load_config(BASE), "llama3_1b")
    c.workdir = "runs/llama1b"
    c.model.remat = "auto"
    return c

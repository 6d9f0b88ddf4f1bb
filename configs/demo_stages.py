"""The staged long-context recipe at CPU scale: a tiny LLaMA extended 128 -> 256 -> 512
tokens on the bundled ShareGPT conversations, RoPE theta raised per stage, 4,096 tokens per
step throughout, striped ring attention over sp=2 -> 4 simulated devices. A minute or two on
2 cores; add --config.model.init_from_hf=DIR to start from a HuggingFace LLaMA directory.

    python train.py --config configs/demo_stages.py
"""

import os

from lclm.config import load_config

HERE = os.path.dirname(os.path.abspath(__file__))
DEMO = os.path.join(os.path.dirname(HERE), "data", "demo")


def get_config():
    c = load_config(os.path.join(HERE, "_tiny.py"))
    c.workdir = "runs/demo_stages"
    c.mesh.fsdp = 2
    c.model.update(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192, ffn_chunk=64, loss_chunk=64
    )
    c.data.update(source="sharegpt", path=f"{DEMO}/sharegpt.jsonl", seq_len=512, batch_size=8)
    c.stages.update(schedule="128:1e4:20:2, 256:1e5:15:4, 512:1e6:15:4", tokens_per_batch=4096)
    c.train.update(steps=15, warmup=5)
    c.log.every = 5
    return c

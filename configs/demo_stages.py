"""The staged long-context recipe at CPU scale: a tiny LLaMA extended 128 -> 256 -> 512
tokens on the bundled ShareGPT conversations, RoPE theta raised per stage, 4,096 tokens per
step throughout, striped ring attention over sp=2 -> 4 simulated devices. A minute or two on
2 cores; add --config.model.init_from_hf=DIR to start from a HuggingFace LLaMA directory.

    python train.py --config configs/demo_stages.py
"""

import os

from lclm.config import base_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def get_config():
    c = base_config()
    c.workdir = "runs/demo_stages"
    c.mesh.update(dp=1, fsdp=2, tp=1, sp=4)
    c.model.update(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192,
                   dtype="float32", ffn_chunk=64, loss_chunk=64)
    c.attention.update(layout="striped", q_chunk=32, kv_chunk=32)
    demo = os.path.join(ROOT, "data", "demo")
    c.data.update(source="sharegpt", path=f"{demo}/sharegpt.jsonl",
                  tokenizer=os.path.join(demo, "tokenizer.model"), seq_len=512, batch_size=8)
    c.stages.update(schedule="128:1e4:20:2, 256:1e5:15:4, 512:1e6:15:4", tokens_per_batch=4096)
    c.train.update(steps=15, lr=3e-3, warmup=5, weight_decay=0.0)
    c.log.every = 5
    return c

"""Not a recipe: _long_context.py's settings with what the 256K recipes share besides
(llama7b_256k, qwen25_7b_256k, qwen3_8b_256k, mistral_nemo_12b_256k: a 7B-12B model at
262,144 tokens on 32 devices, 4 nodes x 8 H100 or a TPU v4-64 slice).

A ring of sp=8 sequence shards (32K tokens per device at 256K) and FSDP over the 4 rows of
them, each layer's saved input and ring output waiting in host memory (`remat='offload'`),
the feed-forward in 8,192-token chunks, long text documents (`data/long_documents`, prepared
with `python -m lclm.data.prepare`) in 4 rows of 256K, a 20-step warm-up, held-out data
every 50 steps and a checkpoint every 50. A recipe sets its model, weights, tokenizer, loss
chunk, stages and learning rate.
"""

import os

from lclm.config import load_config

BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_long_context.py")


def get_config():
    c = load_config(BASE)
    c.mesh.sp = 8
    c.model.update(remat="offload", ffn_chunk=8192)
    c.data.update(source="text", path="data/long_documents", seq_len=262144, batch_size=4)
    c.train.warmup = 20
    c.validation.every = 50
    c.checkpoint.every = 50
    return c

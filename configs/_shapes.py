"""Not a recipe: the settings the model-shape recipes share, which they load and build on
(llama1b, llama3b, striped_attention_1b): a model preset's shapes trained at one length on
one device or a few.

bfloat16, the attention's output kept for the backward pass (`remat='attention'`), the
feed-forward and the loss in 4,096-token chunks, attention in 1,024-token blocks, one
32K-token sequence a step on one device (sp=1, FSDP over any others), 1,000 steps at a peak
lr of 3e-4 after 100 of warm-up. A recipe sets its preset and whatever it does otherwise.
"""

from lclm.config import base_config


def get_config():
    c = base_config()
    c.mesh.update(dp=1, fsdp=-1, tp=1, sp=1)
    c.model.update(dtype="bfloat16", remat="attention", ffn_chunk=4096, loss_chunk=4096)
    c.attention.update(q_chunk=1024, kv_chunk=1024)
    c.data.update(seq_len=32768, batch_size=1)
    c.train.update(steps=1000, lr=3e-4, warmup=100)
    return c

"""Not a recipe: the settings the CPU recipes share, which they load and build on (demo,
demo_stages, tiny_line_retrieval): a tiny LLaMA on the bundled demo tokenizer (512 tokens),
trained on simulated devices without an accelerator.

The demo tokenizer's vocabulary, float32 (XLA:CPU has no fast bfloat16 matmul), striped ring
attention over sp=4 in 32-token blocks, a peak lr of 3e-3 without weight decay. A recipe sets
the model's size, the FSDP axis, its data and schedule.
"""

import os

from lclm.config import base_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def get_config():
    c = base_config()
    c.mesh.update(dp=1, tp=1, sp=4)
    c.model.update(vocab_size=512, dtype="float32")
    c.attention.update(layout="striped", q_chunk=32, kv_chunk=32)
    c.data.tokenizer = os.path.join(ROOT, "data", "demo", "tokenizer.model")
    c.train.update(lr=3e-3, weight_decay=0.0)
    return c

"""The embedded demo: a tiny LLaMA on the bundled synthetic corpus and conversations, striped
ring attention over sp=4 x fsdp=2: 8 simulated CPU devices without an accelerator; on a
machine with fewer accelerators the mesh fits itself to them (mesh.fit: sp=4 on 4 GPUs, sp=2
on 2, one device on 1), the same losses on each. About 190 CPU-seconds: two to three minutes
on 2 cores."""

import os

from lclm.config import load_config

HERE = os.path.dirname(os.path.abspath(__file__))
DEMO = os.path.join(os.path.dirname(HERE), "data", "demo")


def get_config():
    c = load_config(os.path.join(HERE, "_tiny.py"))
    c.workdir = "runs/demo"
    c.mesh.update(fsdp=2, fit=True)
    c.model.update(
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=384,
        rope_theta=10000.0,
        ffn_chunk=64,
        loss_chunk=64,
    )
    # a mixture: 80% documents of the text corpus, 20% ShareGPT conversations
    c.data.update(
        path=f"{DEMO}/corpus.jsonl@0.8,sharegpt:{DEMO}/sharegpt.jsonl@0.2",
        seq_len=512,
        batch_size=8,
    )
    # held-out documents of the corpus' grammar: val_loss every 50 steps (about 1 s each); the
    # file names its kind, as a held-out entry without one takes data.source's, which a run
    # on your own chats (--config.data.source=sharegpt) changes
    c.validation.update(path=f"text:{DEMO}/heldout.jsonl", every=50, batches=2)
    c.train.update(steps=200, warmup=20)
    c.log.every = 20
    return c

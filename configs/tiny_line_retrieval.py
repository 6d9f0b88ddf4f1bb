"""A tiny LLaMA trained from scratch on line retrieval (Ring Attention's long-context test) with
striped ring attention over sp=4 simulated devices, in context-extension stages: a few
minutes on 2 CPU cores.

    python train.py --config configs/tiny_line_retrieval.py
    python -m lclm.eval.line_retrieval --checkpoint runs/tiny_line_retrieval/stage1_128 \\
        --lengths 64,128,256

Documents are exactly `data.seq_len` tokens ("line 1: 7. line 2: 3. ... Tell me line 2:"
+ " 3"), one per packed row, the loss only on the answer and its EOS. The task is kept
small enough for a CPU: one-digit numbers (chance is 1/9) and digits that are single tokens
of the demo tokenizer. From scratch, this model learns retrieval among the 5 lines of a
64-token document within a few hundred steps but not among the 10 lines of 128 tokens, so
the run starts at 64 tokens and then extends the context (`stages.schedule`, each stage
from the previous one's weights, `{workdir}/stage{i}_{seq_len}`); the documents follow each
stage's `data.seq_len` (a reference, not a copy).
"""

import os

import ml_collections

from lclm.config import base_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def get_config():
    c = base_config()
    c.workdir = "runs/tiny_line_retrieval"
    c.mesh.update(dp=1, fsdp=1, tp=1, sp=4)
    c.model.update(vocab_size=512, dim=128, n_layers=2, n_heads=8, n_kv_heads=8, ffn_dim=256,
                   rope_theta=10000.0, dtype="float32", remat="none", ffn_chunk=16,
                   loss_chunk=16)
    c.attention.update(layout="striped", q_chunk=16, kv_chunk=16)
    c.data.update(tokenizer=os.path.join(ROOT, "data", "demo", "tokenizer.model"),
                  seq_len=64, batch_size=64)
    # one document per row, whatever the (stage's) sequence length
    c.data.path = (ml_collections.FieldReference("line_retrieval:digits=1;seed=0;tokens=")
                   + c.data.get_ref("seq_len").to_str())
    c.train.update(steps=600, lr=3e-3, warmup=50, weight_decay=0.0)
    # stage 1 fine-tunes stage 0's weights with a fresh optimizer: at stage 0's 3e-3 it wiped
    # the retrieval stage 0 had learned (0.30 at 128 tokens, 0.18 at 64); at 1e-3 it extends it
    c.stages.update(schedule="64:1e4:600, 128:1e4:600", tokens_per_batch=4096, extend_lr=1e-3)
    c.log.every = 50
    c.checkpoint.every = 200
    return c

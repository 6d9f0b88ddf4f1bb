"""A tiny LLaMA trained from scratch on line retrieval (Ring Attention's long-context test) with
striped ring attention over sp=4 simulated devices, in context-extension stages: a few
minutes on 2 CPU cores.

    python train.py --config configs/tiny_line_retrieval.py
    python -m lclm.eval line-retrieval --checkpoint runs/tiny_line_retrieval/stage1_128 \\
        --lengths 64,128 --samples 40

Documents are exactly their length in tokens ("line 1: 7. line 2: 3. ... Tell me line 2:"
+ " 3"), the loss only on the answer and its EOS. The task is kept small enough for a CPU:
one-digit numbers (chance is 1/9) and digits that are single tokens of the demo tokenizer.
From scratch, this model learns retrieval among the 5 lines of a 64-token document within a
few hundred steps but not among the 10 lines of 128 tokens, so the run starts at 64 tokens
and then extends the context (`stages.list`, each stage from the previous one's weights,
`{workdir}/stage{i}_{seq_len}`), with weight decay 1.0 in the extension stage. Each stage
trains on documents of its length, one per row, and 15% at half of it, the previous stage's
length (filled to the row's length after their answer): without them stage 1 forgot what
stage 0 learned (docs/evaluation.md). Held-out
documents are validated at every stage's length so far (val_loss@64, val_loss@128 in
metrics.jsonl).
"""

import os

import ml_collections

from lclm.config import load_config

BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_tiny.py")


def get_config():
    c = load_config(BASE)
    c.workdir = "runs/tiny_line_retrieval"
    # chunks of 32 (the base's attention blocks too): stage 1's 32 tokens per device in one
    # block (8% faster than 16, same losses)
    c.model.update(
        dim=128,
        n_layers=2,
        n_heads=8,
        n_kv_heads=8,
        ffn_dim=256,
        rope_theta=10000.0,
        remat="none",
        ffn_chunk=32,
        loss_chunk=32,
    )
    c.data.update(seq_len=64, batch_size=64)
    # one document per row: 85% at the stage's length, 15% at half of it (the previous
    # stage's length of this doubling schedule), filled up to the row's length after the
    # answer, so that an extension keeps what the stage before learned (references, not
    # copies: they follow each stage's data.seq_len)
    seq_len = c.data.get_ref("seq_len")
    source = "line_retrieval:digits=1;seed={seed};tokens="
    c.data.path = (
        ml_collections.FieldReference(source.format(seed=1))
        + (seq_len // 2).to_str()
        + ";pad_to="
        + seq_len.to_str()
        + "@0.15,"
        + source.format(seed=0)
        + seq_len.to_str()
        + "@0.85"
    )
    # held-out documents (another seed) at this stage's length and every earlier stage's:
    # val_loss@64 and val_loss@128 show the gain at 128 and whether 64 was forgotten
    c.validation.update(
        path=ml_collections.FieldReference(source.format(seed=99)) + seq_len.to_str(),
        every=200,
        batches=1,
        lengths="stages",
    )
    c.train.warmup = 50
    # Stage 0 at 700 steps: at 450 its cosine had decayed before seed 3 left the plateau at
    # chance (val_loss 0.42 at step 450); lr 6e-3 instead stayed at chance for 450 steps.
    # Stage 1 fine-tunes stage 0's weights (and Adam's moments) at 2e-3: at 1e-3 it learned 128
    # tokens too slowly (0.72 after 800 steps, seed 0), at 3e-3 no better (0.85). Its weight
    # decay of 1.0 is what makes every seed find the exact solution: without it seeds 1 and 3
    # reached val_loss 0.000 at 128 tokens but seeds 0 and 2 stayed at 0.09 and 0.05 (92% and
    # 88%: they missed line numbers 64-token documents never show); with it both reach 100%
    # (docs/evaluation.md, the seed sweep).
    c.stages.update(
        tokens_per_batch=4096,
        list=(
            dict(data=dict(seq_len=64), model=dict(rope_theta=1e4), train=dict(steps=700)),
            dict(
                data=dict(seq_len=128),
                model=dict(rope_theta=1e4),
                train=dict(steps=900, lr=2e-3, weight_decay=1.0),
            ),
        ),
    )
    c.log.every = 50
    c.checkpoint.every = 200
    return c

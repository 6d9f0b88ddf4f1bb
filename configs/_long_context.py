"""Not a recipe: the settings the long-context recipes share, which they load and build on
(llama13b_512k, prolong_llama3_8b_512k, fu_llama2_7b_80k, ultralong_llama31_8b_1m, and
through _long_context_256k.py llama7b_256k, qwen25_7b_256k, qwen3_8b_256k and
mistral_nemo_12b_256k).

Each of them fine-tunes a HuggingFace model on many devices at 64K tokens or more: FSDP over
the devices the sequence-parallel ring (`mesh.sp`, the recipe's) leaves, bfloat16 compute on
float32 parameters, the layers scanned, striped ring attention in 2,048-token blocks, AdamW
without weight decay, gradients clipped at 1.0, the learning rate decaying to 10% of its
peak, a log line every step, held-out data (empty: none until given) one batch at a time and
the last two checkpoints kept. A recipe sets its model (`apply_preset`), its weights, memory
choices, data, length and schedule, and whatever it does otherwise.
"""

from lclm.config import base_config


def get_config():
    c = base_config()
    c.mesh.update(dp=1, fsdp=-1, tp=1)
    c.model.update(dtype="bfloat16", param_dtype="float32", scan_layers=True)
    c.attention.update(impl="auto", layout="striped", q_chunk=2048, kv_chunk=2048)
    c.train.update(weight_decay=0.0, clip=1.0, min_lr_ratio=0.1, grad_accum=1)
    c.log.every = 1
    c.validation.update(path="", batches=1)
    c.checkpoint.keep = 2
    return c

"""Qwen2 and Qwen2.5 (model_type 'qwen2'): biases on the q, k and v projections; the small
models (0.5B to 3B) tie the output projection to the embedding.

Presets: Qwen2.5-0.5B-Instruct and -7B-Instruct as their config.json states them (bos
151643; eos 151645, <|im_end|>; 32,768 positions).
"""

from lclm.families.contract import Family, frozen

_QWEN25 = dict(
    rope_theta=1000000.0,
    norm_eps=1e-6,
    bos_id=151643,
    eos_ids=(151645,),
    max_position_embeddings=32768,
)

FAMILY = Family(
    name="qwen2",
    model_type="qwen2",
    architecture="Qwen2ForCausalLM",
    qkv_bias=True,
    # transformers' Qwen2Config (it has no attention_bias: the biases are always there)
    hf_defaults=frozen(
        dict(max_position_embeddings=32768, bos_token_id=None, eos_token_id=None, rms_norm_eps=1e-6)
    ),
    hf_fields=frozen(dict(use_sliding_window=False, sliding_window=None)),
    accepts_attention_bias=False,
    presets=frozen(
        {
            "qwen25_0_5b": dict(
                _QWEN25,
                vocab_size=151936,
                dim=896,
                n_layers=24,
                n_heads=14,
                n_kv_heads=2,
                ffn_dim=4864,
                tie_embeddings=True,
            ),
            "qwen25_7b": dict(
                _QWEN25,
                vocab_size=152064,
                dim=3584,
                n_layers=28,
                n_heads=28,
                n_kv_heads=4,
                ffn_dim=18944,
                tie_embeddings=False,
            ),
        }
    ),
)

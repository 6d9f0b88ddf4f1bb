"""Qwen3 dense models (model_type 'qwen3'): an RMSNorm over each head's q and k before RoPE,
and a head_dim (128) apart from hidden_size / heads in most sizes.

Presets: Qwen3-0.6B and -8B as their config.json states them (40,960 positions; their model
cards extend to 131,072 with YaRN factor 4 over 32,768, `model.rope_scaling='yarn'`).
"""

from lclm.families.contract import Family, frozen

_QWEN3 = dict(
    head_dim=128,
    rope_theta=1000000.0,
    norm_eps=1e-6,
    bos_id=151643,
    eos_ids=(151645,),
    max_position_embeddings=40960,
    vocab_size=151936,
)

FAMILY = Family(
    name="qwen3",
    model_type="qwen3",
    architecture="Qwen3ForCausalLM",
    qk_norm=True,
    # transformers' Qwen3Config
    hf_defaults=frozen(
        dict(
            max_position_embeddings=32768,
            bos_token_id=None,
            eos_token_id=None,
            rms_norm_eps=1e-6,
            head_dim=128,
        )
    ),
    hf_fields=frozen(dict(attention_bias=False, use_sliding_window=False, sliding_window=None)),
    presets=frozen(
        {
            "qwen3_0_6b": dict(
                _QWEN3,
                dim=1024,
                n_layers=28,
                n_heads=16,
                n_kv_heads=8,
                ffn_dim=3072,
                tie_embeddings=True,
            ),
            "qwen3_8b": dict(
                _QWEN3,
                dim=4096,
                n_layers=36,
                n_heads=32,
                n_kv_heads=8,
                ffn_dim=12288,
                tie_embeddings=False,
            ),
        }
    ),
)

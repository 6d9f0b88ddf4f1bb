"""Mistral v0.3 and Mistral-NeMo (model_type 'mistral'): LLaMA's layer; NeMo's head_dim (128)
is apart from hidden_size / heads. Their config.json sets `sliding_window` null; a window
(Mistral-7B v0.1's 4096, or transformers' default where the field is absent) is refused,
since lclm's kernels attend to the whole causal context.

Presets: Mistral-7B-v0.3 and Mistral-NeMo-12B (128K context) as their config.json states them.
"""

from lclm.families.contract import Family, frozen

FAMILY = Family(
    name="mistral",
    model_type="mistral",
    architecture="MistralForCausalLM",
    # transformers' MistralConfig
    hf_defaults=frozen(
        dict(
            max_position_embeddings=131072,
            bos_token_id=1,
            eos_token_id=2,
            rms_norm_eps=1e-6,
            sliding_window=4096,
        )
    ),
    hf_fields=frozen(dict(sliding_window=None)),
    accepts_attention_bias=False,
    presets=frozen(
        {
            "mistral_7b_v03": dict(
                vocab_size=32768,
                dim=4096,
                n_layers=32,
                n_heads=32,
                n_kv_heads=8,
                ffn_dim=14336,
                rope_theta=1000000.0,
                norm_eps=1e-5,
                tie_embeddings=False,
                max_position_embeddings=32768,
            ),
            "mistral_nemo_12b": dict(
                vocab_size=131072,
                dim=5120,
                n_layers=40,
                n_heads=32,
                n_kv_heads=8,
                head_dim=128,
                ffn_dim=14336,
                rope_theta=1000000.0,
                norm_eps=1e-5,
                tie_embeddings=False,
                max_position_embeddings=1024000,
            ),
        }
    ),
)

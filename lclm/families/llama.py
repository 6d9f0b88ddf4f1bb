"""LLaMA 1/2/3.x (model_type 'llama'): the base layer, no options.

Presets: 1b/3b are LLaMA-3.2 (1.24B / 3.2B parameters), `llama3_8b` LLaMA-3 and 3.1 8B (one
shape; 3.1's RoPE scaling comes from its config.json through `model.init_from_hf`; eos: the
Instruct models' end of text and end of turn), `smollm2_135m` SmolLM2-135M (trained at 8K;
the project's real model: docs/checkpoints.md), 7b/13b LLaMA-2 (bos 1, eos 2: the
defaults); `striped_attention_1b` is the 1B model of Striped Attention, LLaMA-2 style (the
issue-14 bench shape).
"""

from lclm.families.contract import Family, frozen

FAMILY = Family(
    name="llama",
    model_type="llama",
    architecture="LlamaForCausalLM",
    # transformers' LlamaConfig
    hf_defaults=frozen(
        dict(max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6)
    ),
    hf_fields=frozen(dict(attention_bias=False, mlp_bias=False)),
    presets=frozen(
        {
            "llama3_1b": dict(
                vocab_size=128256,
                dim=2048,
                n_layers=16,
                n_heads=32,
                n_kv_heads=8,
                ffn_dim=8192,
                rope_theta=500000.0,
                norm_eps=1e-5,
                tie_embeddings=True,
                bos_id=128000,
                eos_ids=(128001,),
            ),
            "llama3_3b": dict(
                vocab_size=128256,
                dim=3072,
                n_layers=28,
                n_heads=24,
                n_kv_heads=8,
                ffn_dim=8192,
                rope_theta=500000.0,
                norm_eps=1e-5,
                tie_embeddings=True,
                bos_id=128000,
                eos_ids=(128001,),
            ),
            "llama3_8b": dict(
                vocab_size=128256,
                dim=4096,
                n_layers=32,
                n_heads=32,
                n_kv_heads=8,
                ffn_dim=14336,
                rope_theta=500000.0,
                norm_eps=1e-5,
                tie_embeddings=False,
                bos_id=128000,
                eos_ids=(128001, 128009),
            ),
            "smollm2_135m": dict(
                vocab_size=49152,
                dim=576,
                n_layers=30,
                n_heads=9,
                n_kv_heads=3,
                ffn_dim=1536,
                rope_theta=100000.0,
                norm_eps=1e-5,
                tie_embeddings=True,
                bos_id=1,
                eos_ids=(2,),
                max_position_embeddings=8192,
            ),
            "striped_attention_1b": dict(
                vocab_size=32000,
                dim=2048,
                n_layers=22,
                n_heads=16,
                n_kv_heads=16,
                ffn_dim=5504,
                rope_theta=10000.0,
                norm_eps=1e-5,
                tie_embeddings=False,
            ),
            "llama2_7b": dict(
                vocab_size=32000,
                dim=4096,
                n_layers=32,
                n_heads=32,
                n_kv_heads=32,
                ffn_dim=11008,
                rope_theta=10000.0,
                norm_eps=1e-5,
                tie_embeddings=False,
            ),
            "llama2_13b": dict(
                vocab_size=32000,
                dim=5120,
                n_layers=40,
                n_heads=40,
                n_kv_heads=40,
                ffn_dim=13824,
                rope_theta=10000.0,
                norm_eps=1e-5,
                tie_embeddings=False,
            ),
        }
    ),
)

"""Model fidelity against `transformers`: RoPE scaling (linear, llama3, yarn) read from either
config.json layout, and what lclm carries from a HuggingFace source to its export."""

import json
import os

import jax
import numpy as np
import pytest
from support import DEMO_CONFIG, DEMO_CORPUS, DEMO_TOKENIZER, torch_and_transformers

from lclm import hf
from lclm.config import ModelConfig
from lclm.models.decoder import forward

pytestmark = pytest.mark.slow  # trains models or starts processes: left out by -m 'not slow'

torch, transformers = torch_and_transformers()

ORIGINAL = 32  # original_max_position_embeddings of the tiny models; sequences run past it
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": ORIGINAL,
    },
    # Qwen's long-context form (transformers' defaults for the rest: beta 32 / 1, the
    # attention factor from the factor, truncated ramp ends), and one setting every field
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "yarn, every field": {
        "rope_type": "yarn",
        "factor": 3.0,
        "beta_fast": 16.0,
        "beta_slow": 2.0,
        "attention_factor": 1.3,
        "truncate": False,
        "original_max_position_embeddings": ORIGINAL,
    },
}


def _tiny_hf(path, scaling, vocab=101, theta=10000.0, **extra):
    """A random tiny LLaMA with RoPE `scaling`, saved by transformers itself (whichever
    config.json layout the installed version writes)."""
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        max_position_embeddings=48,
        rope_theta=theta,
        rope_scaling=dict(scaling),
        **extra,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():  # non-trivial norms so a swapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            if "q_proj" in name or "k_proj" in name:  # sharp attention: positions matter
                p.mul_(8.0)
    model.save_pretrained(str(path), safe_serialization=True)
    return model


def _relayout(path, layout, theta, scaling):
    """Rewrite config.json's RoPE fields in transformers 4's layout (rope_theta +
    rope_scaling) or 5's (rope_parameters alone)."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    for name in ("rope_theta", "rope_scaling", "rope_parameters"):
        cfg.pop(name, None)
    if layout == "transformers4":
        cfg.update(rope_theta=theta, rope_scaling=dict(scaling))
    else:
        cfg.update(rope_parameters=dict(scaling, rope_theta=theta))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


def _relative_error(got, want):
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


@pytest.mark.parametrize("name", list(SCALINGS))
def test_scaled_rope_logits_match_transformers_past_the_original_length(tmp_path, name):
    from lclm.models.decoder import rope_frequencies

    scaling = SCALINGS[name]
    kind = scaling["rope_type"]
    model = _tiny_hf(tmp_path / "src", scaling)
    tokens = np.random.default_rng(0).integers(0, 101, (2, 3 * ORIGINAL))  # past 32 and 48
    with torch.no_grad():
        want = model(torch.tensor(tokens)).logits.numpy()
    configs = []
    for layout in ("transformers4", "transformers5"):
        _relayout(tmp_path / "src", layout, 10000.0, scaling)
        configs.append(hf.load(str(tmp_path / "src"))[0])
    assert configs[0] == configs[1], "both config.json layouts read alike"
    c, params = hf.load(str(tmp_path / "src"))
    assert (c.rope_scaling, c.rope_factor) == (kind, scaling["factor"])
    if kind == "llama3":
        assert (c.rope_low_freq_factor, c.rope_high_freq_factor, c.rope_original_max_positions) == (
            1.0,
            4.0,
            ORIGINAL,
        )
        # every band of llama3 scaling is exercised: kept, blended and slowed frequencies
        wavelengths = (
            2 * np.pi / rope_frequencies(ModelConfig(**{**vars(c), "rope_scaling": "none"}))
        )
        assert wavelengths.min() < ORIGINAL / 4 and wavelengths.max() > ORIGINAL
        assert np.any((wavelengths > ORIGINAL / 4) & (wavelengths < ORIGINAL))
    if kind == "yarn":  # the defaults transformers assumes, or the fields set
        assert (
            c.rope_original_max_positions,
            c.rope_beta_fast,
            c.rope_beta_slow,
            c.rope_attention_factor,
            c.rope_truncate,
        ) == (
            ORIGINAL,
            scaling.get("beta_fast", 32.0),
            scaling.get("beta_slow", 1.0),
            scaling.get("attention_factor", 0.0),
            scaling.get("truncate", True),
        )

    got = np.asarray(jax.jit(lambda p, t: forward(c, p, t))(params, tokens))
    error = _relative_error(got, want)
    plain = ModelConfig(**{**vars(c), "rope_scaling": "none"})
    print(
        f"{name}: max relative logit error vs transformers {error:.2e} (unscaled RoPE: "
        f"{_relative_error(np.asarray(forward(plain, params, tokens)), want):.2e})"
    )
    assert error < 1e-4
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    # not vacuous: without the scaling the logits are far off
    assert _relative_error(np.asarray(forward(plain, params, tokens)), want) > 1e-2 > 100 * error

    # lclm -> HF -> lclm keeps the scaling, and transformers reads lclm's config.json alike
    out = str(tmp_path / "export")
    hf.save(out, c, params)
    assert hf.load(out)[0] == c
    reloaded = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        again = reloaded(torch.tensor(tokens)).logits.numpy()
    assert _relative_error(again, want) < 1e-6


def test_a_head_dim_apart_from_hidden_over_heads_matches_transformers(tmp_path):
    """Mistral-NeMo and Qwen3 set head_dim apart from hidden_size / heads (here 4 heads of 24
    over a hidden size of 64): logits equal transformers', and the export states it."""
    model = _tiny_hf(tmp_path / "src", {"rope_type": "default"}, head_dim=24)
    tokens = np.random.default_rng(1).integers(0, 101, (2, 40))
    with torch.no_grad():
        want = model(torch.tensor(tokens)).logits.numpy()
    c, params = hf.load(str(tmp_path / "src"))
    assert (c.dim, c.n_heads, c.head_dim) == (64, 4, 24)
    got = np.asarray(jax.jit(lambda p, t: forward(c, p, t))(params, tokens))
    assert _relative_error(got, want) < 1e-5
    out = str(tmp_path / "export")
    hf.save(out, c, params)
    assert hf.load(out)[0] == c
    with torch.no_grad():
        again = (
            transformers.LlamaForCausalLM.from_pretrained(out)
            .eval()(torch.tensor(tokens))
            .logits.numpy()
        )
    assert _relative_error(again, want) < 1e-6


def test_a_source_config_fills_ids_positions_and_scaling_unless_the_run_sets_one(tmp_path):
    from lclm.config import base_config
    from lclm.train.first_weights import apply_hf_shapes

    _tiny_hf(
        tmp_path / "src", SCALINGS["llama3"], theta=500000.0, bos_token_id=7, eos_token_id=[8, 9]
    )
    c = hf.read_config(str(tmp_path / "src"))
    assert (c.bos_id, c.eos_ids, c.max_position_embeddings) == (7, (8, 9), 48)

    config = base_config()
    config.model.update(init_from_hf=str(tmp_path / "src"), rope_theta=1e6)
    assert config.model.rope_scaling == "auto"
    config = apply_hf_shapes(config)
    m = ModelConfig.from_config(config.model)
    assert (m.bos_id, m.eos_ids, m.max_position_embeddings) == (7, (8, 9), 48)
    assert (m.rope_scaling, m.rope_factor, m.rope_original_max_positions) == (
        "llama3",
        8.0,
        ORIGINAL,
    )
    assert m.rope_theta == 1e6  # the run's theta applies over the source's

    config = base_config()
    config.model.update(init_from_hf=str(tmp_path / "src"), rope_scaling="linear", rope_factor=2.0)
    config = apply_hf_shapes(config)  # a scaling the run names is the run's
    m = ModelConfig.from_config(config.model)
    assert (m.rope_scaling, m.rope_factor, m.bos_id) == ("linear", 2.0, 7)
    # a run from scratch: "auto" is no scaling
    assert ModelConfig.from_config(base_config().model).rope_scaling == "none"


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("rope_scaling", "longrope", "model.rope_scaling='longrope'"),
        ("rope_beta_fast", 0.0, "model.rope_beta_fast=0.0"),
        ("rope_attention_factor", -1.0, "model.rope_attention_factor=-1.0"),
        ("rope_factor", 0.0, "model.rope_factor=0.0"),
        ("rope_factor", float("nan"), "model.rope_factor=nan"),
        ("rope_theta", -1.0, "model.rope_theta=-1.0"),
        ("rope_high_freq_factor", 0.5, "model.rope_high_freq_factor=0.5"),
        ("rope_original_max_positions", 0, "model.rope_original_max_positions=0"),
        ("max_position_embeddings", 0, "model.max_position_embeddings=0"),
        ("bos_id", 512, "model.bos_id=512"),
        ("eos_ids", (2, 600), "model.eos_ids=(2, 600)"),
    ],
)
def test_bad_rope_and_token_fields_stop_the_run_in_one_line(tmp_path, field, value, message):
    from lclm.config import base_config
    from lclm.errors import ConfigError
    from lclm.train.startup_checks import validate

    config = base_config()
    config.workdir = str(tmp_path / "run")
    config.model[field] = value
    if field == "rope_high_freq_factor":
        config.model.rope_scaling = "llama3"
    with pytest.raises(ConfigError) as e:
        validate(config, 1)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_training_from_hf_then_export_states_what_was_trained(tmp_path, capsys, monkeypatch):
    from lclm.config import load_config
    from lclm.convert import main
    from lclm.data.tokenizer import Tokenizer
    from lclm.models.decoder import param_shapes
    from lclm.train.loop import train
    from lclm.workdir.checkpoint import Checkpoints, read_params, saved_config

    scaling = SCALINGS["llama3"]
    _tiny_hf(tmp_path / "src", scaling, vocab=512, bos_token_id=1, eos_token_id=[2, 3])

    def run_config(workdir, steps, **init):
        c = load_config(DEMO_CONFIG)
        c.workdir = str(workdir)
        c.model.update(rope_theta=20000.0, dtype="float32", ffn_chunk=16, loss_chunk=16, **init)
        c.data.update(seq_len=64, batch_size=2)
        c.mesh.update(fsdp=2, sp=4)
        c.attention.update(q_chunk=16, kv_chunk=16)
        c.train.update(steps=steps, warmup=1)
        c.log.progress = False
        return c

    # a staged run's layout: the export of the run's workdir takes its last stage
    config = run_config(tmp_path / "run" / "stage0_64", 2, init_from_hf=str(tmp_path / "src"))
    train(config)

    # a run that starts from this one's weights trains them as it did: the shapes, ids and
    # llama3 scaling come from its saved config (theta is the run's own)
    train(run_config(tmp_path / "follow", 1, init_from_checkpoint=config.workdir))
    with open(tmp_path / "follow" / "config.json") as f:
        followed = json.load(f)["model"]
    assert followed["rope_scaling"] == "llama3" and followed["eos_ids"] == [2, 3]
    assert followed["vocab_size"] == 512 and followed["max_position_embeddings"] == 48

    def no_full_restore(*args, **kwargs):
        raise AssertionError("the export restored the whole train state")

    monkeypatch.setattr(Checkpoints, "restore", no_full_restore)
    export = tmp_path / "export"
    old_umask = os.umask(0o077)
    try:
        assert main(["--from-checkpoint", str(tmp_path / "run"), "--to-hf", str(export)]) == 0
    finally:
        os.umask(old_umask)
    printed = capsys.readouterr().out
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.model",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    ):
        assert name in printed, printed
        assert os.stat(export / name).st_mode & 0o777 == 0o644, name
    assert os.stat(export).st_mode & 0o777 == 0o755
    assert "stage0_64" in printed and "max_position_embeddings 64" in printed, printed

    with open(export / "config.json") as f:
        written = json.load(f)
    assert (written["bos_token_id"], written["eos_token_id"]) == (1, [2, 3])  # the source's
    assert written["max_position_embeddings"] == 64  # the source's 48 < the 64 trained
    assert written["rope_theta"] == 20000.0  # the trained theta, with the source's scaling
    assert written["rope_scaling"] == scaling  # transformers 4's layout
    assert written["rope_parameters"] == dict(scaling, rope_theta=20000.0)  # and 5's
    hf_config = transformers.AutoConfig.from_pretrained(str(export))
    rope = getattr(hf_config, "rope_parameters", None) or hf_config.rope_scaling
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0
    assert (hf_config.bos_token_id, hf_config.eos_token_id, hf_config.max_position_embeddings) == (
        1,
        [2, 3],
        64,
    )

    # transformers' logits of the export are lclm's of the trained parameters
    workdir = str(tmp_path / "run" / "stage0_64")
    step, saved = saved_config(workdir)
    c = ModelConfig(**{k: v for k, v in saved["model"].items() if k in vars(ModelConfig())})
    assert (c.rope_theta, c.rope_scaling) == (20000.0, "llama3")
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s, np.float32, sharding=device),
        param_shapes(c),
        is_leaf=lambda x: isinstance(x, tuple),
    )
    params = read_params(workdir, step, abstract)
    tokens = np.random.default_rng(1).integers(0, 512, (2, 64))
    model = transformers.LlamaForCausalLM.from_pretrained(str(export)).eval()
    with torch.no_grad():
        want = model(torch.tensor(tokens)).logits.numpy()
    got = np.asarray(jax.jit(lambda p, t: forward(c, p, t))(params, tokens))
    print(f"export: max relative logit error vs transformers {_relative_error(got, want):.2e}")
    assert _relative_error(got, want) < 1e-4

    # the tokenizer loads with AutoTokenizer and encodes as lclm's does
    ours = Tokenizer(DEMO_TOKENIZER)
    theirs = transformers.AutoTokenizer.from_pretrained(str(export))
    assert (theirs.bos_token_id, theirs.eos_token_id) == (ours.bos_id, ours.eos_id)
    with open(DEMO_CORPUS) as f:
        texts = [json.loads(line)["text"] for line in f][:300]
    texts += ["two  spaces\nand\n\nnewlines ", " leading space", "ünïcödé 東京 🙂", "", "  "]
    for text in texts:
        assert theirs(text, add_special_tokens=False).input_ids == ours.encode(text), text
        assert theirs(text).input_ids == [ours.bos_id] + ours.encode(text)
    assert theirs.decode(ours.encode("Hello world")) == ours.decode(ours.encode("Hello world"))


def test_the_eval_decoder_applies_the_scaling(tmp_path):
    """Prefill and cached decode (lclm.eval) rotate with the scaled frequencies, as forward."""
    import dataclasses

    import jax.numpy as jnp

    from lclm.config import AttentionConfig
    from lclm.eval.decode import greedy_generate
    from lclm.models.decoder import init_params

    model = ModelConfig(
        vocab_size=64,
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=64,
        dtype="float32",
        init_std=0.5,
        remat="none",
        ffn_chunk=8,
        loss_chunk=8,
        rope_scaling="llama3",
        rope_factor=8.0,
        rope_original_max_positions=16,
    )
    params = init_params(model, jax.random.key(0))
    prompt = np.random.default_rng(0).integers(3, 64, (1, 40)).astype(np.int32)
    positions = np.arange(40, dtype=np.int32)[None]
    out = greedy_generate(
        model,
        AttentionConfig(q_chunk=8, kv_chunk=8),
        params,
        jnp.asarray(prompt),
        jnp.asarray(positions),
        jnp.ones_like(jnp.asarray(prompt)),
        4,
    )

    def recompute(c):
        seq = list(prompt[0])
        full = dataclasses.replace(c, ffn_chunk=4096, loss_chunk=4096)
        for _ in range(4):
            seq.append(int(jnp.argmax(forward(full, params, jnp.asarray([seq]))[0, -1])))
        return seq[40:]

    assert out[0].tolist() == recompute(model)
    assert recompute(model) != recompute(dataclasses.replace(model, rope_scaling="none"))

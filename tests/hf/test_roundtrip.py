"""HuggingFace LLaMA import/export, checked against `transformers` on CPU."""

import json
import os

import jax
import numpy as np
import pytest
from support import torch_and_transformers

from lclm import hf
from lclm.config.run_config import run_config
from lclm.models.decoder import forward

torch, transformers = torch_and_transformers()


def _tiny_hf(tmp_path, tie=False, dtype=torch.float32):
    cfg = transformers.LlamaConfig(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=50000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():  # non-trivial norms so a swapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    path = str(tmp_path / "hf")
    model.save_pretrained(path, safe_serialization=True)
    return model, path


@pytest.mark.parametrize("tie", [False, True])
def test_logits_match_transformers_in_float32(tmp_path, tie):
    model, path = _tiny_hf(tmp_path, tie=tie)
    c, params = hf.load(path)
    assert (c.rope_theta, c.n_kv_heads, c.dtype, c.tie_embeddings) == (50000.0, 2, "float32", tie)
    tokens = np.random.default_rng(0).integers(0, 101, (2, 40))
    with torch.no_grad():
        want = model(torch.tensor(tokens)).logits.numpy()
    got = np.asarray(jax.jit(lambda p, t: forward(c, p, t))(params, tokens))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_roundtrip_lclm_hf_lclm_is_exact_and_transformers_loads_it(tmp_path):
    _, path = _tiny_hf(tmp_path)
    c, params = hf.load(path)
    out = str(tmp_path / "export")
    hf.save(out, c, params, max_shard_bytes=40_000)  # force a sharded export with an index
    assert os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
    c2, params2 = hf.load(out)
    assert c2 == c
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    reloaded = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    tokens = np.arange(30).reshape(1, 30) % 101
    with torch.no_grad():
        want = reloaded(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(np.asarray(forward(c, params, tokens)), want, atol=1e-4, rtol=1e-4)


def test_bf16_checkpoint_gives_bf16_config_and_pickles_are_refused(tmp_path):
    _, path = _tiny_hf(tmp_path, dtype=torch.bfloat16)
    c, params = hf.load(path)
    assert c.dtype == c.param_dtype == "bfloat16"
    assert params["embed"].dtype == jax.numpy.bfloat16
    os.remove(os.path.join(path, "model.safetensors"))
    open(os.path.join(path, "pytorch_model.bin"), "wb").write(b"not loaded")
    with pytest.raises(FileNotFoundError, match="never pickled"):
        hf.load(path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["rope_scaling"] = {"rope_type": "longrope", "factor": 4.0}
    with pytest.raises(ValueError, match="RoPE scaling"):
        hf.config_from_hf(cfg)


def test_convert_cli_roundtrip_through_an_lclm_checkpoint(tmp_path, capsys):
    from lclm.convert import main

    _, path = _tiny_hf(tmp_path)
    assert main(["--from-hf", path, "--to-checkpoint", str(tmp_path / "work")]) == 0
    assert (
        f"converted {path} to {tmp_path / 'work' / 'checkpoints'} step 0" in capsys.readouterr().out
    )  # says what it did
    # again into the same directory: refused in one line, the checkpoint left as it was
    assert main(["--from-hf", path, "--to-checkpoint", str(tmp_path / "work")]) == 2
    assert "already holds a run's checkpoints (latest step 0)" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path / "work" / "checkpoints")) == ["0"]
    back = str(tmp_path / "back")
    assert main(["--from-checkpoint", str(tmp_path / "work"), "--to-hf", back]) == 0
    c, params = hf.load(path)
    c2, params2 = hf.load(str(tmp_path / "back"))
    assert c2 == c
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    nothing = str(tmp_path / "nothing")
    assert main(["--from-checkpoint", nothing, "--to-hf", str(tmp_path / "x")]) == 2


@pytest.mark.slow
def test_training_starts_from_hf_weights_with_the_configured_rope_theta(tmp_path):
    from lclm.config import AttentionConfig, load_config
    from lclm.data.loader import HostBatches
    from lclm.data.tokenizer import Tokenizer
    from lclm.models.decoder import loss_terms
    from lclm.parallel import make_mesh
    from lclm.train.loop import train

    cfg = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=50000.0,
    )
    torch.manual_seed(1)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(tmp_path / "hf"))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    config = load_config(os.path.join(root, "configs", "demo.py"))
    config.workdir = str(tmp_path / "run")
    config.model.update(
        init_from_hf=str(tmp_path / "hf"),
        rope_theta=1e6,
        dtype="float32",
        ffn_chunk=32,
        loss_chunk=32,
    )
    config.data.update(seq_len=64, batch_size=4)
    config.attention.update(q_chunk=8, kv_chunk=8)
    config.train.update(steps=1, warmup=1)
    config.log.progress = False
    records = train(config)
    with open(os.path.join(config.workdir, "config.json")) as f:  # what the run trained
        model = json.load(f)["model"]
    assert model["dim"] == 64 and model["n_layers"] == 2  # shapes from config.json

    c, params = hf.load(str(tmp_path / "hf"), rope_theta=1e6)
    mesh = make_mesh(fsdp=2, sp=4)
    loader = HostBatches(run_config(config), mesh, Tokenizer(config.data.tokenizer))
    batch = next(loader)
    loader.close()
    attn = AttentionConfig.from_config(config.attention)
    total, count = jax.jit(lambda p: loss_terms(c, p, batch, mesh=mesh, attention=attn))(params)
    assert records[0]["loss"] == pytest.approx(float(total / count), rel=1e-5)

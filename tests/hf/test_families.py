"""Every registered model family against `transformers` on CPU: a tiny random model of each
(Qwen2: q/k/v biases, tied embeddings; Qwen3: q/k RMSNorm per head, head_dim apart from
hidden / heads; Mistral: NeMo's head_dim) built with transformers' own classes from the
family's model_type, architecture and export fields; lclm's logits equal theirs in float32
on one device and under every context-parallel strategy on 4 sp devices; an export is read
back by transformers' AutoModelForCausalLM to the same logits; what a family's layer lacks is
refused in one line."""

import itertools
import json
import os

import jax
import numpy as np
import pytest
from support import torch_and_transformers

from lclm import hf
from lclm.config import AttentionConfig
from lclm.config.run_config import run_config
from lclm.families import FAMILIES
from lclm.models.decoder import forward
from lclm.ops.context_parallel import STRATEGIES, layout_shards
from lclm.ops.layout import from_layout, to_layout
from lclm.parallel import make_mesh
from lclm.workdir.state import shard_params

pytestmark = pytest.mark.slow  # builds torch models: left out by -m 'not slow'

torch, transformers = torch_and_transformers()

VOCAB = 101
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    max_position_embeddings=128,
    rope_theta=10000.0,
)
# what a family's tiny model varies from SHAPE (where transformers' config takes it); a
# family not named here is built with SHAPE alone
VARIED = {
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(head_dim=24),
    "mistral": dict(head_dim=24),
}
# the family without layer options that the others are read as (`_without`)
PLAIN = next(n for n, f in FAMILIES.items() if not (f.qkv_bias or f.qk_norm))


def _hf_model(family, **shape):
    """A random transformers model of `family` (its registered model_type and architecture,
    and the fields its export writes so that transformers builds lclm's layer)."""
    f = FAMILIES[family]
    cfg = transformers.AutoConfig.for_model(
        f.model_type, **shape, **f.hf_fields, **VARIED.get(family, {})
    )
    return getattr(transformers, f.architecture)(cfg)


def _reads(family) -> dict:
    """What lclm reads of `family`'s tiny model."""
    varied = VARIED.get(family, {})
    return dict(
        tie_embeddings=varied.get("tie_word_embeddings", False),
        head_dim=varied.get("head_dim", SHAPE["hidden_size"] // SHAPE["num_attention_heads"]),
    )


def test_every_varied_family_is_registered():
    assert set(VARIED) <= set(FAMILIES)


def _tiny(path, family):
    """A random tiny model of `family`, saved by transformers itself; its norms, biases and
    q/k norms made non-trivial so that a dropped or swapped one shows in the logits."""
    torch.manual_seed(0)
    model = _hf_model(family, **SHAPE).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
            elif "q_proj" in name or "k_proj" in name:  # sharp attention: positions matter
                p.mul_(4.0)
    model.save_pretrained(str(path), safe_serialization=True)
    return model


def _logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def _relative_error(got, want):
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def _without(c, family):
    """`c` read as another family: the same shapes without this family's layer options."""
    return type(c)(**{**vars(c), "family": family})


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_loads_to_transformers_logits_and_exports_what_transformers_reads(
    tmp_path, family
):
    model = _tiny(tmp_path / "src", family)
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 40))
    want = _logits(model, tokens)
    c, params = hf.load(str(tmp_path / "src"))
    assert c.family == family
    assert {k: getattr(c, k) for k in _reads(family)} == _reads(family)
    assert ("lm_head" in params) != c.tie_embeddings
    got = np.asarray(jax.jit(lambda p, t: forward(c, p, t))(params, tokens))
    error = _relative_error(got, want)
    print(f"{family}: max relative logit error vs transformers {error:.2e}")
    assert error < 1e-5
    if FAMILIES[family].qkv_bias or FAMILIES[family].qk_norm:  # not vacuous: the layer's
        # options change the logits
        plain = _without(c, PLAIN)
        options = {
            k: v
            for k, v in params["layers"].items()
            if k not in ("bq", "bk", "bv", "q_norm", "k_norm")
        }
        assert len(options) < len(params["layers"])
        plain_logits = np.asarray(forward(plain, {**params, "layers": options}, tokens))
        assert _relative_error(plain_logits, want) > 1e-2

    out = str(tmp_path / "export")
    hf.save(out, c, params, max_shard_bytes=40_000)  # sharded, with an index
    with open(os.path.join(out, "config.json")) as f:
        written = json.load(f)
    assert written["model_type"] == family
    assert hf.load(out)[0] == c
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded).__name__ == FAMILIES[family].architecture
    assert _relative_error(_logits(reloaded, tokens), want) < 1e-6


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_equals_transformers_under_every_strategy_on_four_sp_devices(tmp_path, family):
    model = _tiny(tmp_path / "src", family)
    t = 32
    tokens = np.random.default_rng(1).integers(0, VOCAB, (2, t))
    want = _logits(model, tokens)
    c, params = hf.load(str(tmp_path / "src"))
    mesh = make_mesh(sp=4, fsdp=2)
    sharded = shard_params(c, params, mesh)
    for strategy in STRATEGIES:
        attention = AttentionConfig(
            strategy=strategy, q_chunk=4, kv_chunk=4, ulysses=2 if strategy == "usp" else 1
        )
        n = layout_shards(attention, 4)
        positions = to_layout(
            np.broadcast_to(np.arange(t, dtype=np.int32), tokens.shape), attention.layout, n
        )
        run = jax.jit(
            lambda p, tok, pos, a=attention: forward(c, p, tok, pos, mesh=mesh, attention=a)
        )
        got = from_layout(
            np.asarray(run(sharded, to_layout(tokens, attention.layout, n), positions)),
            attention.layout,
            n,
        )
        error = _relative_error(got, want)
        print(f"{family} under {strategy}: max relative logit error {error:.2e}")
        assert error < 1e-5, strategy


def _edit_config(path, **fields):
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(fields)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


@pytest.mark.parametrize(
    "family,fields,names",
    [
        # Mistral-7B v0.1's window, and transformers' default where the field is absent
        ("mistral", dict(sliding_window=4096), ["sliding_window", "4096"]),
        ("mistral", dict(sliding_window="absent"), ["sliding_window", "4096"]),
        ("qwen2", dict(use_sliding_window=True, sliding_window=64), ["use_sliding_window"]),
        ("qwen3", dict(layer_types=["sliding_attention", "full_attention"]), ["layer_types"]),
        ("qwen3", dict(attention_bias=True), ["attention_bias", "qwen3"]),
        ("qwen2", dict(architectures=["LlamaForCausalLM"]), ["architectures", "Qwen2ForCausalLM"]),
        ("qwen2", dict(model_type="qwen2_moe"), ["model_type", "qwen2_moe", "'qwen3'"]),
    ],
)
def test_what_a_family_lacks_is_refused_in_one_line(tmp_path, family, fields, names):
    _tiny(tmp_path / "src", family)
    if fields.get("sliding_window") == "absent":
        with open(tmp_path / "src" / "config.json") as f:
            cfg = json.load(f)
        cfg.pop("sliding_window")
        with open(tmp_path / "src" / "config.json", "w") as f:
            json.dump(cfg, f)
    else:
        _edit_config(tmp_path / "src", **fields)
    with pytest.raises(hf.HFFormatError) as e:
        hf.load(str(tmp_path / "src"))
    message = str(e.value)
    assert "\n" not in message and all(n in message for n in names), message


@pytest.mark.parametrize(
    "family,strategy",
    [
        # each registered family but PLAIN (the demo's own) under a strategy other than the
        # ring in turn
        (f, s)
        for f, s in zip(
            [f for f in FAMILIES if f != PLAIN],
            itertools.cycle(s for s in STRATEGIES if s != "ring"),
        )
    ],
)
def test_a_family_trains_from_its_hf_weights_and_exports_what_transformers_reads(
    tmp_path, family, strategy
):
    """configs/demo.py started from a tiny HuggingFace model of `family`
    (`model.init_from_hf`): the first step's loss is the loaded model's, two steps train under
    `strategy` on sp=4, and the trained checkpoint exported by `lclm.convert` loads in
    transformers to lclm's logits of the trained weights."""
    from lclm.config import load_config
    from lclm.convert import main
    from lclm.data.loader import HostBatches
    from lclm.data.tokenizer import Tokenizer
    from lclm.models.decoder import loss_terms
    from lclm.train.loop import train

    torch.manual_seed(2)
    _hf_model(family, **{**SHAPE, "vocab_size": 512}).save_pretrained(str(tmp_path / "hf"))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    config = load_config(os.path.join(root, "configs", "demo.py"))
    config.workdir = str(tmp_path / "run")
    config.model.update(
        init_from_hf=str(tmp_path / "hf"), dtype="float32", ffn_chunk=32, loss_chunk=32
    )
    config.mesh.update(dp=1, fsdp=2, tp=1, sp=4)
    config.data.update(seq_len=64, batch_size=4)
    config.attention.update(
        q_chunk=8, kv_chunk=8, strategy=strategy, ulysses=2 if strategy == "usp" else 1
    )
    config.train.update(steps=2, warmup=1, lr=1e-2)
    config.checkpoint.update(every=2)
    config.log.progress = False
    config.validation.path = ""
    records = train(config)
    with open(os.path.join(config.workdir, "config.json")) as f:  # what the run trained
        assert json.load(f)["model"]["family"] == family  # from config.json's model_type

    c, params = hf.load(str(tmp_path / "hf"), rope_theta=config.model.rope_theta)
    mesh = make_mesh(fsdp=2, sp=4)
    loader = HostBatches(run_config(config), mesh, Tokenizer(config.data.tokenizer))
    batch = next(loader)
    loader.close()
    attention = AttentionConfig.from_config(config.attention)
    total, count = jax.jit(lambda p: loss_terms(c, p, batch, mesh=mesh, attention=attention))(
        params
    )
    assert records[0]["loss"] == pytest.approx(float(total / count), rel=1e-5)
    assert np.isfinite(records[-1]["loss"]) and records[-1]["loss"] != records[0]["loss"]

    out = str(tmp_path / "export")
    assert main(["--from-checkpoint", config.workdir, "--to-hf", out]) == 0
    c2, trained = hf.load(out)
    assert c2.family == family
    assert not np.array_equal(
        np.asarray(trained["layers"]["wq"]), np.asarray(params["layers"]["wq"])
    )
    tokens = np.random.default_rng(3).integers(0, 512, (2, 24))
    want = _logits(transformers.AutoModelForCausalLM.from_pretrained(out).eval(), tokens)
    got = np.asarray(forward(c2, trained, tokens))
    assert _relative_error(got, want) < 1e-5

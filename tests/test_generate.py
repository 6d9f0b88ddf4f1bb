"""lclm.eval.generate: a prompt's continuation from a checkpoint, greedy (the argmax of the full
forward, recomputed here without a cache) or sampled (the same tokens for the same seed)."""

import dataclasses
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import DEMO_TOKENIZER

from lclm import hf
from lclm.config import ModelConfig
from lclm.convert import hf_to_checkpoint
from lclm.eval import generate
from lclm.eval.decode import sampler
from lclm.eval.model import answer_text, load_model
from lclm.models.decoder import forward, init_params

pytestmark = pytest.mark.slow  # writes a checkpoint and compiles decoding

# large init so that greedy choices are far from ties; the demo tokenizer's 512 pieces
MODEL = ModelConfig(
    vocab_size=512,
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=64,
    dtype="float32",
    init_std=0.5,
)
PROMPT = "The quick brown fox"
NEW = 8


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(an lclm workdir converted from a tiny HuggingFace directory that holds the demo
    tokenizer, the model's parameters)."""
    tmp = tmp_path_factory.mktemp("generate")
    params = init_params(MODEL, jax.random.key(0))
    hf.save(str(tmp / "hf"), MODEL, params)
    shutil.copy(DEMO_TOKENIZER, tmp / "hf" / "tokenizer.model")
    hf_to_checkpoint(str(tmp / "hf"), str(tmp / "run"))
    return str(tmp / "run"), params


def load(workdir, *flags):
    return load_model(generate.parse_args(["--checkpoint", workdir, "--prompt", PROMPT, *flags]))[0]


def reference_greedy(params, ids, steps):
    """The full forward on one device, re-run for every new token (no cache). The sequence is
    right-padded to one width: causal attention never looks ahead."""
    logits_of = jax.jit(lambda p, tokens: forward(MODEL, p, tokens))
    seq = list(ids)
    for _ in range(steps):
        tokens = np.zeros((1, len(ids) + steps), np.int32)
        tokens[0, : len(seq)] = seq
        seq.append(int(jnp.argmax(logits_of(params, tokens)[0, len(seq) - 1])))
    return seq[len(ids) :]


@pytest.mark.parametrize(
    "mesh",
    [
        ("--fsdp", "2", "--sp", "2"),  # a ring of 2, 2 rows of the prompt
        ("--fsdp", "2", "--sp", "4", "--layout", "zigzag", "--strategy", "usp", "--ulysses", "2"),
    ],
)
def test_greedy_continuation_on_a_mesh_is_the_full_forwards_argmax(run, mesh):
    workdir, params = run
    model = load(workdir, *mesh)
    ids = generate.prompt_ids(model.tokenizer, PROMPT)
    assert ids[0] == model.tokenizer.bos_id and len(ids) > 2
    out = generate.continuation(model, ids, NEW).tolist()
    assert out == reference_greedy(params, ids, NEW)
    assert generate.continuation(model, ids, NEW).tolist() == out


def test_sampling_gives_the_same_tokens_for_a_seed(run):
    model = load(run[0])
    ids = generate.prompt_ids(model.tokenizer, PROMPT)
    draw = lambda **kw: generate.continuation(model, ids, NEW, sampler(**kw)).tolist()
    first = draw(temperature=2.0, seed=1)
    assert draw(temperature=2.0, seed=1) == first
    assert draw(temperature=2.0, seed=2) != first
    greedy = generate.continuation(model, ids, NEW).tolist()
    assert draw(temperature=2.0, top_k=1, seed=1) == greedy
    assert draw(temperature=2.0, top_p=1e-6, seed=1) == greedy  # a nucleus of one token


def test_the_cli_prints_the_continuation(run, capsys):
    workdir, params = run
    argv = ["--checkpoint", workdir, "--prompt", PROMPT, "--max-new-tokens", str(NEW)]
    assert generate.main(argv) == 0
    text = capsys.readouterr().out
    model = load(workdir)
    ids = generate.prompt_ids(model.tokenizer, PROMPT)
    assert text == answer_text(model.tokenizer, reference_greedy(params, ids, NEW)) + "\n"
    assert text.strip()
    sampled = [*argv, "--temperature", "1.5", "--top-p", "0.9", "--seed", "4"]
    assert generate.main(sampled) == 0
    first = capsys.readouterr().out
    assert generate.main(sampled) == 0
    assert capsys.readouterr().out == first


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--step", "7"], "has no checkpoint step 7 (saved: [0])"),
        (
            ["--max-new-tokens", "4086"],
            "the prompt's 11 tokens and --max-new-tokens=4086 pass the model's 4096 positions",
        ),
        (["--prompt", "fox " * 5000], "pass the model's 4096 positions"),
    ],
)
def test_a_step_or_prompt_the_checkpoint_lacks_is_one_line(run, capsys, flags, needle):
    assert generate.main(["--checkpoint", run[0], "--prompt", PROMPT, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and needle in err, err


def test_a_converted_checkpoint_is_made_for_its_models_positions(tmp_path, capsys):
    """A converted step 0 has trained nothing: its saved data.seq_len (the defaults' 2048) does
    not stretch the 16 positions its model was made for."""
    short = dataclasses.replace(MODEL, max_position_embeddings=16)
    hf.save(str(tmp_path / "hf"), short, init_params(short, jax.random.key(0)))
    shutil.copy(DEMO_TOKENIZER, tmp_path / "hf" / "tokenizer.model")
    hf_to_checkpoint(str(tmp_path / "hf"), str(tmp_path / "run"))
    capsys.readouterr()
    assert (
        generate.main(
            ["--checkpoint", str(tmp_path / "run"), "--prompt", PROMPT, "--max-new-tokens", "8"]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err == (
        "error: the prompt's 11 tokens and --max-new-tokens=8 pass the model's 16 "
        "positions; shorten the prompt or decode fewer tokens\n"
    ), err


@pytest.mark.parametrize("flag", ["--checkpoint", "--hf"])
def test_a_model_on_an_unknown_scheme_is_one_line(tmp_path, monkeypatch, capsys, flag):
    # gs:// and s3:// are read (tests/train/test_object_store_workdir.py generates from a bucket)
    monkeypatch.chdir(tmp_path)
    assert generate.main([flag, "hdfs://bucket/model", "--prompt", PROMPT]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: {flag} 'hdfs://bucket/model' uses hdfs://, which lclm does not "
        "read or write; use gs://, s3:// or a local or mounted path\n"
    )
    assert os.listdir(tmp_path) == []


def test_a_chat_prompt_is_a_user_turn_of_the_template(run, capsys):
    """--chat renders the prompt as training renders a chat (lclm.data.chat): the template's
    system text, the user turn, the assistant prefix; the printed reply is the greedy
    continuation of exactly those ids. A template whose special tokens the tokenizer lacks is
    one line."""
    from lclm.data.chat import TEMPLATES, render_prompt

    workdir, params = run
    argv = ["--checkpoint", workdir, "--prompt", PROMPT, "--max-new-tokens", str(NEW)]
    assert generate.main([*argv, "--chat", "vicuna"]) == 0
    model = load(workdir)
    ids = generate.prompt_ids(model.tokenizer, PROMPT, "vicuna")
    assert ids == render_prompt([("user", PROMPT)], model.tokenizer, TEMPLATES["vicuna"]).tolist()
    assert len(ids) > len(generate.prompt_ids(model.tokenizer, PROMPT)) + 10  # system + roles
    assert (
        capsys.readouterr().out
        == answer_text(model.tokenizer, reference_greedy(params, ids, NEW)) + "\n"
    )
    assert generate.main([*argv, "--chat", "llama3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --chat llama3: ") and err.count("\n") == 1, err

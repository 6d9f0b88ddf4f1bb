"""`python -m lclm.eval TASK`: perplexity by position against an independent numpy model and
across meshes and strategies, passkey and needle answers across ring sizes, and every task's
command line on a freshly trained tiny checkpoint (reports, --out, short documents, lengths
beyond the trained one)."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from support import DEMO_TOKENIZER, small_train_config

from lclm.config import AttentionConfig, ModelConfig
from lclm.data.tokenizer import Tokenizer
from lclm.eval import needle, passkey, perplexity, retrieval
from lclm.eval.__main__ import main as eval_main
from lclm.eval.model import LoadedModel
from lclm.models.decoder import init_params, loss_terms
from lclm.ops.layout import batch_to_layout
from lclm.parallel import make_mesh
from lclm.train.loop import train
from lclm.workdir.state import shard_params

# float32 and a large init, so that token losses vary along the sequence and greedy choices
# are far from ties; GQA (4 heads over 2 kv heads); chunks far below the lengths, so every
# blockwise op really runs in several chunks per device
MODEL = ModelConfig(
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
)
LENGTH, BUCKETS = 64, 4


@pytest.fixture(scope="module")
def params():
    return init_params(MODEL, jax.random.key(0))


def on_mesh(params, sp, tokenizer=None, fsdp=1, **attention):
    a = AttentionConfig(q_chunk=8, kv_chunk=8, **attention)
    mesh = make_mesh(fsdp=fsdp, sp=sp)
    return LoadedModel(MODEL, a, shard_params(MODEL, params, mesh), mesh, tokenizer, f"sp{sp}")


# -- perplexity ----------------------------------------------------------------------------


def numpy_losses(c: ModelConfig, params, tokens: np.ndarray) -> np.ndarray:
    """Float32 losses `[T]` of tokens `[T+1]` by a dense causal LLaMA written in numpy (no
    lclm code): RMSNorm, rotate-half RoPE, GQA softmax attention, SwiGLU."""
    p = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
    x = p["embed"][tokens[:-1]]
    t, half, r = len(x), c.head_dim // 2, c.n_heads // c.n_kv_heads
    inv = (c.rope_theta ** (-np.arange(0, c.head_dim, 2) / c.head_dim)).astype(np.float32)
    angle = np.arange(t, dtype=np.float32)[:, None] * inv
    cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]
    rope = lambda u: np.concatenate(
        [u[..., :half] * cos - u[..., half:] * sin, u[..., half:] * cos + u[..., :half] * sin], -1
    )
    norm = lambda u, w: u / np.sqrt(np.mean(u * u, -1, keepdims=True) + c.norm_eps) * w
    causal = np.tril(np.ones((t, t), bool))
    for i in range(c.n_layers):
        w = {k: v[i] for k, v in p["layers"].items()}
        h = norm(x, w["attn_norm"])
        q = rope(np.einsum("td,dhk->thk", h, w["wq"]))
        k = np.repeat(rope(np.einsum("td,dhk->thk", h, w["wk"])), r, axis=1)
        v = np.repeat(np.einsum("td,dhk->thk", h, w["wv"]), r, axis=1)
        s = np.where(causal, np.einsum("qhd,khd->hqk", q, k) / np.sqrt(c.head_dim), -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        x = x + np.einsum("qhd,hdo->qo", np.einsum("hqk,khd->qhd", a, v), w["wo"])
        h = norm(x, w["ffn_norm"])
        gate = h @ w["w_gate"]
        x = x + (gate / (1 + np.exp(-gate)) * (h @ w["w_up"])) @ w["w_down"]
    logits = norm(x, p["final_norm"]) @ p["lm_head"]
    top = logits.max(-1)
    lse = top + np.log(np.exp(logits - top[:, None]).sum(-1))
    return lse - logits[np.arange(t), tokens[1:]]


@pytest.fixture(scope="module")
def documents():
    """Three documents long enough for LENGTH (one of them far longer) between two that
    are not; loss on every target but one, as a chat document would leave one out."""
    rng = np.random.default_rng(1)
    docs = []
    for n in (LENGTH + 1, 20, 3 * LENGTH, LENGTH, LENGTH + 5):
        tokens = rng.integers(3, MODEL.vocab_size, n).astype(np.int32)
        loss = np.ones(n, np.int8)
        loss[[0, 7]] = 0
        docs.append((tokens, loss))
    return docs


def test_windows_skip_and_count_documents_that_are_too_short(documents):
    w = perplexity.windows(documents, [LENGTH, 2 * LENGTH], max_docs=10)
    assert w[LENGTH]["tokens"].shape == (3, LENGTH + 1) and w[LENGTH]["skipped"] == 2
    assert w[2 * LENGTH]["tokens"].shape == (1, 2 * LENGTH + 1)
    assert w[2 * LENGTH]["skipped"] == 4
    assert not w[LENGTH]["mask"][:, 6].any() and w[LENGTH]["mask"][:, 7].all()
    assert perplexity.windows(documents, [LENGTH], max_docs=1)[LENGTH]["skipped"] == 0


@pytest.fixture(scope="module")
def one_device(params, documents):
    """Perplexity on a single device (no ring: sp=1)."""
    return perplexity.evaluate(
        on_mesh(params, 1), documents, [LENGTH], n_buckets=BUCKETS, max_docs=10
    )["lengths"][0]


def test_perplexity_by_position_equals_an_independent_numpy_model(params, documents, one_device):
    w = perplexity.windows(documents, [LENGTH], max_docs=10)[LENGTH]
    losses = np.stack([numpy_losses(MODEL, params, row) for row in w["tokens"]])
    assert one_device["documents"] == 3 and one_device["skipped"] == 2
    want = perplexity.bucket_losses(losses, w["mask"], BUCKETS)
    got = one_device["buckets"]
    assert [b["tokens"] for b in got] == [b["tokens"] for b in want] == [45, 48, 48, 48]
    np.testing.assert_allclose([b["loss"] for b in got], [b["loss"] for b in want], rtol=1e-4)
    # the test means something: the losses differ along the sequence
    assert np.ptp([b["loss"] for b in want]) > 0.05


@pytest.mark.parametrize(
    "attention",
    [
        dict(strategy="ring", layout="striped"),
        dict(strategy="all_gather", layout="zigzag"),
        dict(strategy="ulysses", layout="striped"),
    ],
    ids=lambda a: f"{a['strategy']}-{a['layout']}",
)
def test_perplexity_does_not_depend_on_mesh_or_strategy(params, documents, one_device, attention):
    # fsdp=2: two rows per forward, so the three documents also cross a batch boundary
    model = on_mesh(params, 4, fsdp=2, **attention)
    got = perplexity.evaluate(model, documents, [LENGTH], n_buckets=BUCKETS, max_docs=10)[
        "lengths"
    ][0]
    np.testing.assert_allclose(
        [b["loss"] for b in got["buckets"]], [b["loss"] for b in one_device["buckets"]], rtol=1e-5
    )
    np.testing.assert_allclose(got["document_losses"], one_device["document_losses"], rtol=1e-5)


def test_token_losses_sum_to_the_training_loss(params, documents):
    """The per-token losses are training's: their masked sum is `loss_terms` of the same
    rows on the same mesh (striped ring)."""
    model = on_mesh(params, 4, fsdp=2)  # the ring case above: its forward is compiled
    w = perplexity.windows(documents, [LENGTH], max_docs=2)[LENGTH]
    rows = perplexity.rows_of(w["tokens"], LENGTH)
    losses = perplexity.position_losses(model, w["tokens"], 2)
    batch = dict(rows, loss_mask=w["mask"].astype(np.int32))
    batch = batch_to_layout(batch, "striped", 4)
    total, count = jax.jit(
        lambda p, b: loss_terms(MODEL, p, b, mesh=model.mesh, attention=model.attention)
    )(model.params, batch)
    assert int(count) == w["mask"].sum()
    np.testing.assert_allclose(float(total), losses[w["mask"]].sum(dtype=np.float64), rtol=1e-5)


# -- passkey and needle --------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(DEMO_TOKENIZER)


@pytest.fixture(scope="module")
def wide_params():
    """MODEL with the demo tokenizer's vocabulary."""
    return init_params(dataclasses.replace(MODEL, vocab_size=512), jax.random.key(2))


def test_passkey_prompts_hide_the_key_at_its_depth(tokenizer):
    items = passkey.items(tokenizer, 200, n_bins=2, samples=2, digits=5, seed=0)
    assert [it.depth_bin for it in items] == [0, 0, 1, 1]
    for it in items:
        text = tokenizer.decode(it.tokens)
        assert len(it.tokens) == 200 and it.tokens[0] == tokenizer.bos_id  # the row's length
        assert len(it.answer) == 5 and text.count(it.answer) == 2
        assert text.endswith(passkey.QUESTION)
        depth = text.index(it.answer) / len(text)
        assert it.depth_bin / 2 - 0.1 < depth < (it.depth_bin + 1) / 2 + 0.1
        assert it.depth_bin / 2 <= it.info["depth"] <= (it.depth_bin + 1) / 2
    # deterministic, and different samples hide different keys
    again = passkey.items(tokenizer, 200, n_bins=2, samples=2, digits=5, seed=0)
    assert [it.answer for it in again] == [it.answer for it in items]
    assert len({it.answer for it in items}) == 4


def test_needle_prompts_use_the_documents(tokenizer):
    docs = [
        (np.asarray(tokenizer.encode(f"Story {i} goes on and on about the sea."), np.int32), None)
        for i in range(30)
    ]
    items = needle.items(docs, tokenizer, 120, n_bins=2, samples=1, digits=4, seed=3)
    for it in items:
        text = tokenizer.decode(it.tokens)
        assert len(it.tokens) == 120 and "goes on and on about the sea" in text
        assert f"The special magic number is {it.answer}." in text
        assert text.endswith(needle.QUESTION)
    with pytest.raises(ValueError, match="holds only"):
        needle.items(docs[:2], tokenizer, 120, n_bins=2, samples=1, digits=4, seed=3)


def answers(model, items):
    result = retrieval.evaluate(model, [200], lambda length: items, n_bins=2, max_new=4)
    return [s["output"] for s in result["samples"]], [c["accuracy"] for c in result["cells"]]


def test_passkey_and_needle_answer_alike_on_one_device_and_a_ring(tokenizer, wide_params):
    wide = dataclasses.replace(MODEL, vocab_size=512)
    docs = [
        (np.asarray(tokenizer.encode(f"Story {i} tells of ships and of the sea."), np.int32), None)
        for i in range(40)
    ]
    prompts = passkey.items(tokenizer, 200, n_bins=2, samples=1, digits=5, seed=0) + needle.items(
        docs, tokenizer, 190, n_bins=2, samples=1, digits=4, seed=0
    )
    outs = []
    for sp in (1, 4):
        mesh = make_mesh(sp=sp)
        model = LoadedModel(
            wide,
            AttentionConfig(q_chunk=8, kv_chunk=8),
            shard_params(wide, wide_params, mesh),
            mesh,
            tokenizer,
            f"sp{sp}",
        )
        outs.append(answers(model, prompts))
    assert outs[0] == outs[1]
    assert any(text.strip() for text in outs[0][0])  # something was decoded


def test_a_correct_answer_is_scored_as_one(tokenizer, monkeypatch):
    """The scoring, with the model replaced by one that answers the key (passkey) or a
    wrong number (needle)."""
    items = passkey.items(tokenizer, 200, n_bins=2, samples=2, digits=5, seed=0)
    by_prompt = {tuple(it.tokens): f" {it.answer}." for it in items}
    monkeypatch.setattr(
        retrieval,
        "generate_answers",
        lambda model, prompts, *a: ([by_prompt.get(tuple(p), " 7") for p in prompts], 104),
    )
    fake = LoadedModel(MODEL, AttentionConfig(), None, make_mesh(), tokenizer, "fake")
    result = retrieval.evaluate(fake, [200], lambda n: items, n_bins=2, max_new=6)
    assert [c["accuracy"] for c in result["cells"]] == [1.0, 1.0]
    result = retrieval.evaluate(
        fake,
        [200],
        lambda n: items[:1] + [dataclasses.replace(items[2], tokens=items[2].tokens[1:])],
        n_bins=2,
        max_new=6,
    )
    assert [c["accuracy"] for c in result["cells"]] == [1.0, 0.0]


# -- the command line on a trained checkpoint ----------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny model trained 2 steps at 64 tokens (the demo config: its tokenizer, vocab)."""
    root = tmp_path_factory.mktemp("tasks")
    c = small_train_config(
        root / "run",
        mesh=dict(dp=1, fsdp=1, tp=1, sp=2),
        attention=dict(q_chunk=16, kv_chunk=16),
        train=dict(steps=2),
    )
    c.model.update(
        dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, ffn_chunk=16, loss_chunk=16
    )
    c.checkpoint.update(every=0)
    train(c)
    data = root / "docs.jsonl"
    long_text = " ".join(f"The ship {i} sailed over the sea and came back home." for i in range(60))
    data.write_text(
        "\n".join(
            json.dumps({"text": t})
            for t in [long_text, "Too short.", long_text + " The end.", "Short too."]
        )
    )
    return dict(workdir=c.workdir, data=str(data), root=root, seq_len=c.data.seq_len)


def run_task(capsys, task, checkpoint, out, *flags):
    rc = eval_main([task, "--checkpoint", checkpoint["workdir"], "--out", str(out), *flags])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@pytest.mark.slow
def test_every_task_writes_its_report_beyond_the_trained_length(checkpoint, capsys):
    assert checkpoint["seq_len"] == 64
    flags = {
        "perplexity": [
            "--data",
            checkpoint["data"],
            "--lengths",
            "256",
            "--buckets",
            "4",
            "--sp",
            "4",
        ],
        "passkey": ["--lengths", "200", "--depths", "2", "--samples", "1"],
        "needle": [
            "--data",
            checkpoint["data"],
            "--lengths",
            "160",
            "--depths",
            "2",
            "--samples",
            "1",
        ],
    }
    for task, extra in flags.items():
        out = checkpoint["root"] / f"out_{task}"
        rc, printed, err = run_task(capsys, task, checkpoint, out, *extra)
        assert rc == 0, err
        table = (out / f"{task}.md").read_text().strip()
        assert table.startswith("| length |") and table in printed
        assert (out / f"{task}.png").read_bytes()[:4] == b"\x89PNG"
        report = json.loads((out / f"{task}.json").read_text())
        if task == "perplexity":
            [long] = report["lengths"]
            # 256 > the trained 64 tokens: evaluated on the 2 long documents, 2 skipped
            assert (long["length"], long["documents"], long["skipped"]) == (256, 2, 2)
            assert len(long["buckets"]) == 4 and all(
                np.isfinite(b["loss"]) for b in long["buckets"]
            )
            assert report["trained_length"] == 64 and report["mesh"]["sp"] == 4
            assert "| 256 | 2 | 2 |" in table
        else:
            assert report["mesh"]["sp"] == 2  # the checkpoint's mesh
            assert len(report["cells"]) == 2 and len(report["samples"]) == 2
            assert all(0.0 <= c["accuracy"] <= 1.0 for c in report["cells"])


def test_line_retrieval_is_a_task_of_the_same_command(tmp_path, capsys, monkeypatch):
    """Dispatched with its own flags and report (its evaluation is tests/eval/test_cli.py's;
    here a fixed result stands for it)."""
    from types import SimpleNamespace

    from lclm.eval import line_retrieval

    records = [
        dict(length=128, depth_bin=b, correct=b == 0, prompt_tokens=120, padded_to=128)
        for b in (0, 1)
    ]
    result = dict(cells=[retrieval.cell(records, 128, b, 2) for b in (0, 1)], samples=records)
    model = SimpleNamespace(
        name="fake",
        mesh=SimpleNamespace(shape={"sp": 1}),
        attention=SimpleNamespace(layout="striped", strategy="ring"),
        config=SimpleNamespace(max_position_embeddings=128),
    )
    monkeypatch.setattr(line_retrieval, "load_model", lambda args: (model, None))
    monkeypatch.setattr(line_retrieval, "evaluate", lambda *a, **k: result)
    out = tmp_path / "eval"
    assert (
        eval_main(
            [
                "line-retrieval",
                "--hf",
                str(tmp_path),
                "--lengths",
                "128",
                "--depths",
                "2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    table = (out / "line_retrieval.md").read_text().strip()
    assert table.splitlines()[2] == "| 128 | 120 | 1.00 | 0.00 | 0.50 |"
    assert table in capsys.readouterr().out
    assert json.loads((out / "line_retrieval.json").read_text())["samples"] == records
    assert (out / "line_retrieval.png").read_bytes()[:4] == b"\x89PNG"


def test_a_bad_out_is_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("")
    for module in (perplexity, passkey, needle):
        monkeypatch.setattr(module, "load_model", lambda args: pytest.fail("model loaded"))
    for task in ("perplexity", "passkey", "needle", "line-retrieval"):
        rc = eval_main(
            [task, "--hf", str(tmp_path / "nowhere"), "--data", DEMO_TOKENIZER, "--out", str(afile)]
            if task in ("perplexity", "needle")
            else [task, "--hf", str(tmp_path / "nowhere"), "--out", str(afile)]
        )
        err = capsys.readouterr().err
        assert rc == 2 and err == f"error: --out {str(afile)!r} is a file; pass a folder\n"


def test_unknown_task_and_bad_flags_are_one_line(tmp_path, capsys):
    assert eval_main(["bleu"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown task 'bleu'; use one of")
    assert (
        eval_main(
            [
                "needle",
                "--hf",
                str(tmp_path),
                "--data",
                str(tmp_path / "none.jsonl"),
                "--needle",
                "no number here",
                "--out",
                str(tmp_path / "o"),
            ]
        )
        == 2
    )
    assert capsys.readouterr().err.count("\n") == 1
    assert (
        eval_main(
            [
                "perplexity",
                "--hf",
                str(tmp_path),
                "--data",
                str(tmp_path / "none.jsonl"),
                "--out",
                str(tmp_path / "o"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("error: --data") and "no data files" in err and err.count("\n") == 1


@pytest.mark.slow
def test_perplexity_says_which_lengths_no_document_reaches(checkpoint, capsys):
    out = checkpoint["root"] / "out_none"
    rc, printed, err = run_task(
        capsys,
        "perplexity",
        checkpoint,
        out,
        "--data",
        checkpoint["data"],
        "--lengths",
        "64,100000",
        "--buckets",
        "4",
    )
    assert rc == 0, err
    line = "**length 100000: nothing measured, no document of --data holds 100001 tokens"
    table = (out / "perplexity.md").read_text()
    assert line in table and line in printed
    report = json.loads((out / "perplexity.json").read_text())
    assert [r["loss"] is None for r in report["lengths"]] == [False, True]
    # no length at all: one line before anything is measured
    short = checkpoint["root"] / "short.jsonl"
    short.write_text('{"text": "Too short."}\n{"text": "Short too."}\n')
    rc, _, err = run_task(capsys, "perplexity", checkpoint, out, "--data", str(short))
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith("error: --data holds no document long enough for any of --lengths")


@pytest.mark.slow
def test_perplexity_keeps_the_lengths_measured_before_a_failure(checkpoint, capsys, monkeypatch):
    """The default lengths are the trained 64 tokens x1, x2, x4; the forward at the last
    runs out of memory (here: raises as XLA would): the first two stay on disk."""
    measure = perplexity.position_losses

    def out_of_memory_at_256(model, windows_, batch_size):
        if windows_.shape[1] - 1 == 256:
            raise MemoryError("RESOURCE_EXHAUSTED")
        return measure(model, windows_, batch_size)

    monkeypatch.setattr(perplexity, "position_losses", out_of_memory_at_256)
    out = checkpoint["root"] / "out_partial"
    with pytest.raises(MemoryError):
        run_task(
            capsys, "perplexity", checkpoint, out, "--data", checkpoint["data"], "--buckets", "4"
        )
    assert f"(64, 128) is in {out}" in capsys.readouterr().err
    report = json.loads((out / "perplexity.json").read_text())
    assert report["complete"] is False and report["lengths_asked"] == [64, 128, 256]
    assert [r["length"] for r in report["lengths"]] == [64, 128]
    assert "**incomplete" in (out / "perplexity.md").read_text()

"""The benchmarks run (toy sizes on CPU; numbers are not asserted, only that they report) and
the pieces they compute with are right."""

import importlib.util
import os
import re

import jax
import numpy as np
import pytest

from bench import __main__ as suite
from bench import data_throughput, train_step
from bench.max_context import search
from bench.report import TOY_NOTE, default_out_dir
from bench.striped_sim import LAYOUTS, block_pairs, mask_class, ring_bound, round_times
from lclm.ops.layout import original_positions

pytestmark = pytest.mark.slow  # trains models or starts processes: left out by -m 'not slow'

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_train_step_bench_reports_a_table(tmp_path):
    out = tmp_path / "t.md"
    assert train_step.main(["--config", os.path.join(ROOT, "configs", "demo.py"), "--seq", "64",
                            "--layouts", "striped,contiguous", "--steps", "1",
                            "--config.model.n_layers=1", "--out", str(out)]) == 0
    table = out.read_text()
    assert TOY_NOTE in table
    assert table.count("| 64 | blockwise | ") == 2
    assert (tmp_path / "t.png").read_bytes().startswith(b"\x89PNG")


def test_data_throughput_bench_reports_both_paths(tmp_path):
    out = tmp_path / "d.md"
    assert data_throughput.main(["--seq", "256", "--batch", "2", "--batches", "2",
                                 "--out", str(out)]) == 0
    table = out.read_text()
    assert "tokenize+pack+stripe" in table and "pre-tokenised memmap" in table


def _tree(path):
    """{relative path: (size, mtime)} of every file under `path`."""
    out = {}
    for folder, _, files in os.walk(path):
        for name in files:
            st = os.stat(os.path.join(folder, name))
            out[os.path.relpath(os.path.join(folder, name), path)] = (st.st_size, st.st_mtime_ns)
    return out


def test_cpu_suite_smallest_writes_stamped_reports_and_plots(tmp_path, monkeypatch, capsys):
    """Without --out the suite writes into a new ./bench_results/cpu-<timestamp>, never into the
    committed reference results under bench/results/."""
    committed = _tree(os.path.join(ROOT, "bench", "results"))
    monkeypatch.chdir(tmp_path)
    assert suite.main(["--suite", "cpu", "--smallest"]) == 0
    assert _tree(os.path.join(ROOT, "bench", "results")) == committed
    (out,) = (tmp_path / "bench_results").iterdir()
    assert out.name.startswith("cpu-") and f"results: {out}" in capsys.readouterr().out
    stamp = f"device: {jax.devices()[0].device_kind} (cpu"
    for name in [*suite.PARTS.values(), "index"]:
        text = (out / f"{name}.md").read_text()
        assert stamp in text and f"jax {jax.__version__}" in text, name
        assert TOY_NOTE in text, name
    for name in suite.PARTS.values():
        if name != "correctness":  # a table of errors, no plot
            assert (out / f"{name}.png").read_bytes().startswith(b"\x89PNG"), name
    index = (out / "index.md").read_text()
    assert index.count("| ok |") == len(suite.PARTS) and stamp in index
    # every part measured something: no skipped or failed rows at the smallest sizes
    assert "| blockwise | causal | 64 |" in (out / "correctness.md").read_text()
    assert "| lclm blockwise | causal |" in (out / "attention.md").read_text()
    assert "| blockwise | 2 | 128 |" in (out / "striped_sim.md").read_text()
    train = (out / "train_step.md").read_text()
    assert "| baseline |" in train and train.count("| ok |") == 2
    context = (out / "max_context.md").read_text()
    assert "| lclm |" in context and "| vanilla |" in context and "512 ok" in context


def test_suite_writes_where_out_says(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "named" / "here"
    assert suite.main(["--suite", "cpu", "--smallest", "--parts", "striped",
                       "--out", str(out)]) == 0
    assert sorted(os.listdir(out)) == ["index.md", "striped_sim.md", "striped_sim.png"]
    assert not (tmp_path / "bench_results").exists()


def test_default_results_folder_is_outside_the_tracked_tree():
    path = default_out_dir("gpu")
    assert not os.path.isabs(path) and path.startswith(os.path.join("bench_results", "gpu-"))
    assert re.fullmatch(r"gpu-\d{8}-\d{6}", os.path.basename(path))
    with open(os.path.join(ROOT, ".gitignore")) as f:
        assert "bench_results/" in f.read().split()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_block_pairs_of_one_mask_class_have_one_mask(layout):
    """The simulation times one block pair per class: every pair of a class (any layout,
    round, device and N) must have the same mask, and the class names must say which mask."""
    c = 8
    x = np.arange(c)
    first_half = np.broadcast_to(x < c // 2, (c, c))
    expected = {"causal": x[:, None] >= x[None, :], "strict": x[:, None] > x[None, :],
                "full": np.ones((c, c), bool), "hidden": np.zeros((c, c), bool),
                "key half": first_half, "query half": ~first_half.T}
    for n in (2, 4, 8):
        for _, device, source in block_pairs(n):
            q = original_positions(layout, n, device, c)
            k = original_positions(layout, n, source, c)
            mask = q[:, None] >= k[None, :]
            np.testing.assert_array_equal(mask, expected[mask_class(layout, n, device, source)])


def test_search_finds_the_longest_fitting_length():
    probed = []

    def fits(seq):
        probed.append(seq)
        return seq <= 1000

    assert search(fits, 128, 8192, 64) == (960, 1024)
    assert probed[:5] == [128, 256, 512, 1024, 768]
    assert search(lambda s: False, 128, 8192, 64) == (None, 128)
    assert search(lambda s: True, 128, 1024, 64) == (1024, None)


def test_ring_time_waits_for_the_busiest_device_of_each_round():
    times = {"causal": 1.0, "full": 2.0, "hidden": 0.0, "strict": 0.9}
    assert round_times("contiguous", 4, times) == [1.0, 2.0, 2.0, 2.0]
    assert round_times("striped", 4, times) == [1.0, 1.0, 1.0, 1.0]


def test_ring_bound_counts_one_causal_then_full_rounds():
    # contiguous: causal round + (N-1) full rounds; striped: N causal rounds
    assert ring_bound(causal_s=1.0, full_s=2.0, n=4) == pytest.approx((1 + 3 * 2) / 4)
    assert ring_bound(causal_s=1.0, full_s=1.0, n=8) == pytest.approx(1.0)


def test_official_ringattention_wrapper_matches_dense_attention():
    """The comparison is only fair if the official package is called correctly."""
    if importlib.util.find_spec("ringattention") is None:  # its __init__ fails on new JAX
        pytest.skip("the ringattention package is not installed")
    from bench.attention import official_ring_method, qkv
    from lclm.ops.attention import dense_attention

    q, k, v, _ = qkv(1, 128, 2, 64, "float32")
    for causal in (True, False):
        out = official_ring_method(32, 32).fn(q, k, v, causal)
        np.testing.assert_allclose(out, dense_attention(q, k, v, causal=causal), atol=2e-5)


def test_baseline_step_computes_lclms_loss_and_gradients():
    """The baseline differs from lclm only in how it computes (dense attention, unchunked
    FFN): on one device, one document per row, loss and gradients agree in float32."""
    from bench import baseline
    from lclm.models.llama import LlamaConfig, init_params, loss_terms

    c = LlamaConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48,
                    dtype="float32", ffn_chunk=8, loss_chunk=8, tie_embeddings=False)
    params = init_params(c, jax.random.key(0))
    rng = np.random.default_rng(0)
    t = 32
    batch = dict(tokens=rng.integers(0, 97, (2, t)).astype(np.int32),
                 targets=rng.integers(0, 97, (2, t)).astype(np.int32),
                 loss_mask=(rng.random((2, t)) < 0.8).astype(np.float32),
                 positions=np.broadcast_to(np.arange(t, dtype=np.int32), (2, t)),
                 segment_ids=np.zeros((2, t), np.int32))
    mean = lambda terms: (lambda p: terms(p)[0] / terms(p)[1])
    want, want_g = jax.value_and_grad(mean(lambda p: loss_terms(c, p, batch)))(params)
    got, got_g = jax.value_and_grad(mean(lambda p: baseline.loss_terms(c, p, batch)))(params)
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    for g, w in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-4, atol=1e-6)


def test_train_step_table_has_the_baseline_and_ratios(tmp_path):
    out = tmp_path / "t.md"
    assert train_step.main(["--config", os.path.join(ROOT, "configs", "demo.py"), "--seq", "64",
                            "--steps", "1", "--baseline", "--config.model.n_layers=1",
                            "--config.mesh.fsdp=1", "--config.mesh.sp=1",
                            "--out", str(out)]) == 0
    table = out.read_text()
    rows = {line.split(" | ")[3]: line for line in table.splitlines()
            if line.startswith("| demo.py")}
    assert set(rows) == {"baseline", "blockwise"}, table
    assert "| 1.00 |" in rows["baseline"] and re.search(r"\| \d+\.\d\d \|", rows["blockwise"])


@pytest.mark.slow
def test_correctness_passes_real_kernels_and_catches_wrong_ones(monkeypatch):
    from bench.correctness import CASES, CorrectnessSpec, check
    from lclm.ops import attention

    spec = CorrectnessSpec().smallest()
    for case in CASES:
        assert check("blockwise", case, 64, spec)["status"] == "ok", case
    assert check("pallas_gpu", "causal + strict, segments", 64, spec)["status"] == "ok"
    right = attention.KERNELS["blockwise"]

    def off_dk(*args, **kw):  # a kernel whose dK is 5% off
        dq, dk, dv = right.backward(*args, **kw)
        return dq, dk * 1.05, dv

    def local_statistics(q, k, v, o, lse, do, *ids, **kw):  # ignores the global o and lse
        o_local, lse_local = right.forward(q, k, v, *ids, **kw)
        return right.backward(q, k, v, o_local.astype(q.dtype), lse_local, do, *ids, **kw)

    for name, backward in (("off_dk", off_dk), ("local", local_statistics)):
        monkeypatch.setitem(attention.KERNELS, name, attention.Kernel(right.forward, backward))
    result = check("off_dk", "gqa", 64, spec)
    assert result["status"] == "WRONG" and result["dk"] > 0.02 > result["dq"]
    assert check("local", "causal", 64, spec)["status"] == "ok"  # one block: local = global
    assert check("local", "causal + strict, segments", 64, spec)["status"] == "WRONG"


def test_every_suite_names_existing_configs_and_kernels():
    from lclm.ops.attention import KERNELS

    for name, s in suite.SUITES.items():
        assert s.parts(), name
        for run in (s.train.models if s.train else ()):
            assert os.path.isfile(os.path.join(ROOT, run.config)), run.config
        for impls in (s.train and s.train.impls, s.attention and s.attention.impls):
            assert set(impls or ()) <= {"auto", *KERNELS}, (name, impls)
    quick = suite.SUITES["gpu-quick"]
    assert quick.parts() == ["correctness", "attention", "train"] and quick.train.baseline

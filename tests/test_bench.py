"""The benchmarks run (toy sizes on CPU; numbers are not asserted, only that they report) and
the pieces they compute with are right."""

import dataclasses
import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
import tempfile

import jax
import numpy as np
import pytest
from support import DEMO_CONFIG, ROOT

from bench import __main__ as suite
from bench import data_throughput, train_step
from bench.max_context import search
from bench.report import TOY_NOTE, default_out_dir
from bench.striped_sim import LAYOUTS, block_pairs, mask_class, ring_bound, round_times
from lclm.ops.layout import original_positions

pytestmark = pytest.mark.slow  # trains models or starts processes: left out by -m 'not slow'


def test_train_step_bench_reports_a_table(tmp_path):
    out = tmp_path / "t.md"
    assert (
        train_step.main(
            [
                "--config",
                DEMO_CONFIG,
                "--seq",
                "64",
                "--layouts",
                "striped,contiguous",
                "--steps",
                "1",
                "--config.model.n_layers=1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    table = out.read_text()
    assert TOY_NOTE in table
    assert table.count("| 64 | blockwise | ") == 2
    assert (tmp_path / "t.png").read_bytes().startswith(b"\x89PNG")


def test_data_throughput_bench_reports_both_paths(tmp_path, monkeypatch):
    out = tmp_path / "d.md"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    assert (
        data_throughput.main(["--seq", "256", "--batch", "2", "--batches", "2", "--out", str(out)])
        == 0
    )
    table = out.read_text()
    assert "tokenize+pack+stripe" in table and "pre-tokenised memmap" in table
    assert "CPU seconds" in table
    assert list(scratch.iterdir()) == []  # the prepared copies are gone


def test_checkpoint_bench_saves_and_restores_on_disk_and_a_local_gcs_server(tmp_path):
    out = tmp_path / "c.md"
    env = dict(os.environ, TMPDIR=str(tmp_path / "tmp"))  # its checkpoints and the server's
    (tmp_path / "tmp").mkdir()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.checkpoint_save",
            "--models",
            "demo",
            "--formats",
            "lclm,orbax",
            "--repeat",
            "1",
            "--gcs",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    table = out.read_text()
    assert "| local | demo | lclm |" in table and "| gcs (local server) | demo | orbax |" in table
    assert "local emulator" in table
    rows = json.loads((tmp_path / "c.json").read_text())["rows"]
    assert [(row["target"], row["format"]) for row in rows] == [
        ("local", "lclm"),
        ("gcs (local server)", "lclm"),
        ("local", "orbax"),
        ("gcs (local server)", "orbax"),
    ]
    assert all(row["restore_s"] > 0 and row["save_s"] >= row["blocking_s"] for row in rows)
    # the disk's own speed, measured beside each, and what each step holds on disk
    assert all(
        row["dd_gbps"] > 0 and row["numpy_read_gbps"] > 0 and row["disk_bytes"] > 0 for row in rows
    )
    assert list((tmp_path / "tmp").iterdir()) == []  # checkpoints and the server's folder gone


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
    parts = [suite.PARTS[part] for part in suite.SUITES["cpu"].parts()]
    for name in [*parts, "index"]:
        text = (out / f"{name}.md").read_text()
        assert stamp in text and f"jax {jax.__version__}" in text, name
        assert TOY_NOTE in text, name
    for name in parts:
        if name != "correctness":  # a table of errors, no plot
            assert (out / f"{name}.png").read_bytes().startswith(b"\x89PNG"), name
    index = (out / "index.md").read_text()
    assert index.count("| ok |") == len(parts) == 5 and stamp in index
    # every part measured something: no skipped or failed rows at the smallest sizes
    assert "| blockwise | causal | 64 |" in (out / "correctness.md").read_text()
    assert "| lclm blockwise | causal |" in (out / "attention.md").read_text()
    assert "| blockwise | 2 | 128 |" in (out / "striped_sim.md").read_text()
    train = (out / "train_step.md").read_text()
    # the baseline's three remat variants, the row naming the fastest, lclm's row
    assert train.count("| baseline |") == 4 and "(fastest that fits) |" in train
    assert train.count("| ok |") == 5 and "6N + 6 L T D" in train
    context = (out / "max_context.md").read_text()
    assert "| lclm |" in context and "| vanilla |" in context and "512 ok" in context


def test_suite_writes_where_out_says(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "named" / "here"
    assert (
        suite.main(["--suite", "cpu", "--smallest", "--parts", "striped", "--out", str(out)]) == 0
    )
    assert sorted(os.listdir(out)) == [
        "index.json",
        "index.md",
        "striped_sim.md",
        "striped_sim.png",
    ]
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
    expected = {
        "causal": x[:, None] >= x[None, :],
        "strict": x[:, None] > x[None, :],
        "full": np.ones((c, c), bool),
        "hidden": np.zeros((c, c), bool),
        "key half": first_half,
        "query half": ~first_half.T,
    }
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
    from lclm.ops.kernels.reference import dense_attention

    q, k, v, _ = qkv(1, 128, 2, 64, "float32")
    for causal in (True, False):
        out = official_ring_method(32, 32).fn(q, k, v, causal)
        np.testing.assert_allclose(out, dense_attention(q, k, v, causal=causal), atol=2e-5)


def test_baseline_step_computes_lclms_loss_and_gradients():
    """The baseline differs from lclm only in how it computes (dense attention, unchunked
    FFN): on one device, one document per row, loss and gradients agree in float32."""
    from bench import baseline
    from lclm.config import ModelConfig
    from lclm.models.decoder import init_params, loss_terms

    c = ModelConfig(
        vocab_size=97,
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=48,
        dtype="float32",
        ffn_chunk=8,
        loss_chunk=8,
        tie_embeddings=False,
    )
    params = init_params(c, jax.random.key(0))
    rng = np.random.default_rng(0)
    t = 32
    batch = dict(
        tokens=rng.integers(0, 97, (2, t)).astype(np.int32),
        targets=rng.integers(0, 97, (2, t)).astype(np.int32),
        loss_mask=(rng.random((2, t)) < 0.8).astype(np.float32),
        positions=np.broadcast_to(np.arange(t, dtype=np.int32), (2, t)),
        segment_ids=np.zeros((2, t), np.int32),
    )
    mean = lambda terms: lambda p: terms(p)[0] / terms(p)[1]
    want, want_g = jax.value_and_grad(mean(lambda p: loss_terms(c, p, batch)))(params)
    got, got_g = jax.value_and_grad(mean(lambda p: baseline.loss_terms(c, p, batch)))(params)
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    for g, w in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-4, atol=1e-6)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_train_step_table_has_the_baseline_and_ratios(tmp_path, monkeypatch):
    """A tiny real run, every row in a child (--isolate): the baseline's child times its three
    remat variants; the fastest of them is the baseline every ratio divides by."""
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # what --isolate sets here
    out = tmp_path / "t.md"
    assert (
        train_step.main(
            [
                "--config",
                DEMO_CONFIG,
                "--seq",
                "64",
                "--steps",
                "1",
                "--warmup",
                "0",
                "--baseline",
                "--isolate",
                "--config.model.n_layers=1",
                "--config.mesh.fsdp=1",
                "--config.mesh.sp=1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    table = out.read_text()
    header, *rows = [
        _cells(line) for line in table.splitlines() if line.startswith(("| model", "| demo.py"))
    ]
    col = {name: i for i, name in enumerate(header)}
    rows = [{name: row[i] for name, i in col.items()} for row in rows]
    assert [r["kernel"] for r in rows] == ["baseline"] * 4 + ["blockwise"], table
    variants, choice, lclm = rows[:3], rows[3], rows[4]
    assert [r["remat"] for r in variants] == ["full", "dots", "none"]
    assert all(r["status"] == "ok" and r["vs baseline"] == "-" for r in variants), table
    tokens = lambda r: float(r["tokens/s"].replace(",", ""))
    fastest = max(variants, key=tokens)
    assert choice["remat"] == f"{fastest['remat']} (fastest that fits)"
    assert choice["tokens/s"] == fastest["tokens/s"] and choice["vs baseline"] == "1.00"
    assert float(lclm["vs baseline"]) == pytest.approx(tokens(lclm) / tokens(fastest), abs=0.01)
    assert "6N + 6 L T D" in table and "MFU (6N + 6LTD per token)" in header


@pytest.mark.slow
def test_correctness_passes_real_kernels_and_catches_wrong_ones(monkeypatch):
    from bench.correctness import CASES, CorrectnessSpec, check
    from lclm.ops import kernels

    spec = CorrectnessSpec().smallest()
    for case in CASES:
        assert check("blockwise", case, 64, spec)["status"] == "ok", case
    assert check("pallas_gpu", "causal + strict, segments", 64, spec)["status"] == "ok"
    right = kernels.KERNELS["blockwise"]

    def off_dk(*args, **kw):  # a kernel whose dK is 5% off
        dq, dk, dv = right.backward(*args, **kw)
        return dq, dk * 1.05, dv

    def local_statistics(q, k, v, o, lse, do, *ids, **kw):  # ignores the global o and lse
        o_local, lse_local = right.forward(q, k, v, *ids, **kw)
        return right.backward(q, k, v, o_local.astype(q.dtype), lse_local, do, *ids, **kw)

    for name, backward in (("off_dk", off_dk), ("local", local_statistics)):
        monkeypatch.setitem(kernels.KERNELS, name, kernels.Kernel(right.forward, backward))
    result = check("off_dk", "gqa", 64, spec)
    assert result["status"] == "WRONG" and result["dk"] > 0.02 > result["dq"]
    assert check("local", "causal", 64, spec)["status"] == "ok"  # one block: local = global
    assert check("local", "causal + strict, segments", 64, spec)["status"] == "WRONG"


def test_correctness_checks_a_kernels_whole_sequence_attention_and_catches_a_wrong_one(
    monkeypatch, tmp_path
):
    """Kernels with `Kernel.whole` (cudnn_gpu's cuDNN call) get the WHOLE_CASES rows too."""
    from bench import correctness
    from lclm.ops import kernels

    spec = dataclasses.replace(
        correctness.CorrectnessSpec().smallest(), impls=("blockwise", "whole_off")
    )
    right = kernels.KERNELS["blockwise"]

    def whole_off(q, k, v, seg, *, causal, fallback):  # 5% off where documents are packed
        return fallback() * (1.0 if seg is None else 1.05)

    monkeypatch.setitem(kernels.KERNELS, "whole_off", right._replace(whole=whole_off))
    monkeypatch.setattr(
        correctness, "checked_kernels", lambda platform, spec: (list(spec.impls), [])
    )
    with pytest.raises(RuntimeError, match="kernel correctness failed"):
        correctness.run(spec, str(tmp_path))
    rows = (tmp_path / "correctness.md").read_text()
    assert "| blockwise | whole" not in rows  # no whole-sequence attention of its own
    assert "| whole_off | whole | 64 |" in rows and rows.count("WRONG") == 3


def test_every_suite_names_existing_configs_and_kernels():
    from lclm.ops.kernels import KERNELS

    for name, s in suite.SUITES.items():
        assert s.parts(), name
        for run in s.train.models if s.train else ():
            assert os.path.isfile(os.path.join(ROOT, run.config)), run.config
        for impls in (s.train and s.train.impls, s.attention and s.attention.impls):
            assert set(impls or ()) <= {"auto", *KERNELS}, (name, impls)
    quick = suite.SUITES["gpu-quick"]
    assert quick.defaults() == ["correctness", "attention", "train"] and quick.train.baseline
    assert quick.parts() == ["correctness", "attention", "striped", "train", "max_context"]
    assert quick.needs_gpu and quick.separate_parts
    assert quick.part_timeout < 600  # under a device command's limit
    for part in quick.parts():  # every part is held to a budget that ends well before
        assert getattr(quick, part).budget_s <= 420, part
    assert [(os.path.basename(run.config), run.seqs) for run in quick.train.models] == [
        ("llama1b.py", (8192, 32768))
    ]
    assert quick.attention.masks == ("causal",) and quick.attention.blocks == (8192, 32768)
    lease = suite.SUITES["gpu-lease"]  # one 10-minute command: the parts' kills sum under it
    assert sum(lease.timeout(part) for part in lease.defaults()) <= 540
    assert all(getattr(lease, p).budget_s < lease.timeout(p) for p in lease.defaults())


def test_the_host_suite_judges_each_figure_against_its_reference_of_the_same_run(tmp_path):
    """`--suite host`: each part's figures beside their references, the ratio of the two and
    the target's verdict, gathered into index.md's last table."""
    from bench import checkpoint_save, compile_speed, data_throughput
    from bench.report import write_targets

    host = suite.SUITES["host"]
    assert host.parts() == ["loader", "checkpoint", "compile"] and not host.needs_gpu
    gb = 1.6e9
    saves = [  # save at 0.8 and 0.4 of dd, restore at 0.25 of the numpy read
        dict(
            target="local",
            model="m",
            format="lclm",
            state_bytes=gb,
            save_s=s,
            dd_gbps=d,
            restore_s=4.0,
            numpy_read_gbps=1.6,
            save_extra_bytes=0.0,
            restore_extra_bytes=e,
        )
        for s, d, e in ((2.0, 1.0, 1.2 * gb), (2.0, 2.0, 1.7 * gb))
    ]
    judged = {r["what"].split(",")[0]: r for r in checkpoint_save._targets(saves)}
    assert judged["save"]["ratio"] == pytest.approx(0.6) and judged["save"]["met"]
    assert judged["restore"]["ratio"] == pytest.approx(0.25) and not judged["restore"]["met"]
    assert not judged["restore: peak extra host memory"]["met"]  # the worst of the two: 1.7x
    assert judged["save: peak extra host memory"]["met"]
    loader = dict(tokens=800, cpu=1.0, alone=1000.0, wait=0.01, step=0.2)
    figures = dict(loader=loader, prepared=dict(tokens=1_000_000, cpu=1.0))
    fed = data_throughput._targets(8192, figures, 272_000)
    assert [round(r["ratio"], 3) for r in fed] == [0.8, 0.05, round(1e6 / 272_000, 3)]
    assert [r["met"] for r in fed] == [False, True, True]
    compiled = compile_speed._targets(
        {
            "plain": dict(compile_s=[10.0, 12.0, 11.0], traffic=100e9),
            "lclm, masks": dict(compile_s=[13.0, 12.0, 14.0], traffic=101e9),
        }
    )
    assert [round(r["ratio"], 3) for r in compiled] == [round(13 / 11, 3), 1.01]
    assert all(r["met"] for r in compiled)
    write_targets(str(tmp_path), "checkpoint_save", checkpoint_save._targets(saves))
    write_targets(str(tmp_path), "compile_speed", compiled)
    suite.write_index(
        str(tmp_path), "host", host, [("checkpoint", "ok", 1.0), ("compile", "ok", 2.0)]
    )
    index = (tmp_path / "index.md").read_text()
    table = index[index.index("# Against the targets") :]
    assert (
        "| checkpoint | restore, m (1.60 GB), local (GB/s) | 0.40 | 1.60 (numpy read) | 0.25 |"
        in table
    )
    assert table.count("**not met**") == 2 and table.count("| met |") == 4


# -- results survive a kill, plots are best-effort, GPU suites need a GPU, a fair baseline --


def _table_rows(path) -> list[str]:
    """The data rows of every markdown table in the file at `path` (as written so far)."""
    lines = path.read_text().splitlines() if path.exists() else []
    heads = {i - 1 for i, line in enumerate(lines) if line.startswith("| ---")}
    return [
        line
        for i, line in enumerate(lines)
        if line.startswith("| ") and i not in heads and not line.startswith("| ---")
    ]


def _fake_attention(monkeypatch, tmp_path, names=("a", "b")):
    """bench.attention with methods `names` and a `measure` that records how many rows the
    report held when each measurement started (no JAX work: milliseconds)."""
    from bench import attention

    path = tmp_path / "attention.md"
    rows_before = []

    def measure(method, t, heads, causal, spec, head_dim=None):
        rows_before.append(len(_table_rows(path)))
        return dict(fwd_s=1e-3, fwd_bwd_s=3e-3, fwd_tflops=1.0, fwd_bwd_tflops=2.0)

    monkeypatch.setattr(attention, "measure", measure)
    monkeypatch.setattr(
        attention,
        "methods",
        lambda platform, spec: ([attention.Method(n, None) for n in names], []),
    )
    spec = attention.AttentionSpec(
        blocks=(128, 256), heads=(2,), head_dims=(64,), masks=("causal",), warmup=0, iters=1
    )
    return attention, spec, path, rows_before


def test_a_part_writes_each_row_the_moment_it_is_measured(tmp_path, monkeypatch):
    """When the k-th measurement starts, the k-1 before it are already in the file: a part
    killed midway leaves every finished row."""
    attention, spec, path, rows_before = _fake_attention(monkeypatch, tmp_path)
    assert attention.run(spec, str(tmp_path)) == str(path)
    assert rows_before == [0, 1, 2, 3]
    assert len(_table_rows(path)) == 4 and "![attention.png](attention.png)" in path.read_text()


_CHILD = """
import os, sys, time
from bench.isolate import emit_record
emit_record({"n": 1})
for _ in range(200):  # 10 s for the parent to see record 1 while this process still runs
    if os.path.exists(sys.argv[1]):
        break
    time.sleep(0.05)
else:
    sys.exit(3)
emit_record({"n": 2})
"""


def test_a_child_process_hands_over_each_record_as_it_prints_it(tmp_path, monkeypatch):
    """The train part's rows (and the baseline's three remat variants) come from children:
    each record reaches the parent while the child still runs, and a child killed at its
    timeout keeps the records it printed."""
    from bench.isolate import run_child

    (tmp_path / "bench_child_probe.py").write_text(_CHILD)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    go = tmp_path / "go"
    got = []

    def on_record(record):
        got.append((record["n"], go.exists()))
        go.touch()  # the child waits for this before its second record

    records, status = run_child("bench_child_probe", [str(go)], 60, on_record=on_record)
    assert (status, got, records) == ("ok", [(1, False), (2, True)], [{"n": 1}, {"n": 2}])
    records, status = run_child("bench_child_probe", [str(tmp_path / "never")], 1.5)
    assert (status, records) == ("timeout", [{"n": 1}])


def test_an_out_of_memory_child_says_which_memory(tmp_path, monkeypatch):
    """A row that ran out of memory keeps the line that says which memory and how much (a
    512K step on the H200 came back as a bare 'OOM' and could not be told apart)."""
    from bench.isolate import run_child

    message = (
        "jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while "
        "trying to allocate 68719476736 bytes."
    )
    (tmp_path / "bench_oom_probe.py").write_text(
        f"import os, sys\nprint('BufferAssignment ...')\nprint({message!r}, file=sys.stderr)\n"
        "if sys.argv[1] == 'kill':\n    os.kill(os.getpid(), 9)\nsys.exit(1)\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert run_child("bench_oom_probe", ["exit"], 60) == ([], f"OOM: {message}")
    assert run_child("bench_oom_probe", ["kill"], 60) == (
        [],
        "OOM: killed by SIGKILL (host memory?)",
    )


def test_a_failed_plot_keeps_the_table(tmp_path, monkeypatch, caplog):
    from bench import plots

    attention, spec, path, _ = _fake_attention(monkeypatch, tmp_path)

    def broken(*args, **kwargs):
        raise RuntimeError("no display")

    monkeypatch.setattr(plots, "save_lines", broken)
    with caplog.at_level(logging.WARNING, logger="bench"):
        assert attention.run(spec, str(tmp_path)) == str(path)
    assert len(_table_rows(path)) == 4 and "![" not in path.read_text()
    assert "plot _plot failed (RuntimeError: no display)" in caplog.text
    # nothing measured at all (no usable method): the table, and no ZeroDivisionError
    monkeypatch.undo()
    attention, spec, path, _ = _fake_attention(monkeypatch, tmp_path, names=())
    with caplog.at_level(logging.WARNING, logger="bench"):
        attention.run(spec, str(tmp_path))
    assert _table_rows(path) == [] and "nothing to plot" in caplog.text
    with pytest.raises(ValueError, match="nothing to plot"):
        plots.save_lines(str(tmp_path / "x.png"), "t", [], [])


@pytest.mark.parametrize("platforms", [None, "cpu"])
def test_gpu_suites_on_a_cpu_say_so_in_one_line_and_exit_2(tmp_path, platforms):
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    if platforms:
        env["JAX_PLATFORMS"] = platforms
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--suite", "gpu-quick", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--suite gpu-quick needs a GPU" in lines[0], proc.stderr
    assert proc.stdout == "" and not out.exists()  # nothing started, nothing written


def test_the_baseline_is_the_fastest_remat_that_fits():
    from bench.baseline import REMATS, fastest_that_fits

    assert list(REMATS) == ["full", "dots", "none"]  # the order they run in: memory grows
    full = dict(remat="full", status="ok", step_s=3.0)
    dots = dict(remat="dots", status="ok", step_s=2.0)
    assert fastest_that_fits([full, dots, dict(remat="none", status="OOM")]) is dots
    none = dict(remat="none", status="ok", step_s=1.5)
    assert fastest_that_fits([full, dots, none]) is none
    too_big = dict(
        remat="none", status="does not fit: XLA estimate 90.0 GiB > 75.0 GiB", step_s=None
    )
    assert fastest_that_fits([full, dict(dots, status="timeout"), too_big]) is full
    assert fastest_that_fits([dict(full, status="OOM"), dict(dots, status="failed: x")]) is None


def _fake_row(times):
    """A `train_step.run_row` whose records have the step seconds `times[(impl, remat)]`
    (None: out of memory)."""

    def run_row(run, seq, layout, impl, *, steps, warmup, isolate, timeout, on_record=None):
        records = []
        for remat in train_step.row_remats(impl):
            step_s = times[(impl, remat)]
            r = dict(
                model=os.path.basename(run.config),
                seq=seq,
                impl=impl,
                layout=layout or "",
                remat=remat or "attention",
                status="ok" if step_s else "OOM",
                step_s=step_s,
                tokens_s=seq / step_s if step_s else None,
            )
            records.append(r)
            on_record(r)
        return records

    return run_row


def test_train_rows_compare_with_the_fastest_baseline_that_fits(tmp_path, monkeypatch):
    times = {
        ("baseline", "full"): 4.0,
        ("baseline", "dots"): 2.0,
        ("baseline", "none"): None,
        ("blockwise", None): 1.0,
    }
    monkeypatch.setattr(train_step, "run_row", _fake_row(times))
    spec = train_step.TrainSpec(
        models=(train_step.ModelRun("configs/demo.py", (64, 128)),), impls=("blockwise",)
    )
    path = tmp_path / "train_step.md"
    report = train_step.TrainReport(spec, str(path))
    written = []

    def add(record):
        written.append(len(_table_rows(path)))  # rows in the file before this one
        report.add(record)

    train_step.collect(spec, spec.impls, on_record=add)
    assert written == list(range(10))  # 2 lengths x (3 variants, the choice, lclm)
    rows = [_cells(line) for line in _table_rows(path)]
    assert [(r[2], r[5], r[9], r[-1]) for r in rows[:5]] == [
        ("64", "full", "-", "ok"),
        ("64", "dots", "-", "ok"),
        ("64", "none", "-", "OOM"),
        ("64", "dots (fastest that fits)", "1.00", "ok"),
        ("64", "attention", "2.00", "ok"),
    ]
    # a budget spent before the first row: every row says so, nothing runs
    monkeypatch.setattr(train_step, "run_row", None)
    skipped = train_step.collect(dataclasses.replace(spec, budget_s=0.0), spec.impls)
    assert len(skipped) == 8 and all("budget" in r["status"] for r in skipped)  # no choices


def test_correctness_checks_lower_one_fused_call_per_visible_round():
    """Positions closed over as constants: a range-based kernel (tokamax_gpu's adapter) sees
    each block pair's class while tracing and lowers one attend and one VJP call per round
    that sees anything, instead of a switch over all six classes per round."""
    import jax.numpy as jnp

    from bench.correctness import CASES, case_inputs, ring_of_blocks
    from lclm.ops.kernels.range_kernel import range_kernel

    calls = []

    def attend(q, k, v, causal, start, end):
        calls.append("attend")
        return jnp.zeros(q.shape, q.dtype), jnp.zeros(q.shape[:3], jnp.float32)

    def attend_vjp(q, k, v, o, lse, do, causal, start, end):
        calls.append("vjp")
        return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)

    kernel = range_kernel(attend, attend_vjp)
    tiles = dict(causal=True, q_chunk=32, kv_chunk=32)
    for case, (_, _, _, sources, _, _) in CASES.items():
        q, k, v, do, *ids = case_inputs(case, 64, 4, 64, "float32")
        ring_of_blocks(kernel, len(sources), tiles, *ids).lower(q, k, v, do)
    # 15 block pairs over the 10 cases, one of them hidden ('causal + hidden')
    assert calls.count("attend") == calls.count("vjp") == 14


def test_max_context_search_stops_at_its_budget_and_keeps_what_it_found(monkeypatch):
    from bench import max_context

    probed = []

    def run_child(module, argv, timeout):
        seq = int(argv[argv.index("--seq") + 1])
        probed.append(seq)
        return [dict(status="ok", seq=seq, step_s=1.0)], "ok"

    class TwoProbes:  # a budget spent after two probes
        seconds = 1.0

        def spent(self):
            return len(probed) >= 2

        def left(self):
            return 100.0

        def skipped(self):
            return "skipped: budget"

    monkeypatch.setattr(max_context, "run_child", run_child)
    spec = max_context.MaxContextSpec(start=512, cap=8192, resolution=512)
    seen = []
    result = max_context.search_variant(spec, "lclm", lambda *a: seen.append(a[1]), TwoProbes())
    assert probed == seen == [512, 1024]
    assert (result["best"], result["fail"], result["stopped"]) == (1024, None, "skipped: budget")
    assert "1K (search stopped: time budget)" in max_context._row(result, spec)


def test_profile_sums_a_gpu_traces_stream_kernels_by_kind(tmp_path):
    """bench.profile_step on a trace shaped as XLA:GPU writes one (process '/device:GPU:0',
    kernels on 'Stream #N' threads, the same time again on its 'XLA Ops' line), then a real
    run on the CPU: the report is written and, with no GPU stream in the trace, the raw
    trace is kept beside it."""
    import gzip

    from bench import profile_step

    def kernel(name, ts, dur, tid=14):
        return dict(ph="X", pid=1, tid=tid, name=name, ts=ts, dur=dur)

    events = [
        dict(ph="M", name="process_name", pid=1, args=dict(name="/device:GPU:0")),
        dict(ph="M", name="thread_name", pid=1, tid=14, args=dict(name="Stream #14(Compute)")),
        dict(ph="M", name="thread_name", pid=1, tid=2, args=dict(name="XLA Ops")),
        kernel("flash_attention_sm90_mosaic_gpu_kernel", 0, 600),
        kernel("nvjet_sm90_tst_128x160", 600, 300),
        kernel("MemcpyD2D", 900, 50),
        kernel("loop_add_fusion", 950, 50),
        kernel("fusion.1", 0, 1000, tid=2),
    ]
    folder = tmp_path / "trace" / "plugins" / "profile" / "1"
    folder.mkdir(parents=True)
    with gzip.open(folder / "host.trace.json.gz", "wt") as f:
        json.dump(dict(traceEvents=events), f)
    kernels, complete, _ = profile_step.trace_events(str(tmp_path / "trace"))
    assert len(kernels) == 4 and len(complete) == 5
    report = profile_step.summarise(kernels, steps=2, wall_ms=0.6)
    assert "| attention | 0.3 | 60.0% |" in report and "| matmul | 0.1 |" in report
    assert "| copy | 0.0 | 5.0% |" in report and "| other (XLA fusions) | 0.0 | 5.0% |" in report
    assert "at least one kernel running 0.5 ms of a span of 0.5 ms" in report
    overlapping = [dict(ts=0, dur=10), dict(ts=5, dur=10), dict(ts=30, dur=5)]
    assert profile_step.covered(overlapping) == 20  # streams overlap: time counted once

    assert (
        profile_step.main(
            [
                "--config",
                DEMO_CONFIG,
                "--seq",
                "64",
                "--steps",
                "1",
                "--config.model.n_layers=1",
                "--out",
                str(tmp_path / "p"),
            ]
        )
        == 0
    )
    written = sorted(p.name for p in (tmp_path / "p").iterdir())
    assert written == ["profile-blockwise-attention-64.md", "trace-blockwise-attention-64.json.gz"]


def test_seed_sweep_reads_finished_seeds_and_states_which_miss_the_target(tmp_path):
    """Seeds already run are read, not trained again; the table says which miss 90%."""
    from bench import line_retrieval_seeds as sweep
    from lclm.eval.retrieval import cell

    assert sweep.seed_list("0-2,7") == [0, 1, 2, 7]
    for seed, right_at_128 in ((3, 40), (4, 30)):  # of 40 prompts per length
        records = [
            dict(
                length=n,
                depth_bin=0,
                prompt_tokens=n,
                padded_to=n,
                correct=i < (40 if n == 64 else right_at_128),
            )
            for n in (64, 128)
            for i in range(40)
        ]
        folder = tmp_path / "runs" / f"seed{seed}"
        (folder / "eval").mkdir(parents=True)
        (folder / "eval" / "line_retrieval.json").write_text(
            json.dumps(dict(cells=[cell(records, n, 0, 1) for n in (64, 128)]))
        )
        (folder / "times.json").write_text(json.dumps(dict(train_wall_s=495.0, train_cpu_s=900.0)))
    out = tmp_path / "seeds.md"
    assert sweep.main(["--seeds", "3-4", "--runs", str(tmp_path / "runs"), "--out", str(out)]) == 1
    text = out.read_text()
    assert "| 3 | 100.0% | 100.0% | 8 min 15 s | 900 s | yes |" in text
    assert "| 4 | 100.0% | 75.0% | 8 min 15 s | 900 s | NO |" in text
    assert "1 of 2 seeds reach 90% at both lengths" in text

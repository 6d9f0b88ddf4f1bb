"""The benchmarks run (toy sizes on CPU; numbers are not asserted, only that they report)."""

import os

from bench import data_throughput, train_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_train_step_bench_reports_a_table(tmp_path, capsys):
    out = tmp_path / "t.md"
    assert train_step.main(["--config", os.path.join(ROOT, "configs", "demo.py"), "--seq", "64",
                            "--layouts", "striped,contiguous", "--steps", "1",
                            "--set", "model.n_layers=1", "--out", str(out)]) == 0
    table = out.read_text()
    assert "NOT a performance result" in table
    assert table.count("| 64 | ") == 2


def test_data_throughput_bench_reports_both_paths(tmp_path):
    out = tmp_path / "d.md"
    assert data_throughput.main(["--seq", "256", "--batch", "2", "--batches", "2",
                                 "--out", str(out)]) == 0
    table = out.read_text()
    assert "tokenize+pack+stripe" in table and "pre-tokenised memmap" in table

"""data/make_demo_data.py writes the committed demo files again byte for byte."""

import importlib.util
import os

from support import ROOT


def test_make_demo_data_reproduces_the_committed_files(tmp_path):
    script = os.path.join(ROOT, "data", "make_demo_data.py")
    spec = importlib.util.spec_from_file_location("make_demo_data", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--out", str(tmp_path)])
    names = ["corpus.jsonl", "heldout.jsonl", "sharegpt.jsonl", "tokenizer.model"]
    for name in names:
        with open(os.path.join(ROOT, "data", "demo", name), "rb") as f:
            assert (tmp_path / name).read_bytes() == f.read(), name
    assert sorted(os.listdir(tmp_path)) == names

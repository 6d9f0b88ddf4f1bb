"""What the evaluation tasks tell a reader (issue 62, item 3): --help shows whole descriptions
and every default, impossible length/bucket combinations are one line before the model loads,
the default --out never replaces an earlier report, every report records its strategy, the
heatmap marks the trained length and reads on every cell, and matplotlib's font-cache line
does not pose as lclm's."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import matplotlib
import pytest
from support import DEMO_TOKENIZER, ROOT

from lclm.errors import StartupError
from lclm.eval import line_retrieval, needle, passkey, perplexity, report, retrieval
from lclm.eval.__main__ import main as eval_main

TASKS = {
    "perplexity": perplexity,
    "passkey": passkey,
    "needle": needle,
    "line_retrieval": line_retrieval,
}


@pytest.mark.parametrize("task", sorted(TASKS))
def test_help_shows_the_whole_description_and_every_default(task):
    module = TASKS[task]
    ap = report.task_parser(module.__doc__, task, module.add_arguments, prog=task)
    text = " ".join(ap.format_help().split())
    # the docstring whole, not its first line cut mid-sentence
    assert " ".join(module.__doc__.split()) in text
    chosen = {a for g in ap._mutually_exclusive_groups for a in g._group_actions}
    for action in ap._actions:
        if action.dest == "help" or action.required or action in chosen:
            continue  # --checkpoint | --hf: one is given; --data of needle: no default
        helped = " ".join(ap._get_formatter()._expand_help(action).split())
        # a flag's help states its default: a value, or in words where it depends on the run
        assert "default" in helped, f"{action.option_strings} hides its default: {helped!r}"
        if action.default not in (None, False):
            assert str(action.default) in helped
    lengths = next(a for a in ap._actions if a.dest == "lengths")
    assert lengths.default is None and "trained length x1, x2 and x4" in lengths.help


def test_lengths_shorter_than_the_buckets_are_one_line_before_the_model_loads(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(perplexity, "load_model", lambda args: pytest.fail("model loaded"))
    data = os.path.join(ROOT, "data", "demo", "heldout.jsonl")
    for flags, short, fewest in (
        (["--lengths", "3"], "3", 3),
        (["--lengths", "2k,64", "--buckets", "100"], "64", 64),
    ):
        rc = eval_main(
            [
                "perplexity",
                "--hf",
                str(tmp_path),
                "--data",
                data,
                "--out",
                str(tmp_path / "o"),
                *flags,
            ]
        )
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1 and err.startswith("error: --buckets"), err
        assert f"length {short} of --lengths" in err and f"--buckets {fewest} or fewer" in err


def test_the_default_out_is_a_new_folder_each_run_and_reports_carry_the_strategy(
    tmp_path, capsys, monkeypatch
):
    records = [
        dict(length=128, depth_bin=b, correct=b == 0, prompt_tokens=120, padded_to=128)
        for b in (0, 1)
    ]
    result = dict(cells=[retrieval.cell(records, 128, b, 2) for b in (0, 1)], samples=records)
    model = SimpleNamespace(
        name="fake",
        mesh=SimpleNamespace(shape={"sp": 1}),
        attention=SimpleNamespace(layout="striped", strategy="ring"),
        config=SimpleNamespace(max_position_embeddings=256),
    )
    monkeypatch.setattr(line_retrieval, "load_model", lambda args: (model, None))
    monkeypatch.setattr(line_retrieval, "evaluate", lambda *a, **k: result)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hf").mkdir()
    written = []
    for _ in range(2):
        assert eval_main(["line-retrieval", "--hf", "hf", "--lengths", "128", "--depths", "2"]) == 0
        [line] = [x for x in capsys.readouterr().out.splitlines() if x.startswith("wrote ")]
        written.append(line.split()[1].rsplit("/", 1)[0])
    assert written[0] != written[1]  # the second run did not replace the first's report
    for folder in written:
        assert folder.startswith(os.path.join("runs", "line_retrieval_eval", "hf") + os.sep)
        saved = json.loads((tmp_path / folder / "line_retrieval.json").read_text())
        assert saved["strategy"] == "ring" and saved["trained_length"] == 256
        assert saved["samples_per_cell"] == 10


def test_heatmap_text_reads_on_its_cell_and_the_trained_length_is_a_line(tmp_path):
    cmap = matplotlib.colormaps["RdYlGn"]
    assert report.text_color(cmap(0.0)) == "white"  # dark red
    assert report.text_color(cmap(0.5)) == "black"  # yellow
    assert report.text_color(cmap(1.0)) == "white"  # dark green
    lengths = [256, 512, 1024, 2048]
    assert report.trained_line_x(lengths, 512) == 1.5  # right of the 512 column
    assert report.trained_line_x(lengths, 700) == 1.5
    assert report.trained_line_x(lengths, 128) == -0.5
    assert report.trained_line_x(lengths, None) is None
    records = [
        dict(length=n, depth_bin=0, correct=True, prompt_tokens=n, padded_to=n) for n in lengths
    ]
    cells = [retrieval.cell(records, n, 0, 1) for n in lengths]
    path = tmp_path / "h.png"
    report.accuracy_heatmap(str(path), cells, lengths, 1, "t", trained=512, samples=3)
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_matplotlibs_font_cache_line_is_not_printed_as_lclms(tmp_path):
    """A fresh matplotlib config folder makes it build its font cache, which it announces
    at INFO: lclm's log format would print it as if lclm had said it."""
    code = (
        "from lclm import logs; logs.configure(); from lclm.eval import report; "
        "plt = report.pyplot(); plt.subplots()"
    )
    env = dict(os.environ, MPLCONFIGDIR=str(tmp_path / "mpl"))
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert "fontManager" not in run.stderr and "font" not in run.stderr.lower()


def test_the_default_data_holds_documents_beyond_the_demos_length(tmp_path):
    """The default --data: held-out documents every machine with Python has, long enough to
    measure the demo model (trained at 512 tokens) at 512, 1k and 2k."""
    from lclm.data.sources import open_documents
    from lclm.data.tokenizer import Tokenizer

    args = perplexity.parse_args(["--hf", str(tmp_path)])
    assert args.data == perplexity.DEFAULT_DATA and args.data.startswith("code-heldout:")
    entry = perplexity.data_source("--data", args.data)
    docs = open_documents(entry.kind, entry.path, Tokenizer(DEMO_TOKENIZER))
    found = perplexity.windows(docs, [512, 1024, 2048], max_docs=4)
    assert all(len(w["tokens"]) == 4 for w in found.values())


def test_a_mesh_too_large_names_simulated_devices_not_the_machines(tmp_path):
    """On a CPU the devices are lclm's simulated ones (at most 16 whatever the cores): the
    message must not call their count the machine's."""
    import jax

    from lclm.eval.model import _mesh_sizes
    from lclm.parallel.devices import MAX_SIMULATED_DEVICES, available

    args = SimpleNamespace(dp=None, fsdp=None, tp=None, sp=64)
    with pytest.raises(StartupError) as e:
        _mesh_sizes({}, args, None)
    n = len(jax.devices())
    assert f"this machine has {n}" not in str(e.value)
    assert f"lclm simulates {n} CPU devices on this machine ({os.cpu_count()} cores" in str(e.value)
    cap = [SimpleNamespace(platform="cpu")] * MAX_SIMULATED_DEVICES
    assert f"at most {MAX_SIMULATED_DEVICES} are simulated" in available(cap)
    assert available([SimpleNamespace(platform="gpu")]) == "this machine has 1 gpu device"

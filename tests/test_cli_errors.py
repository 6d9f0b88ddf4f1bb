"""Every CLI turns bad input at start into one line `error: ...` and exit status 2 (no
traceback), found before any model is loaded or step is run; every config-driven CLI lists
the config fields in its --help and prints its resolved config with --print-config."""

import os
import subprocess
import sys

import pytest
from support import DEMO_CONFIG, DEMO_TOKENIZER, ROOT


def _assert_one_error_line(err: str, needle: str):
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert needle in err, err


@pytest.mark.parametrize(
    "args,needle",
    [
        (
            ["--config", DEMO_CONFIG, "--config.model.n_layer=3"],
            "error: unknown config key model.n_layer (did you mean model.n_layers?)",
        ),
        (
            ["--config", DEMO_CONFIG, "--config.train.steps=abc"],
            "error: flag --config.train.steps=abc: invalid literal for int()",
        ),
        (["--config", "nope.py"], "error: config file 'nope.py' not found"),
        (
            [
                "--config",
                os.path.join(ROOT, "configs", "demo_stages.py"),
                "--config.train.steps=10",
            ],
            "error: config.train.steps is set by every stage of stages.schedule; "
            "change the schedule",
        ),
        # Orbax matches checkpoint files with glob patterns: '[0]' would make them unreadable
        (
            ["--config", DEMO_CONFIG, "--config.workdir=/tmp/lclm runs/exp[0]"],
            "error: workdir='/tmp/lclm runs/exp[0]' contains '[' or ']'",
        ),
        (
            ["--config", DEMO_CONFIG, "--config.workdir=hdfs://bucket/runs/demo"],
            "error: workdir='hdfs://bucket/runs/demo' uses hdfs://, which lclm does not read or "
            "write",
        ),
        (
            ["--config", DEMO_CONFIG, "--config.checkpoint.allow_changed=data.batch_sise"],
            "error: unknown config key data.batch_sise (did you mean data.batch_size?)",
        ),
    ],
)
def test_train_cli(args, needle):
    env = dict(os.environ, JAX_PLATFORMS="cpu", WANDB_MODE="disabled")
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "train.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert r.returncode == 2
    _assert_one_error_line(r.stderr, needle)


@pytest.mark.parametrize(
    "text,needle",
    [
        ("def get_config(:\n", "line 1: invalid syntax"),
        ("x = 1\n", "defines no get_config()"),
        ("def get_config():\n    return 1 / 0\n", "line 2: ZeroDivisionError: division by zero"),
        ("import lclm_no_such_module\n", "line 1: ModuleNotFoundError: No module named"),
    ],
)
def test_a_broken_config_file_is_one_line(text, needle, tmp_path, capsys):
    from lclm.plan.__main__ import main

    path = tmp_path / "broken.py"
    path.write_text(text)
    assert main(["--config", str(path), "--devices", "8"]) == 2
    _assert_one_error_line(capsys.readouterr().err, f"config file {str(path)!r} {needle}")


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--config.data.seq_le=3"], "unknown config key data.seq_le (did you mean data.seq_len?)"),
        (["--config.train.steps=abc"], "flag --config.train.steps=abc: invalid literal for int()"),
        (["--config.model.dim=0"], "model.dim=0 must be >= 1"),
        (["--config.train.b2=1.0"], "train.b2=1.0 must be in [0, 1)"),
        (["--config", "nope.py"], "config file 'nope.py' not found"),
        (
            ["--device", "tpu-v4", "--config.attention.impl=pallas_gpu"],
            "attention.impl='pallas_gpu' cannot run here: it runs on GPUs",
        ),
        (
            ["--steps", "3"],
            "unrecognized argument '--steps'; see --help (config fields: --config.<key>=<value>)",
        ),
        (
            [
                "--config",
                os.path.join(ROOT, "configs", "demo_stages.py"),
                "--config.data.seq_len=256",
            ],
            "config.data.seq_len is set by every stage of stages.schedule; change the schedule "
            "(stages.schedule=...) instead",
        ),
    ],
)
def test_plan_cli(args, needle, capsys):
    from lclm.plan.__main__ import main

    assert main(["--config", DEMO_CONFIG, "--devices", "8", *args]) == 2
    _assert_one_error_line(capsys.readouterr().err, needle)


def test_bench_cli(tmp_path, capsys):
    from bench.__main__ import main

    afile = tmp_path / "afile"
    afile.write_text("")
    assert main(["--suite", "cpu", "--out", str(afile)]) == 2
    _assert_one_error_line(capsys.readouterr().err, f"--out {str(afile)!r}")
    assert main(["--suite", "cpu", "--parts", "attention,nope", "--out", str(tmp_path)]) == 2
    _assert_one_error_line(capsys.readouterr().err, "unknown parts ['nope']")


def test_prepare_cli(tmp_path, capsys):
    from lclm.data.prepare import main

    corpus = tmp_path / "in.jsonl"
    corpus.write_text('{"text": "hello world"}\n')
    afile = tmp_path / "afile"
    afile.write_text("")
    args = ["--source", "text", "--input", str(corpus)]
    assert main([*args, "--tokenizer", DEMO_TOKENIZER, "--out", str(afile)]) == 2
    _assert_one_error_line(capsys.readouterr().err, f"--out {str(afile)!r}")
    assert main([*args, "--tokenizer", str(corpus), "--out", str(tmp_path / "out")]) == 2
    _assert_one_error_line(capsys.readouterr().err, "is not a SentencePiece model")


def test_line_retrieval_eval_cli_checks_flags_before_loading(tmp_path, capsys):
    from lclm.eval.line_retrieval import main

    afile = tmp_path / "afile"
    afile.write_text("")
    missing = ["--hf", str(tmp_path / "no_model")]  # loading would fail: the flags fail first
    for args, needle in [
        (["--samples", "0"], "--samples=0 must be >= 1"),
        (["--depths", "-1"], "--depths=-1 must be >= 1"),
        (["--batch-size", "0"], "--batch-size=0 must be >= 1"),
        (["--out", str(afile)], f"--out {str(afile)!r} is a file"),
    ]:
        assert main([*missing, *args]) == 2
        _assert_one_error_line(capsys.readouterr().err, needle)


PREPARE = [
    "--source",
    "text",
    "--input",
    "{tmp}/no_corpus.jsonl",
    "--tokenizer",
    "{tmp}/no_tokenizer.model",
]
# bench writes local paths only; eval reads and writes gs:// and s3:// but no other scheme
OBJECT_STORE_OUT = (
    "is on object storage (gs://), which this command does not write; write to "
    "a local or mounted path and copy it"
)
UNKNOWN_SCHEME = (
    "uses hdfs://, which lclm does not read or write; use gs://, s3:// or a local or mounted path"
)


# Each input names nothing (a checkpoint, corpus or tokenizer that is not there): the path's
# own error comes first, so it was found before any loading or reading.
@pytest.mark.parametrize(
    "module,args,needle",
    [
        (
            "lclm.eval.line_retrieval",
            ["--checkpoint", "{tmp}/no_run", "--out", "hdfs://b/eval"],
            f"--out 'hdfs://b/eval' {UNKNOWN_SCHEME}",
        ),
        (
            "bench",
            ["--suite", "gpu", "--out", "gs://bucket/bench"],  # before the GPU probe too
            f"--out 'gs://bucket/bench' {OBJECT_STORE_OUT}",
        ),
        (
            "lclm.eval.line_retrieval",
            ["--checkpoint", "{tmp}/no_run", "--out", "{tmp}/afile/eval"],
            "--out '{tmp}/afile/eval' cannot be made: '{tmp}/afile' is a file",
        ),
        (
            "lclm.data.prepare",
            [*PREPARE, "--out", "{tmp}/afile/tok"],
            "--out '{tmp}/afile/tok' cannot be made: '{tmp}/afile' is a file",
        ),
        (
            "bench",
            ["--suite", "gpu", "--out", "{tmp}/afile/bench"],
            "--out '{tmp}/afile/bench' cannot be made: '{tmp}/afile' is a file",
        ),
        # the default output, a new folder beside the checkpoint, is checked too (and named as
        # the default)
        (
            "lclm.eval.line_retrieval",
            ["--checkpoint", "{tmp}/run"],
            "the default --out '{tmp}/run/line_retrieval_eval/",
        ),
        (
            "lclm.eval.line_retrieval",
            ["--checkpoint", "{tmp}/run"],
            "cannot be made: '{tmp}/run/line_retrieval_eval' is a file; pass another path",
        ),
        # an input on a scheme lclm does not read is not looked up as a local './hdfs:/...' path
        (
            "lclm.eval.line_retrieval",
            ["--checkpoint", "hdfs://b/run"],
            f"--checkpoint 'hdfs://b/run' {UNKNOWN_SCHEME}",
        ),
        (
            "lclm.eval.line_retrieval",
            ["--hf", "hdfs://b/hf", "--out", "{tmp}/eval"],
            f"--hf 'hdfs://b/hf' {UNKNOWN_SCHEME}",
        ),
        (
            "lclm.eval.line_retrieval",
            ["--hf", "{tmp}/no_hf", "--tokenizer", "hdfs://b/t.model", "--out", "{tmp}/eval"],
            f"--tokenizer 'hdfs://b/t.model' {UNKNOWN_SCHEME}",
        ),
    ],
)
def test_clis_check_their_paths_before_any_work(module, args, needle, tmp_path):
    (tmp_path / "afile").write_text("")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "line_retrieval_eval").write_text("")  # where the report would go
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)  # bench from any directory
    r = subprocess.run(
        [sys.executable, "-m", module, *(a.format(tmp=tmp_path) for a in args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 2, r.stderr
    _assert_one_error_line(r.stderr, needle.format(tmp=tmp_path))
    assert os.listdir(cwd) == []  # no './gs:/...' or './hdfs:/...' folder
    assert sorted(os.listdir(tmp_path)) == ["afile", "cwd", "run"]


# data.prepare reads and writes object stores (the local GCS server's): a bucket that is not
# there fails the output check, a missing object is its reader's one line
@pytest.mark.parametrize(
    "args,needle",
    [
        (
            [*PREPARE, "--out", "gs://lclm-no-such-bucket/tok"],
            "--out 'gs://lclm-no-such-bucket/tok' cannot be written (",
        ),
        (
            [
                "--source",
                "text",
                "--input",
                "{bucket}/c.jsonl",
                "--tokenizer",
                DEMO_TOKENIZER,
                "--out",
                "{tmp}/tok",
            ],
            "no data files at '{bucket}/c.jsonl'",
        ),
        (
            [
                "--source",
                "text",
                "--input",
                "{tmp}/no_corpus.jsonl",
                "--tokenizer",
                "{bucket}/t.model",
                "--out",
                "{tmp}/tok",
            ],
            "tokenizer '{bucket}/t.model' not found",
        ),
    ],
)
def test_prepare_checks_object_store_paths(args, needle, gcs, tmp_path):
    paths = dict(tmp=tmp_path, bucket=gcs.bucket())
    r = subprocess.run(
        [sys.executable, "-m", "lclm.data.prepare", *(a.format(**paths) for a in args)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert r.returncode == 2, r.stderr
    _assert_one_error_line(r.stderr, needle.format(**paths))
    assert os.listdir(tmp_path) == []  # nothing written before the error


def _fail_if_reached(monkeypatch, work: str) -> None:
    """`work` (a dotted name): what a CLI does first once its paths are checked (the
    measuring itself, or setting up the devices to measure on), made to fail if reached."""

    def work_started(*args, **kwargs):
        raise AssertionError(f"{work} was reached before the output was checked")

    monkeypatch.setattr(work, work_started)


@pytest.mark.parametrize(
    "module,args,work",
    [
        ("bench.attention", ["--out", "gs://bucket/b"], "bench.attention.run"),
        ("bench.striped_sim", ["--out", "gs://bucket/b"], "bench.striped_sim.run"),
        ("bench.correctness", ["--out", "gs://bucket/b"], "bench.correctness.run"),
        (
            "bench.max_context",
            ["--config", DEMO_CONFIG, "--out", "gs://bucket/b"],
            "bench.max_context.run",
        ),
        (
            "bench.strategies",
            ["--out", "gs://bucket/b"],
            "lclm.parallel.devices.request_cpu_devices",
        ),
        (
            "bench.checkpoint_save",
            ["--out", "gs://bucket/b.md"],
            "lclm.parallel.devices.request_cpu_devices",
        ),
        # --dir may be in a bucket (the bench measures saves there): a scheme lclm cannot write
        (
            "bench.checkpoint_save",
            ["--dir", "hdfs://bucket/checkpoints"],
            "lclm.parallel.devices.request_cpu_devices",
        ),
        (
            "bench.data_throughput",
            ["--out", "gs://bucket/b.md"],
            "lclm.parallel.devices.request_cpu_devices",
        ),
        (
            "bench.train_step",
            ["--config", DEMO_CONFIG, "--out", "gs://bucket/b.md"],
            "lclm.parallel.devices.request_cpu_devices",
        ),
    ],
)
def test_bench_part_clis_check_their_output_before_measuring(
    module, args, work, tmp_path, monkeypatch, capsys
):
    import importlib

    main = importlib.import_module(module).main
    _fail_if_reached(monkeypatch, work)
    monkeypatch.chdir(tmp_path)
    assert main(args) == 2
    flag = "--dir" if "--dir" in args else "--out"
    _assert_one_error_line(capsys.readouterr().err, f"{flag} {args[args.index(flag) + 1]!r}")
    assert os.listdir(tmp_path) == []  # no './gs:/...' folder


def test_a_bench_table_file_is_not_a_folder(tmp_path, monkeypatch, capsys):
    from bench.train_step import main

    _fail_if_reached(monkeypatch, "lclm.parallel.devices.request_cpu_devices")
    assert main(["--config", DEMO_CONFIG, "--out", str(tmp_path)]) == 2
    _assert_one_error_line(
        capsys.readouterr().err, f"--out {str(tmp_path)!r} is a folder; pass a file name"
    )


@pytest.mark.parametrize("module", ["bench.train_step", "bench.max_context"])
def test_bench_part_clis_reject_bad_overrides(module, capsys):
    import importlib

    main = importlib.import_module(module).main
    assert main(["--config", DEMO_CONFIG, "--config.data.seq_le=3"]) == 2
    _assert_one_error_line(capsys.readouterr().err, "unknown config key data.seq_le")
    assert main(["--config", DEMO_CONFIG, "--config.model.dim=abc"]) == 2
    _assert_one_error_line(capsys.readouterr().err, "flag --config.model.dim=abc: invalid literal")


def test_every_console_script_names_a_main_function():
    import importlib
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    assert set(scripts) == {
        "lclm-train",
        "lclm-plan",
        "lclm-convert",
        "lclm-prepare",
        "lclm-eval",
        "lclm-generate",
        "lclm-check",
        "lclm-extend",
    }
    for target in scripts.values():
        module, function = target.split(":")
        assert callable(getattr(importlib.import_module(module), function)), target


def test_generate_cli_checks_its_input_before_loading(tmp_path, capsys):
    from lclm.eval.generate import main

    missing = ["--hf", str(tmp_path / "no_model")]  # loading would fail: the flags fail first
    for args, needle in [
        (["--prompt", " "], "--prompt is empty"),
        (["--prompt", "a", "--max-new-tokens", "0"], "--max-new-tokens=0 must"),
        (["--prompt", "a", "--temperature", "-1"], "--temperature=-1.0 must"),
        (["--prompt", "a", "--top-p", "0"], "--top-p=0.0 must be in (0, 1]"),
        (["--prompt", "a", "--top-k", "5"], "pass --temperature > 0 to sample"),
    ]:
        assert main([*missing, *args]) == 2
        _assert_one_error_line(capsys.readouterr().err, needle)
    assert main(["--checkpoint", str(tmp_path), "--prompt", "a"]) == 2
    _assert_one_error_line(capsys.readouterr().err, f"no checkpoints in {str(tmp_path)!r}")


def _train(*args, cwd=ROOT):
    # no JAX backend can start: --help and --print-config must not start one
    env = dict(os.environ, JAX_PLATFORMS="none_may_start", WANDB_MODE="disabled")
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "train.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_train_help_lists_every_config_field_with_its_default_and_help():
    from lclm.config import base_config
    from lclm.config.loading import flat_items

    r = _train("--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Train a LLaMA, Qwen or Mistral model with striped ring attention.")
    for key, value in flat_items(base_config().to_dict()):
        assert f"\n  {key}={value!r}\n" in r.stdout
    # each field's help, then what it accepts, as the schema declares them
    assert (
        "  checkpoint.every=0\n      steps between saves; must be >= 0 (0: no saves by step "
        "count)\n" in r.stdout
    )
    assert "  model.remat='attention'\n" in r.stdout
    assert (
        "compiled step fits the device; one of auto, none, full, attention, offload, dots,\n"
        "      dots_no_batch\n" in r.stdout
    )
    assert "  # Staged context extension (lclm.config.stages: what a stage may set;" in r.stdout


def test_train_print_config_prints_the_resolved_config_without_secrets(tmp_path):
    config = tmp_path / "secret.py"
    config.write_text(f"""
import runpy
def get_config():
    c = runpy.run_path({DEMO_CONFIG!r})["get_config"]()
    c.log.wandb_api_key = "SECRET_VALUE"
    return c
""")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    r = _train(
        "--config",
        str(config),
        "--print-config",
        "--config.train.steps=7",
        f"--config.workdir={cwd / 'run'}",
        cwd=cwd,
    )
    assert r.returncode == 0 and r.stderr == "", r.stderr
    lines = r.stdout.splitlines()
    assert "train.steps=7" in lines and "data.seq_len=512" in lines  # override, config file
    assert f"workdir={str(cwd / 'run')!r}" in lines
    assert "SECRET_VALUE" not in r.stdout and "wandb_api_key" not in r.stdout
    assert os.listdir(cwd) == []  # nothing written, no workdir made
    r = _train("--print-config", "--config.train.step=7")
    assert r.returncode == 2
    _assert_one_error_line(r.stderr, "unknown config key train.step")


@pytest.mark.parametrize("module", ["lclm.plan.__main__", "bench.train_step", "bench.max_context"])
def test_config_driven_clis_print_the_config_and_list_its_fields(module, capsys):
    import importlib

    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as done:
        main(["--config", DEMO_CONFIG, "--config.mesh.sp=4", "--print-config"])
    assert done.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert "mesh.sp=4" in lines and "data.seq_len=512" in lines
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "  --print-config" in out and "\n  model.dim=64\n" in out

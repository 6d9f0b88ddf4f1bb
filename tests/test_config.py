"""Config validation: each mistake is one clear line; shipped configs are valid."""

import dataclasses
import math
import os
import re
import subprocess
import sys

import pytest
from support import DEMO_CONFIG, DEMO_TOKENIZER, ROOT

from lclm.config import AttentionConfig, ModelConfig, base_config, load_config
from lclm.config.fields import from_saved
from lclm.config.model import LAYOUTS
from lclm.config.run_config import run_config
from lclm.config.schema import MESH_AXES, Run, Train
from lclm.data.loader import SourceEntry, parse_sources
from lclm.errors import ConfigError
from lclm.ops import layout
from lclm.train.startup_checks import check_data, checked, validate


def _load(name):
    return load_config(os.path.join(ROOT, "configs", name))


def test_layout_names_are_one_list():
    assert layout.LAYOUTS is LAYOUTS


@pytest.mark.parametrize(
    "name,devices,sizes",
    [
        ("demo.py", 8, dict(dp=1, fsdp=2, tp=1, sp=4)),
        ("llama7b_256k.py", 32, dict(dp=1, fsdp=4, tp=1, sp=8)),
        ("llama13b_512k.py", 32, dict(dp=1, fsdp=1, tp=1, sp=32)),
        ("llama1b.py", 1, dict(dp=1, fsdp=1, tp=1, sp=1)),
        ("llama3b.py", 4, dict(dp=1, fsdp=1, tp=1, sp=4)),
        ("qwen3_8b_256k.py", 32, dict(dp=1, fsdp=4, tp=1, sp=8)),
        ("mistral_nemo_12b_256k.py", 32, dict(dp=1, fsdp=4, tp=1, sp=8)),
    ],
)
def test_shipped_configs_validate(name, devices, sizes):
    assert validate(_load(name), devices) == sizes


@pytest.mark.parametrize(
    "name,devices,seq_lens,batches,sps",
    [
        ("llama7b_256k.py", 32, [32768, 131072, 262144], [32, 8, 4], [4, 8, 8]),
        ("llama13b_512k.py", 32, [32768, 131072, 262144, 524288], [64, 16, 8, 4], [4, 8, 16, 32]),
        ("demo_stages.py", 8, [128, 256, 512], [32, 16, 8], [2, 4, 4]),
        ("qwen25_7b_256k.py", 32, [65536, 262144], [16, 4], [4, 8]),
    ],
)
def test_staged_recipes_hold_tokens_per_step_and_validate(name, devices, seq_lens, batches, sps):
    from lclm.config.stages import stage_configs
    from lclm.train.stages import validate_stages

    config = _load(name)
    validate_stages(config, devices)
    stages = stage_configs(config)
    assert [c.data.seq_len for c in stages] == seq_lens
    assert [c.data.batch_size for c in stages] == batches
    assert [c.mesh.sp for c in stages] == sps
    assert len({c.data.seq_len * c.data.batch_size for c in stages}) == 1
    thetas = [c.model.rope_theta for c in stages]
    assert thetas == sorted(thetas)  # theta never falls as the context grows
    assert [c.model.init_from_checkpoint for c in stages[1:]] == [c.workdir for c in stages[:-1]]


def test_stages_after_the_first_fine_tune_at_extend_lr():
    from lclm.config.stages import stage_configs

    config = _load("demo_stages.py")
    config.train.lr, config.stages.extend_lr = 3e-3, 1e-3
    assert [c.train.lr for c in stage_configs(config)] == [3e-3, 1e-3, 1e-3]
    config.stages.extend_lr = 0.0  # unset: every stage at train.lr
    assert [c.train.lr for c in stage_configs(config)] == [3e-3] * 3
    config.stages.extend_lr = -1.0
    with pytest.raises(ConfigError, match=r"stages.extend_lr=-1.0 must be a finite number >= 0"):
        validate(config, 8)


@pytest.mark.parametrize(
    "schedule,needle",
    [
        ("32k:1e6", "is not seq_len:rope_theta:steps[:sp]"),
        ("32k:1e6:-3", "needs positive values"),
        ("1000:1e6:3", "tokens_per_batch=4096 is not a multiple of stage 0's seq_len=1000"),
    ],
)
def test_bad_stage_schedules_fail_at_start(schedule, needle):
    from lclm.train.stages import validate_stages

    config = _load("demo_stages.py")
    config.stages.schedule = schedule
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        validate_stages(config, 8)


@pytest.mark.parametrize(
    "change,devices,needle",
    [
        (lambda c: c.data.update(seq_len=1000), 8, "data.seq_len=1000 is not divisible by mesh.sp"),
        (lambda c: c.mesh.update(tp=3, sp=1, fsdp=1), 8, "not divisible by mesh.tp=3"),
        (lambda c: c.mesh.update(sp=16, fit=False), 8, "needs 32 devices but only 8 exist"),
        (lambda c: c.mesh.update(sp=-1, fsdp=-1), 8, "at most one -1"),
        (lambda c: c.attention.update(q_chunk=48), 8, "attention.q_chunk"),
        (lambda c: c.attention.update(layout="ring"), 8, "attention.layout='ring'"),
        (
            lambda c: (c.attention.update(layout="zigzag"), c.data.update(seq_len=4 * 129)),
            8,
            "not divisible by 2 x mesh.sp = 8, as attention.layout='zigzag' needs",
        ),
        (
            lambda c: (
                c.attention.update(layout="zigzag", q_chunk=32),
                c.data.update(seq_len=4 * 96),
            ),
            8,
            "divisible by 2 x mesh.sp x attention.q_chunk = 8 x 32",
        ),
        (
            lambda c: c.attention.update(impl="cudnn"),
            8,
            "attention.impl='cudnn'; use one of ('auto', 'blockwise'",
        ),
        (
            lambda c: (
                c.attention.update(impl="pallas_gpu"),
                c.model.update(dim=96, n_heads=2, n_kv_heads=2),
            ),
            8,
            "cannot serve this model: its head dim 48 must be a power of two",
        ),
        (lambda c: c.data.update(batch_size=3), 8, "not divisible by mesh.dp x mesh.fsdp"),
        (lambda c: c.model.update(dtype="fp16"), 8, "model.dtype='fp16'"),
        (lambda c: c.data.update(source="csv"), 8, "data.source='csv'"),
        (lambda c: c.data.update(chat_template="chatml"), 8, "data.chat_template='chatml'"),
        (lambda c: c.attention.update(strategy="mesh"), 8, "attention.strategy='mesh'; use one of"),
        (
            lambda c: c.attention.update(strategy="usp", ulysses=3),
            8,
            "attention.ulysses=3 does not divide mesh.sp=4",
        ),
        (
            lambda c: (c.attention.update(strategy="usp", ulysses=8), c.mesh.update(sp=8, fsdp=1)),
            8,
            "over mesh.tp x attention.ulysses = 8: not divisible; use a smaller attention.ulysses",
        ),
        (lambda c: c.attention.update(ulysses=2), 8, "attention.ulysses=2 is usp's Ulysses degree"),
        (
            lambda c: (
                c.attention.update(strategy="usp", ulysses=2, layout="zigzag", q_chunk=32),
                c.data.update(seq_len=4 * 48),
            ),
            8,
            "divisible by 2 x mesh.sp / attention.ulysses x attention.q_chunk = 4 x 32",
        ),
        (
            lambda c: (c.attention.update(strategy="ulysses"), c.mesh.update(sp=8, fsdp=1)),
            8,
            "splits the model.n_heads=4 query heads over mesh.tp x mesh.sp = 8: not divisible",
        ),
        (
            lambda c: c.attention.update(strategy="ulysses", q_chunk=48),
            8,
            "data.seq_len=512 is not divisible by attention.q_chunk=48",
        ),
        (
            lambda c: c.validation.update(path="", at_start=True),
            8,
            "validation.at_start=True measures the held-out loss before the first step, but "
            "validation.path is empty",
        ),
    ],
)
def test_bad_configs_fail_with_one_line(change, devices, needle):
    c = _load("demo.py")
    change(c)
    with pytest.raises(ConfigError) as e:
        validate(c, devices)
    assert needle in str(e.value) and "\n" not in str(e.value)


# zero and negative sizes divided by too early gave a ZeroDivisionError; others went unnoticed
@pytest.mark.parametrize(
    "key,value,needle",
    [
        *[
            (key, 0, f"{key}=0 must be >= 1")
            for key in (
                "data.seq_len",
                "data.batch_size",
                "train.grad_accum",
                "model.n_heads",
                "model.n_kv_heads",
                "model.dim",
                "model.n_layers",
                "model.ffn_dim",
                "model.vocab_size",
                "attention.q_chunk",
                "attention.kv_chunk",
                "model.ffn_chunk",
                "model.loss_chunk",
                "train.max_bad_steps",
                "checkpoint.keep",
            )
        ],
        ("data.seq_len", -512, "data.seq_len=-512 must be >= 1"),
        ("mesh.sp", 0, "config.mesh: mesh {'dp': 1, 'fsdp': 2, 'tp': 1, 'sp': 0}: sizes must be"),
        ("mesh.fsdp", -2, "config.mesh: mesh {'dp': 1, 'fsdp': -2, 'tp': 1, 'sp': 4}: sizes must"),
        ("checkpoint.every", -1, "checkpoint.every=-1 must be >= 0"),
        ("train.warmup", -1, "train.warmup=-1 must be >= 0"),
        ("train.lr", float("nan"), "train.lr=nan must be a finite number > 0"),
        ("train.lr", float("inf"), "train.lr=inf must be a finite number > 0"),
        ("train.lr", 0.0, "train.lr=0.0 must be a finite number > 0"),
        ("train.clip", float("nan"), "train.clip=nan must be a finite number >= 0"),
        ("train.clip", -1.0, "train.clip=-1.0 must be a finite number >= 0"),
        ("train.b1", 1.0, "train.b1=1.0 must be in [0, 1)"),
        ("train.b2", float("nan"), "train.b2=nan must be in [0, 1)"),
        ("train.b2", -0.1, "train.b2=-0.1 must be in [0, 1)"),
        ("train.weight_decay", float("inf"), "train.weight_decay=inf must be a finite number >= 0"),
        ("train.min_lr_ratio", 1.5, "train.min_lr_ratio=1.5 must be in [0, 1]"),
        ("train.min_lr_ratio", float("nan"), "train.min_lr_ratio=nan must be in [0, 1]"),
    ],
)
def test_out_of_range_values_fail_before_any_division(key, value, needle):
    c = _load("demo.py")
    section, field = key.split(".")
    c[section][field] = value
    with pytest.raises(ConfigError) as e:
        validate(c, 8)
    assert str(e.value).startswith(needle) and "\n" not in str(e.value)


def test_max_bad_steps_defaults_to_three():
    assert base_config().train.max_bad_steps == 3


def test_workdir_that_cannot_hold_a_run_fails_at_start(tmp_path):
    c = _load("demo.py")
    afile = tmp_path / "afile"
    afile.write_text("")
    for workdir, needle in [
        (str(afile), "is not a directory"),
        (str(afile / "run"), f"{str(afile)!r} is not a directory"),
        ("", "workdir is empty"),
    ]:
        c.workdir = workdir
        with pytest.raises(ConfigError, match=needle):
            validate(c, 8)
    if os.path.isdir("/sys"):  # sysfs refuses new files even to root
        c.workdir = "/sys/lclm_run"
        with pytest.raises(ConfigError, match="cannot write in '/sys'"):
            validate(c, 8)
    c.workdir = str(tmp_path / "new" / "run")
    validate(c, 8)
    assert os.listdir(tmp_path) == ["afile"]  # the probe leaves nothing behind


def test_tokenizer_larger_than_the_model_is_a_config_error(tmp_path):
    from lclm.data.tokenizer import Tokenizer

    tok = Tokenizer(DEMO_TOKENIZER)
    with pytest.raises(ConfigError, match="set model.vocab_size >= 512"):
        tok.check_fits(256)
    (tmp_path / "bad.model").write_text("not a model")
    with pytest.raises(ConfigError, match="is not a SentencePiece model"):
        Tokenizer(str(tmp_path / "bad.model"))


def _train_cli(*args, timeout=120):
    env = dict(os.environ, JAX_PLATFORMS="cpu", WANDB_MODE="disabled")
    env.pop("XLA_FLAGS", None)
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "train.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_cli_rejects_bad_mesh(tmp_path):
    r = _train_cli(
        "--config",
        "configs/demo.py",
        "--config.mesh.sp=64",
        "--config.mesh.fit=false",
        f"--config.workdir={tmp_path}",
    )
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("error: config.mesh:")
    assert "needs 128 devices" in r.stderr


def test_base_config_is_locked_against_typos():
    c = base_config()
    c.lock()
    with pytest.raises(AttributeError):
        c.train.stpes = 3


def test_load_config_applies_overrides_and_rejects_unknown_keys():
    c = load_config(DEMO_CONFIG, {"mesh.sp": 2, "train.lr": 0.5})
    assert c.mesh.sp == 2 and c.train.lr == 0.5
    demo = DEMO_CONFIG
    for overrides, message in [
        ({"train.lrr": 1}, "unknown config key train.lrr (did you mean train.lr?)"),
        ({"modle.dim": 1}, "unknown config key modle.dim (did you mean model.dim?)"),
        (
            {"model.dim.x": 1},
            "unknown config key model.dim.x (model.dim is a value, not a section)",
        ),
        ({"train.steps": "abc"}, "config key train.steps='abc': expected type int"),
    ]:
        with pytest.raises(ConfigError) as e:
            load_config(demo, overrides)
        assert str(e.value) == message
    with pytest.raises(ConfigError, match="config file 'nope.py' not found"):
        load_config("nope.py")


def test_config_from_argv_reads_overrides_and_makes_each_mistake_one_line():
    from lclm.cli import config_from_argv

    demo = DEMO_CONFIG
    c = config_from_argv(
        [
            "train.py",
            "--config",
            demo,
            "--config.train.steps=7",
            "--config.model.remat",
            "dots",
            "--noconfig.log.progress",
        ],
        "unused",
    )
    assert (c.train.steps, c.model.remat, c.log.progress) == (7, "dots", False)
    assert (
        config_from_argv(["train.py", f"--config={demo}"], "unused").train.steps
        == _load("demo.py").train.steps
    )
    for argv, message in [
        (
            ["--config.model.n_layer=3"],
            "unknown config key model.n_layer (did you mean model.n_layers?)",
        ),
        (["--config.train.steps=abc"], "flag --config.train.steps=abc: invalid literal"),
        (
            ["--steps=3"],
            "Unknown command line flag 'steps'; set config fields with --config.<key>=<value>",
        ),
        (["extra"], "unexpected arguments ['extra']"),
    ]:
        with pytest.raises(ConfigError) as e:
            config_from_argv(["train.py", "--config", demo, *argv], "unused")
        assert str(e.value).startswith(message) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="config file 'nope.py' not found"):
        config_from_argv(["train.py"], "nope.py")


def _staged_argv(*overrides, config="demo_stages.py"):
    return ["train.py", "--config", os.path.join(ROOT, "configs", config), *overrides]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["--config.data.seq_len=256"],
            "config.data.seq_len is set by every stage of "
            "stages.schedule; change the schedule (stages.schedule=...) instead",
        ),
        (
            ["--config.model.rope_theta", "1e6"],
            "config.model.rope_theta is set by every stage of "
            "stages.schedule; change the schedule (stages.schedule=...) instead",
        ),
        (
            ["--config.train.steps=10"],
            "config.train.steps is set by every stage of "
            "stages.schedule; change the schedule (stages.schedule=...) instead",
        ),
        (
            ["--config.mesh.sp=2"],
            "config.mesh.sp is set by stages 0, 1, 2 of stages.schedule "
            "(seq_len:rope_theta:steps:sp); change the schedule (stages.schedule=...) instead",
        ),
        (
            ["--config.data.batch_size=4"],
            "config.data.batch_size is set by every stage of "
            "stages.schedule (stages.tokens_per_batch // seq_len); change stages.tokens_per_batch "
            "instead",
        ),
        # a schedule given on the command line wins over the other overrides just the same
        (
            ["--config.stages.schedule=64:1e4:3, 128:1e5:3", "--config.data.seq_len=64"],
            "config.data.seq_len is set by every stage of stages.schedule; change the schedule",
        ),
        (
            ["--config.data.seq_len=64", "--config.stages.schedule=64:1e4:3"],
            "config.data.seq_len is set by every stage of stages.schedule; change the schedule",
        ),
    ],
)
def test_overrides_that_a_stage_replaces_are_refused_in_one_line(overrides, message):
    from lclm.cli import config_from_argv

    with pytest.raises(ConfigError) as e:
        config_from_argv(_staged_argv(*overrides), "unused")
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_overrides_that_no_stage_replaces_are_applied():
    from lclm.cli import config_from_argv

    c = config_from_argv(
        _staged_argv(
            "--config.train.lr=0.5",
            "--config.train.warmup=3",
            "--config.mesh.fsdp=2",
            "--config.model.n_layers=1",
            "--config.stages.tokens_per_batch=8192",
        ),
        "unused",
    )
    assert (c.train.lr, c.train.warmup, c.mesh.fsdp, c.model.n_layers) == (0.5, 3, 2, 1)
    assert c.stages.tokens_per_batch == 8192
    # without sp in the schedule, or tokens_per_batch, a stage leaves mesh.sp / batch_size alone
    c = config_from_argv(
        _staged_argv(
            "--config.stages.schedule=64:1e4:3, 128:1e5:3",
            "--config.stages.tokens_per_batch=0",
            "--config.mesh.sp=2",
            "--config.data.batch_size=4",
        ),
        "unused",
    )
    assert (c.mesh.sp, c.data.batch_size) == (2, 4)
    # no schedule left: nothing is replaced (and the stages' batch size is not left set)
    c = config_from_argv(
        _staged_argv(
            "--config.stages.schedule=",
            "--config.data.seq_len=64",
            "--config.stages.tokens_per_batch=0",
        ),
        "unused",
    )
    assert (c.stages.schedule, c.data.seq_len) == ("", 64)
    # the same fields of an unstaged config, and of a staged one where no stage runs
    assert (
        config_from_argv(
            _staged_argv("--config.data.seq_len=64", config="demo.py"), "unused"
        ).data.seq_len
        == 64
    )
    assert (
        config_from_argv(
            _staged_argv("--config.data.seq_len=64"), "unused", runs_stages=False
        ).data.seq_len
        == 64
    )


def test_parse_cli_splits_the_clis_own_arguments_from_the_config():
    import argparse

    from lclm.cli import parse_cli

    demo = DEMO_CONFIG
    ap = argparse.ArgumentParser(prog="prog")
    ap.add_argument("--devices", type=int, default=0)
    args, c = parse_cli(
        ap,
        [
            "--config.train.steps=7",
            "--devices",
            "8",
            "--config",
            demo,
            "--config.model.remat",
            "dots",
            "--noconfig.log.progress",
        ],
    )
    assert (args.devices, args.config) == (8, demo)
    assert (c.train.steps, c.model.remat, c.log.progress) == (7, "dots", False)
    assert args.overrides == [
        "--config.train.steps=7",
        "--config.model.remat",
        "dots",
        "--noconfig.log.progress",
    ]
    for argv, message in [
        (["--config", demo, "--steps", "3"], "unrecognized argument '--steps'"),
        (
            ["--config", demo, "--config.train.stps=3"],
            "unknown config key train.stps (did you mean train.steps?)",
        ),
        (["--config", demo, "stray"], "unexpected arguments ['stray']"),
    ]:
        ap = argparse.ArgumentParser(prog="prog")
        with pytest.raises(ConfigError) as e:
            parse_cli(ap, argv)
        assert str(e.value).startswith(message) and "\n" not in str(e.value)
    ap = argparse.ArgumentParser(prog="prog")
    assert parse_cli(ap, [], default=demo)[0].config == demo


def test_every_config_key_is_in_the_docs_key_list():
    """docs/training.md's "Config keys" names every field of the config (a newcomer's list)."""
    with open(os.path.join(ROOT, "docs", "training.md")) as f:
        text = f.read().split("## Config keys", 1)[1].split("\n## ", 1)[0]
    model = text.split("- `model.*`", 1)[1].split("\n- ", 1)[0]
    missing = []
    for section, fields in base_config().items():
        if not hasattr(fields, "items"):
            if f"`{section}`" not in text:
                missing.append(section)
            continue
        for name in fields:
            key = f"{section}.{name}"
            grouped = re.search(rf"`{section}\.\{{[^}}]*\b{name}\b", text)
            if (
                f"`{key}`" not in text
                and not grouped
                and not (section == "model" and re.search(rf"\b{name}\b", model))
            ):
                missing.append(key)
    assert missing == []


def test_missing_data_is_found_at_start_under_the_key_that_names_it(tmp_path):
    c = _load("demo.py")
    check_data(c)  # the shipped demo names its corpus, chats and held-out file
    c.validation.path = str(tmp_path / "held_out.jsonl")
    with pytest.raises(ConfigError, match=r"^config\.validation\.path: no data at .*held_out"):
        check_data(c)
    c.validation.path = ""
    c.data.path = f"{tmp_path}/a.jsonl@0.5,{tmp_path}/b.jsonl"
    with pytest.raises(ConfigError, match=r"config\.data\.path: no data at .*a\.jsonl'.*'\\,'"):
        check_data(c)


def test_a_comma_in_a_file_name_can_be_part_of_a_mixture(tmp_path):
    (tmp_path / "a,b.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "c.jsonl").write_text('{"text": "y"}\n')
    c = _load("demo.py")
    c.data.path = f"{tmp_path}/a\\,b.jsonl@0.25,{tmp_path}/c.jsonl"
    assert parse_sources(c.data.path, "text") == [
        SourceEntry("text", f"{tmp_path}/a,b.jsonl", 0.25),
        SourceEntry("text", f"{tmp_path}/c.jsonl", 1.0),
    ]
    check_data(c)


def test_train_cli_reports_missing_validation_data_before_the_model(tmp_path):
    r = _train_cli(
        "--config",
        "configs/demo.py",
        f"--config.workdir={tmp_path / 'run'}",
        f"--config.validation.path={tmp_path / 'nothing.jsonl'}",
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"error: config.validation.path: no data at {str(tmp_path / 'nothing.jsonl')!r}; point "
        "it at a .jsonl/.json/.txt/.parquet/.arrow file, a directory or a glob"
    ]
    assert not (tmp_path / "run").exists()


def test_a_saved_config_section_keeps_the_fields_its_dataclass_declares():
    # a checkpoint saved by another lclm version: a key this one lacks is dropped, a field the
    # saved dict lacks takes its default (convert and eval read saved configs through it)
    saved = {**dataclasses.asdict(ModelConfig(n_layers=3)), "a_field_of_another_version": 1}
    del saved["rope_theta"]
    assert from_saved(ModelConfig, saved) == ModelConfig(n_layers=3)
    assert from_saved(AttentionConfig, {"strategy": "all_gather", "gone": 0}) == AttentionConfig(
        strategy="all_gather"
    )


def test_the_typed_sections_of_a_config_hold_its_values_with_references_resolved():
    # the tiny line-retrieval config's data.path and validation.path follow data.seq_len
    # through FieldReferences: the typed tree holds the values they resolve to
    config = _load("tiny_line_retrieval.py")
    config.data.seq_len = 128
    sections = run_config(config)
    assert sections.to_dict() == config.to_dict()
    assert isinstance(sections.train, Train) and isinstance(sections.attention, AttentionConfig)
    assert sections.workdir == config.workdir == "runs/tiny_line_retrieval"
    for f in dataclasses.fields(Run):  # the top-level fields read as the tree's own
        assert getattr(sections, f.name) == getattr(sections.run, f.name) == config[f.name]
    # the one call programs that run a step start from: checked, typed, the mesh resolved
    resolved, typed, mesh = checked(config, 8)
    assert typed == sections and mesh == validate(config, 8)
    assert resolved.to_dict() == config.to_dict()  # this mesh needs no fitting on 8
    assert "tokens=128" in sections.data.path and "tokens=64;pad_to=128" in sections.data.path
    with pytest.raises(dataclasses.FrozenInstanceError):
        sections.train.lr = 1.0  # type: ignore[misc]


def test_a_fitted_mesh_is_in_the_checked_config_and_not_written_into_the_callers():
    """mesh.fit shrinks a mesh to the devices there are: the checked config (what the run's
    config.json holds) names the mesh it runs on; the caller's config is left as it was."""
    config = load_config(DEMO_CONFIG)
    asked = {axis: config.mesh[axis] for axis in MESH_AXES}
    resolved, sections, mesh = checked(config, 2)
    assert math.prod(mesh.values()) <= 2 < math.prod(max(v, 1) for v in asked.values())
    assert {axis: resolved.mesh[axis] for axis in MESH_AXES} == mesh
    assert {axis: getattr(sections.mesh, axis) for axis in MESH_AXES} == mesh
    assert {axis: config.mesh[axis] for axis in MESH_AXES} == asked
    # an axis of -1 takes whatever devices the machine that reads config.json has: kept
    config.mesh.update(dp=1, fsdp=1, tp=1, sp=-1)
    resolved, _, mesh = checked(config, 4)
    assert mesh["sp"] == 4 and resolved.mesh.sp == -1

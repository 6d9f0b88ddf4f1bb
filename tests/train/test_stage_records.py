"""Stages as records (`stages.list`): each field a stage sets takes effect at that stage and
is kept by the stages after it, never before; a stage's optimizer is carried or fresh as it
says; a staged run stopped in the middle of a stage or at a boundary resumes to the losses of
the run that was never stopped."""

import json
import os

import jax
import numpy as np
import pytest
from support import ROOT, small_train_config

from lclm.cli import config_from_argv, config_text
from lclm.config import ModelConfig, load_config
from lclm.config.run_config import run_config
from lclm.config.stages import keys_set_by_stages, stage_configs
from lclm.errors import ConfigError
from lclm.parallel import make_mesh
from lclm.train import program as train_program
from lclm.train.stages import run_stages, validate_stages
from lclm.train.step import applied_updates, make_optimizer
from lclm.workdir.checkpoint import Checkpoints, saved_config
from lclm.workdir.state import init_state

DEMO = os.path.join(ROOT, "data", "demo")


def _stages():
    """Three stages, each changing what a recipe changes between its stages."""
    return [
        dict(
            name="short",
            data=dict(seq_len=64),
            train=dict(steps=3, lr=3e-3, warmup=1),
            mesh=dict(sp=2),
            model=dict(remat="attention"),
        ),
        dict(
            name="long",
            tokens=3 * 512,
            tokens_per_batch=512,
            data=dict(
                seq_len="128",
                document_mask=False,
                path=f"{DEMO}/corpus.jsonl@0.5,sharegpt:{DEMO}/sharegpt.jsonl@0.5",
            ),
            model=dict(rope_theta=1e5, remat="full"),
            mesh=dict(sp=4),
            attention=dict(strategy="all_gather"),
            train=dict(lr=1e-3, decay="linear"),
        ),
        dict(
            name="fresh",
            optimizer="fresh",
            train=dict(steps=2, decay="constant", warmup=0),
            attention=dict(strategy="ulysses"),
            model=dict(rope_scaling="linear", rope_factor=2.0),
        ),
    ]


def _config(workdir):
    c = small_train_config(
        workdir, mesh=dict(dp=1, fsdp=2, tp=1, sp=2), attention=dict(q_chunk=16, kv_chunk=16)
    )
    c.model.update(n_heads=4, n_kv_heads=4)  # Ulysses splits the heads over sp=4
    c.stages.list = _stages()
    c.checkpoint.every = 1
    return c


def test_each_field_takes_effect_at_its_stage_and_is_kept_after_it(tmp_path):
    c = _config(tmp_path / "run")
    s0, s1, s2 = stage_configs(c)
    assert [s.data.seq_len for s in (s0, s1, s2)] == [64, 128, 128]
    assert [s.data.batch_size for s in (s0, s1, s2)] == [4, 4, 4]  # 512 tokens / 128
    assert [s.train.steps for s in (s0, s1, s2)] == [3, 3, 2]  # tokens=1536 -> 3 steps
    assert [s.mesh.sp for s in (s0, s1, s2)] == [2, 4, 4]
    assert [s.model.rope_theta for s in (s0, s1, s2)] == [c.model.rope_theta, 1e5, 1e5]
    assert [s.model.rope_scaling for s in (s0, s1, s2)] == [c.model.rope_scaling] * 2 + ["linear"]
    assert [s.data.document_mask for s in (s0, s1, s2)] == [True, False, False]
    assert [s.attention.strategy for s in (s0, s1, s2)] == ["ring", "all_gather", "ulysses"]
    assert [s.model.remat for s in (s0, s1, s2)] == ["attention", "full", "full"]
    assert [s.train.lr for s in (s0, s1, s2)] == [3e-3, 1e-3, 1e-3]
    assert [s.train.decay for s in (s0, s1, s2)] == ["cosine", "linear", "constant"]
    assert [s.train.warmup for s in (s0, s1, s2)] == [1, 1, 0]
    assert s0.data.path == c.data.path and s1.data.path == s2.data.path != c.data.path
    assert [s.train.optimizer_from_checkpoint for s in (s0, s1, s2)] == [False, True, False]
    assert [s.model.init_from_checkpoint for s in (s1, s2)] == [s0.workdir, s1.workdir]
    assert all(s.stages.list == () and s.stages.schedule == "" for s in (s0, s1, s2))
    # what a command-line override would lose is named, with the stage that sets it
    assert keys_set_by_stages(c)["attention.strategy"].startswith(
        "set by stages 1, 2 of stages.list"
    )


@pytest.mark.parametrize(
    "stage,needle",
    [
        (dict(model=dict(dim=128)), r"stages.list\[0\] sets model.dim, which no stage may change"),
        (dict(model=dict(init_from_hf="/x")), "sets model.init_from_hf, which no stage"),
        (
            dict(data=dict(seq_lenn=64)),
            r"unknown config key data.seq_lenn \(did you mean "
            r"data.seq_len\?\)",
        ),
        (dict(tokens=512, train=dict(steps=3)), "sets both tokens and train.steps"),
        (dict(optimizer="fresh"), "the first stage has no predecessor"),
        (dict(data=dict(seq_len="64q")), r"data.seq_len='64q' is not a token count"),
        (dict(train=dict(lr="fast")), r"stage 0: train.lr='fast': expected type float"),
        ("64k:1e6:3", r"stages.list\[0\] is str, not a dict"),
        (
            dict(train=dict(steps=3, warmup=3)),
            r"stage 0 sets train.warmup=3, not below its 3 "
            "steps: its learning rate would never reach train.lr",
        ),
    ],
)
def test_a_bad_stage_fails_at_start_in_one_line(tmp_path, stage, needle):
    c = _config(tmp_path / "run")
    c.stages.list = [stage]
    with pytest.raises(ConfigError, match=needle) as e:
        stage_configs(c)
    assert "\n" not in str(e.value)
    c.stages.update(list=_stages(), schedule="64:1e4:3")
    with pytest.raises(ConfigError, match="stages.list and config.stages.schedule are both"):
        stage_configs(c)


def test_a_warm_up_a_stage_inherits_is_clamped_to_its_steps(tmp_path):
    c = _config(tmp_path / "run")
    c.train.warmup = 5
    c.stages.list = [dict(train=dict(steps=3)), dict(train=dict(steps=10))]
    assert [s.train.warmup for s in stage_configs(c)] == [2, 5]


def test_stage_settings_without_stages_are_refused(tmp_path):
    """An empty stages.list is no stages: a stage setting left beside it would be ignored."""
    c = _config(tmp_path / "run")
    c.stages.update(list=[], tokens_per_batch=4096)
    with pytest.raises(
        ConfigError,
        match=r"stages.tokens_per_batch=4096 is set but the run has "
        r"no stages .*set stages.tokens_per_batch=0 for a",
    ):
        stage_configs(c)
    c.stages.update(tokens_per_batch=0, optimizer="fresh")
    with pytest.raises(ConfigError, match="stages.optimizer='fresh' is set but the run has no"):
        stage_configs(c)
    c.stages.optimizer = "carry"
    assert stage_configs(c) == []
    # a stage's own config is a single run: the stage settings were applied to it
    staged = _config(tmp_path / "run")
    staged.stages.tokens_per_batch = 512
    assert all(stage_configs(s) == [] for s in stage_configs(staged))


def test_print_config_shows_each_stages_resolved_values(tmp_path):
    text = config_text(_config(tmp_path / "run"))
    assert "# stage 1 (long)" in text
    assert "stages[1].data.seq_len=128" in text and "stages[0].data.seq_len" not in text
    assert "stages[2].train.decay='constant'" in text
    assert "stages[2].train.optimizer_from_checkpoint" not in text  # fresh, as the config
    assert "stages[1].train.optimizer_from_checkpoint=True" in text


def test_print_config_refuses_a_stage_the_run_would_refuse(tmp_path, capsys):
    """Issue 76 item 5: a stage at 100 tokens over sp=2 with 16-token chunks. The run stops
    at start on it (validate_stages), and --print-config now refuses it in the same words,
    exit 2, on a machine of any size (its devices: what the mesh asks for)."""
    path = tmp_path / "staged.py"
    demo = os.path.join(ROOT, "configs", "demo.py")
    path.write_text(
        "from lclm.config import load_config\n"
        f"def get_config():\n    c = load_config({demo!r})\n"
        "    c.mesh.update(dp=1, fsdp=1, tp=1, sp=2, fit=False)\n"
        "    c.attention.update(q_chunk=16, kv_chunk=16)\n"
        "    c.stages.list = [dict(data=dict(seq_len=100), train=dict(steps=2))]\n"
        "    return c\n"
    )
    argv = ["train.py", "--config", str(path), f"--config.workdir={tmp_path / 'run'}"]
    assert train_program.main([*argv, "--print-config"]) == 2
    printed = capsys.readouterr()
    assert printed.out == ""
    with pytest.raises(ConfigError) as started:
        validate_stages(config_from_argv(argv, ""), 2)
    assert printed.err == f"error: {started.value}\n"
    assert str(started.value).startswith(
        "stage 0 (seq_len 100): data.seq_len=100 is not divisible by mesh.sp x "
        "attention.q_chunk = 2 x 16"
    )
    assert not (tmp_path / "run").exists()
    # a config the run takes is printed as before
    assert train_program.main([argv[0], "--config", demo, "--print-config"]) == 0
    assert "stages" not in capsys.readouterr().err


def test_a_command_line_override_of_a_field_a_stage_sets_is_refused(tmp_path):
    path = tmp_path / "staged.py"
    demo = os.path.join(ROOT, "configs", "demo.py")
    path.write_text(
        "from lclm.config import load_config\n"
        f"def get_config():\n    c = load_config({demo!r})\n"
        "    c.stages.list = [dict(data=dict(seq_len=64), train=dict(steps=2)),\n"
        "                     dict(train=dict(lr=1e-4))]\n    return c\n"
    )
    with pytest.raises(ConfigError, match="config.train.lr is set by stage 1 of stages.list"):
        config_from_argv(["train.py", "--config", str(path), "--config.train.lr=0.1"], "")
    c = config_from_argv(["train.py", "--config", str(path), "--config.train.b2=0.9"], "")
    assert [s.train.b2 for s in stage_configs(c)] == [0.9, 0.9]


def _state(config):
    """(step, Adam's count, the schedule's count) of a stage's latest checkpoint."""
    model = ModelConfig.from_config(config.model)
    optimizer = make_optimizer(run_config(config).train)
    template = init_state(model, optimizer, make_mesh(), seed=0)
    checkpoints = Checkpoints(config.workdir, keep=1)
    state, _ = checkpoints.restore(template)
    checkpoints.close()
    (adam,) = [
        x
        for x in jax.tree.leaves(state.opt_state, is_leaf=lambda x: hasattr(x, "nu"))
        if hasattr(x, "nu")
    ]
    return int(state.step), int(adam.count), int(applied_updates(state.opt_state))


@pytest.mark.slow
def test_a_staged_run_of_records_trains_each_stage_as_set_and_resumes(tmp_path):
    straight = _config(tmp_path / "straight")
    runs = run_stages(straight)
    s0, s1, s2 = stage_configs(straight)
    # the learning rate of each stage follows its own schedule
    lrs = [[r["lr"] for r in records] for records in runs]
    np.testing.assert_allclose(lrs[1], [1e-3, 1e-3 - (1e-3 - 1e-4) / 2, 1e-4], rtol=1e-5)
    np.testing.assert_allclose(lrs[2], [1e-3, 1e-3], rtol=1e-6)
    # stage 1 carried stage 0's optimizer (Adam's count goes on, the schedule's restarted);
    # stage 2 started a fresh one
    assert _state(s0) == (3, 3, 3)
    assert _state(s1) == (3, 6, 3)
    assert _state(s2) == (2, 2, 2)
    # each stage ran with its own config (as saved with its checkpoints)
    saved = [saved_config(s.workdir)[1] for s in (s0, s1, s2)]
    assert [x["data"]["document_mask"] for x in saved] == [True, False, False]
    assert [x["attention"]["strategy"] for x in saved] == ["ring", "all_gather", "ulysses"]
    assert [x["model"]["rope_scaling"] for x in saved] == ["auto", "auto", "linear"]
    # and trained on its own mixture, as the statistics written at its start say
    mixtures = []
    for s in (s0, s1, s2):
        with open(os.path.join(s.workdir, "data_statistics.json")) as f:
            mixtures.append([(x["kind"], x["weight"]) for x in json.load(f)["sources"]])
    assert mixtures == [
        [("text", 0.8), ("sharegpt", 0.2)],
        [("text", 0.5), ("sharegpt", 0.5)],
        [("text", 0.5), ("sharegpt", 0.5)],
    ]

    resumed = _config(tmp_path / "resumed")
    first = run_stages(resumed, stop_after=4)  # stage 0, then 1 step of stage 1
    second = run_stages(resumed, stop_after=6)  # to stage 1's end: the boundary
    third = run_stages(resumed)
    steps = [[r["step"] for r in records] for records in first + second + third]
    assert steps == [[1, 2, 3], [1], [2, 3], [1, 2]]
    losses = [r["loss"] for records in first + second + third for r in records]
    np.testing.assert_allclose(losses, [r["loss"] for records in runs for r in records], rtol=1e-4)
    assert _state(stage_configs(resumed)[1]) == (3, 6, 3)


def test_the_one_line_schedule_is_read_into_the_same_records():
    c = load_config(os.path.join(ROOT, "configs", "demo_stages.py"))
    c.stages.extend_lr = 1e-3
    stages = stage_configs(c)
    assert [
        (s.data.seq_len, s.model.rope_theta, s.train.steps, s.mesh.sp, s.train.lr) for s in stages
    ] == [(128, 1e4, 20, 2, 3e-3), (256, 1e5, 15, 4, 1e-3), (512, 1e6, 15, 4, 1e-3)]
    c.stages.schedule = "128:1e4:20:2, 256:1e5:15"  # a stage without sp: the config's
    assert [s.mesh.sp for s in stage_configs(c)] == [2, c.mesh.sp]


def _recipe(name):
    return load_config(os.path.join(ROOT, "configs", f"{name}.py"))


def test_prolong_recipe_states_prolongs_numbers():
    """configs/prolong_llama3_8b_512k.py against princeton-nlp/ProLong's train_64K.sh and
    train_512K.sh: lengths, theta, lr, steps, tokens per step, warm-up (10%), the optimizer
    carried, and each stage's token shares (code / books / short)."""
    from lclm.data.loader import parse_sources
    from lclm.train.stages import validate_stages

    c = _recipe("prolong_llama3_8b_512k")
    s64, s512 = validate_stages(c, 64)
    assert [
        (s.data.seq_len, s.model.rope_theta, s.train.lr, s.train.steps, s.train.warmup)
        for s in (s64, s512)
    ] == [(65536, 8e6, 1e-5, 5000, 500), (524288, 1.28e8, 5e-6, 2500, 250)]
    assert [s.data.batch_size * s.data.seq_len for s in (s64, s512)] == [4 << 20, 8 << 20]
    assert (s512.train.optimizer_from_checkpoint, s512.model.init_from_checkpoint) == (
        True,
        s64.workdir,
    )
    assert all(
        (
            s.train.b2,
            s.train.weight_decay,
            s.train.min_lr_ratio,
            s.model.loss_chunk,
            s.data.document_mask,
            s.data.mixture_unit,
        )
        == (0.95, 0.1, 0.1, 2048, True, "tokens")
        for s in (s64, s512)
    )

    def shares(stage):
        found: dict[str, float] = {}
        for entry in parse_sources(stage.data.path, stage.data.source):
            name = os.path.basename(entry.path)
            kind = (
                "code"
                if name.startswith("thestack")
                else "books"
                if name.startswith("book")
                else "short"
            )
            found[kind] = round(found.get(kind, 0) + entry.weight, 6)
        return found

    assert shares(s64) == {"code": 0.3, "books": 0.3, "short": 0.4}
    assert shares(s512) == {"code": 0.3, "books": 0.3, "short": 0.4}


def test_fu_and_ultralong_recipes_state_their_numbers():
    from lclm.data.loader import parse_sources
    from lclm.train.startup_checks import validate

    fu = _recipe("fu_llama2_7b_80k")
    validate(fu, 32)
    entries = parse_sources(fu.data.path, fu.data.source)
    assert len(entries) == 7 and abs(sum(e.weight for e in entries) - 1) < 1e-6
    assert all((e.options.short_below, e.options.short_keep) == (4096, 0.1) for e in entries)
    assert fu.data.seq_len == 80 * 1024 and fu.data.mixture_unit == "tokens"
    ultra = _recipe("ultralong_llama31_8b_1m")
    validate(ultra, 64)
    m = ultra.model
    assert (
        m.rope_scaling,
        m.rope_factor,
        m.rope_beta_slow,
        m.rope_beta_fast,
        m.rope_original_max_positions,
    ) == ("yarn", 128.0, 1.0, 4.0, 8192)
    assert ultra.data.seq_len == 8192 * 128 and not ultra.data.document_mask
    assert ultra.train.steps * ultra.data.batch_size * ultra.data.seq_len >= 10**9
    (entry,) = parse_sources(ultra.data.path, ultra.data.source)
    assert entry.options.long_repeat > 1


@pytest.mark.slow
def test_a_failed_gate_stops_before_the_next_stage_and_is_evaluated_again(tmp_path):
    from lclm.errors import TrainingHalted

    c = _config(tmp_path / "gated")
    c.validation.update(path=f"{DEMO}/heldout.jsonl", lengths="stages", every=100, batches=1)
    c.stages.list = [
        dict(
            data=dict(seq_len=64),
            train=dict(steps=2, lr=1e-12, warmup=0),
            mesh=dict(sp=2),
            gate=dict(short_loss=0.02),
        ),  # unchanged weights: the short loss holds
        dict(
            data=dict(seq_len=128),
            train=dict(steps=2, lr=3.0, warmup=0),  # wrecks it
            gate=dict(short_loss=0.02),
        ),
        dict(train=dict(steps=1)),
    ]
    with pytest.raises(
        TrainingHalted,
        match=r"stage 1 gate: val_loss@64 .* FAILED; the next "
        "stage did not start",
    ):
        run_stages(c)
    s0, s1, s2 = stage_configs(c)
    with open(os.path.join(s0.workdir, "gate.json")) as f:
        assert json.load(f)["passed"] is True
    assert not os.path.exists(s2.workdir)
    with pytest.raises(TrainingHalted):  # the same command evaluates it again
        run_stages(c)
    c.stages.list[1]["gate"] = dict(short_loss=0.02, on_fail="warn")
    assert [len(r) for r in run_stages(c)] == [1]  # warned, and stage 2 trained
    with open(os.path.join(s1.workdir, "gate.json")) as f:
        verdict = json.load(f)
    assert verdict["passed"] is False and verdict["end"] > 1.02 * verdict["start"]


def test_gates_are_checked_at_start(tmp_path):
    c = _config(tmp_path / "run")
    c.stages.list = [dict(data=dict(seq_len=64), train=dict(steps=2), gate=dict(short_loss=0.02))]
    with pytest.raises(ConfigError, match="gate compares held-out losses; set validation.path"):
        stage_configs(c)
    for gate, needle in (
        (dict(short_los=0.1), "gate key 'short_los' is unknown"),
        (dict(on_fail="warn"), "the gate names nothing to reach"),
        (dict(short_loss=0.1, on_fail="halt"), "on_fail='halt'"),
        (dict(short_loss=float("nan")), "short_loss=nan must be a finite number >= 0"),
    ):
        c.stages.list = [dict(train=dict(steps=2), gate=gate)]
        with pytest.raises(ConfigError, match=needle):
            stage_configs(c)


def _ruler_gated(workdir, ruler_gate: dict, on_fail: str = "stop"):
    c = _config(workdir)
    c.stages.list = [
        dict(
            data=dict(seq_len=64),
            train=dict(steps=1, warmup=0),
            mesh=dict(sp=2),
            gate=dict(ruler=ruler_gate, on_fail=on_fail),
        ),
        dict(data=dict(seq_len=128), train=dict(steps=1)),
    ]
    return c


@pytest.mark.slow
def test_a_ruler_gate_scores_the_stage_as_the_eval_command_does_and_stops_below_its_score(tmp_path):
    from lclm.errors import TrainingHalted
    from lclm.eval.__main__ import main as eval_main
    from lclm.eval.ruler import gate_argv

    # a single needle at 512 tokens, past the stage's 64: an untrained model scores ~0
    spec = dict(min_score=50, tasks="niah_single_1", samples=2, length=512)
    c = _ruler_gated(tmp_path / "gated", spec)
    with pytest.raises(
        TrainingHalted,
        match=r"stage 0 gate: RULER niah_single_1 at 512 "
        r"tokens \d+\.\d \(min 50, 2 prompts each\): FAILED; the next stage "
        "did not start",
    ):
        run_stages(c)
    s0, s1 = stage_configs(c)
    assert not os.path.exists(s1.workdir)
    with open(os.path.join(s0.workdir, "gate.json")) as f:
        verdict = json.load(f)
    assert verdict["passed"] is False and verdict["ruler"]["length"] == 512
    with open(os.path.join(s0.workdir, "ruler_gate", "ruler.json")) as f:
        gate_report = json.load(f)
    # the same flags on the command line give the same prompts, answers and scores
    argv = gate_argv(s0.workdir, dict(verdict["ruler"]))
    argv[argv.index("--out") + 1] = str(tmp_path / "cli")
    assert eval_main(["ruler", *argv]) == 0
    with open(tmp_path / "cli" / "ruler.json") as f:
        cli_report = json.load(f)
    assert cli_report["samples"] == gate_report["samples"]
    assert cli_report["average"] == gate_report["average"] == {"512": verdict["ruler"]["average"]}
    # a warning gate lets the next stage train; a reachable score passes
    c.stages.list[0]["gate"] = dict(ruler=spec, on_fail="warn")
    assert [len(r) for r in run_stages(c)] == [1]
    c = _ruler_gated(tmp_path / "passing", dict(spec, min_score=0))
    run_stages(c)
    with open(os.path.join(stage_configs(c)[0].workdir, "gate.json")) as f:
        assert json.load(f)["passed"] is True


def test_ruler_gates_are_checked_at_start(tmp_path):
    for spec, needle in (
        (dict(tasks="vt"), "is not a dict such as dict\\(min_score=80"),
        (dict(min_score=150), "must be a percentage"),
        (dict(min_score=50, sample=3), "gate ruler key 'sample' is unknown"),
        (dict(min_score=50, chat="chatml"), "use None"),
    ):
        with pytest.raises(ConfigError, match=needle):
            stage_configs(_ruler_gated(tmp_path / "run", spec))
    for spec, needle in (
        (dict(min_score=50, tasks="vt,qa_1"), "RULER task 'qa_1' is unknown"),
        (
            dict(min_score=50, tasks="niah_single_1", length=64),
            "a niah_single_1 prompt does not fit in 64 tokens",
        ),
    ):
        with pytest.raises(ConfigError, match=needle):
            run_stages(_ruler_gated(tmp_path / "run", spec))
    assert not os.path.exists(tmp_path / "run")  # nothing trained

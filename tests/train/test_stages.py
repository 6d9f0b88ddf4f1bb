"""The staged long-context recipe at CPU scale: HF weights -> stage 0 -> stage 1 -> stage 2,
each stage from its predecessor's final weights, resumable in the middle of any stage."""

import logging
import os
import signal

import jax
import numpy as np
import pytest
from support import ROOT, damage_checkpoint

from lclm import hf
from lclm.config import ModelConfig, load_config
from lclm.config.run_config import run_config
from lclm.config.stages import stage_configs
from lclm.errors import ConfigError
from lclm.models.decoder import init_params
from lclm.parallel import make_mesh
from lclm.train.first_weights import SourceDamaged, take_model_fields
from lclm.train.loop import train
from lclm.train.stages import run_stages
from lclm.train.step import make_optimizer
from lclm.workdir.checkpoint import Checkpoints
from lclm.workdir.state import init_state

pytestmark = pytest.mark.slow  # trains models or starts processes: left out by -m 'not slow'


def _recipe(tmp_path, name, hf_dir, lr=3e-3, schedule="64:1e4:3:2, 128:1e5:3:4, 256:1e6:3:4"):
    """configs/demo_stages.py, shortened: stages of 3 steps, 64 -> 128 -> 256 tokens."""
    c = load_config(os.path.join(ROOT, "configs", "demo_stages.py"))
    c.workdir = str(tmp_path / name)
    c.model.update(
        dim=32,
        n_heads=2,
        n_kv_heads=1,
        ffn_dim=64,
        ffn_chunk=32,
        loss_chunk=32,
        init_from_hf=hf_dir,
    )
    c.attention.update(q_chunk=16, kv_chunk=16)
    c.stages.update(schedule=schedule, tokens_per_batch=1024)
    c.train.update(lr=lr, warmup=1, b2=0.99)
    c.log.update(every=1, progress=False)
    c.checkpoint.every = 1
    return c


def _tiny_hf(tmp_path):
    """A HuggingFace LLaMA directory written by lclm's exporter (no download)."""
    model = ModelConfig(
        vocab_size=512, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64, dtype="float32"
    )
    params = init_params(model, jax.random.key(42))
    path = str(tmp_path / "hf")
    hf.save(path, model, params)
    return path, params


def _final_params(config):
    """Final parameters of the last stage, restored on one device (its model's fields taken
    from its source of weights, as its run took them)."""
    last = take_model_fields(stage_configs(config)[-1])
    model = ModelConfig.from_config(last.model)
    template = init_state(model, make_optimizer(run_config(last).train), make_mesh(), seed=0)
    checkpoints = Checkpoints(last.workdir, keep=1)
    state, _ = checkpoints.restore(template)
    checkpoints.close()
    return int(state.step), jax.device_get(state.params)


def _leaves_close(a, b, tol):
    return all(
        np.allclose(x, y, atol=tol, rtol=0) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def test_stages_chain_from_hf_weights(tmp_path):
    """With a learning rate of ~0 every stage must end where the HF weights began: a stage
    that started from fresh random weights (not its predecessor's) would be far off."""
    hf_dir, hf_params = _tiny_hf(tmp_path)
    config = _recipe(tmp_path, "still", hf_dir, lr=1e-12)
    runs = run_stages(config)
    assert len(runs) == 3 and all(len(r) == 3 for r in runs)
    step, params = _final_params(config)
    assert step == 3
    assert _leaves_close(params, jax.device_get(hf_params), 1e-6)


def test_interrupted_staged_run_resumes_to_the_same_weights(tmp_path, caplog):
    """Stopped at a stage boundary with the finished stage's final checkpoint damaged, then
    in the middle of a stage: the resumed run ends with the uninterrupted run's weights."""
    hf_dir, _ = _tiny_hf(tmp_path)
    schedule = "64:1e4:3:2, 128:1e5:3:4"
    straight = _recipe(tmp_path, "straight", hf_dir, schedule=schedule)
    losses = [[r["loss"] for r in records] for records in run_stages(straight)]

    resumed = _recipe(tmp_path, "resumed", hf_dir, schedule=schedule)
    assert [len(r) for r in run_stages(resumed, stop_after=3)] == [3]  # stage 0 finished
    stage0, stage1 = (c.workdir for c in stage_configs(resumed))
    damage_checkpoint(os.path.join(stage0, "checkpoints", "3"), "truncated chunks")
    with caplog.at_level(logging.WARNING):
        first = run_stages(resumed, stop_after=4)
    # stage 1 found it unreadable: stage 0 re-ran its step 3 from step 2, then 1 step of stage 1
    assert [[r["step"] for r in records] for records in first] == [[3], [1]]
    assert "stage 0's final checkpoint is damaged" in caplog.text
    (aside,) = os.listdir(os.path.join(stage0, "checkpoints_damaged"))
    assert aside.startswith("3-")
    second = run_stages(resumed)  # stage 0 is skipped, stage 1 resumes at its step 2
    assert [len(r) for r in second] == [2]
    assert second[0][0]["step"] == 2
    np.testing.assert_allclose(losses[0][2], first[0][0]["loss"], rtol=1e-5)
    np.testing.assert_allclose(losses[1], [x["loss"] for x in first[1] + second[0]], rtol=1e-4)
    assert _leaves_close(_final_params(straight)[1], _final_params(resumed)[1], 1e-5)

    # another run's damaged checkpoint is not this run's to move: one line, nothing moved
    damage_checkpoint(os.path.join(stage1, "checkpoints", "3"), "truncated chunks")
    user = _recipe(tmp_path, "user", hf_dir, schedule="")
    user.model.update(init_from_hf="", init_from_checkpoint=stage1)
    user.data.update(seq_len=64, batch_size=2)
    with pytest.raises(SourceDamaged) as e:
        train(user)
    assert str(e.value).startswith(
        f"model.init_from_checkpoint={stage1!r}: its latest checkpoint (step 3) cannot be read ("
    )
    assert "\n" not in str(e.value)
    assert not os.path.exists(os.path.join(stage1, "checkpoints_damaged"))


class _SignalAt(logging.Handler):
    """Sends this process `signum` when a record starting with `text` is logged: a signal
    that lands at that moment of the run."""

    def __init__(self, text: str, signum: int):
        super().__init__()
        self.text, self.signum, self.sent = text, signum, 0

    def emit(self, record: logging.LogRecord) -> None:
        if not self.sent and record.getMessage().startswith(self.text):
            self.sent += 1
            os.kill(os.getpid(), self.signum)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_a_stages_summary_stops_the_run_there(tmp_path, caplog, signum):
    """Issue 76 item 4: a termination signal after a stage's last step was checked, during
    its summary, once started no later stage; the run stops there (its final checkpoint
    saved), the handlers are put back, and the same command resumes with stage 1."""
    hf_dir, _ = _tiny_hf(tmp_path)
    config = _recipe(tmp_path, "run", hf_dir, schedule="64:1e4:2:2, 128:1e5:2:4")
    before = signal.getsignal(signum)
    summary = _SignalAt("trained steps", signum)
    logging.getLogger("lclm.train.hooks").addHandler(summary)
    try:
        with caplog.at_level(logging.WARNING), caplog.at_level(logging.INFO, "lclm.train.hooks"):
            runs = run_stages(config)
    finally:
        logging.getLogger("lclm.train.hooks").removeHandler(summary)
    assert summary.sent == 1
    assert [len(r) for r in runs] == [2]
    assert "stopped before stage 1 on a termination signal" in caplog.text
    stage0, stage1 = (c.workdir for c in stage_configs(config))
    assert max(map(int, os.listdir(os.path.join(stage0, "checkpoints")))) == 2
    assert not os.path.exists(stage1)
    assert signal.getsignal(signum) is before
    assert [len(r) for r in run_stages(config)] == [2]  # resumed: stage 1 only


def test_a_staged_run_refuses_a_workdir_that_holds_a_single_runs_checkpoints(tmp_path):
    hf_dir, _ = _tiny_hf(tmp_path)
    c = _recipe(tmp_path, "run", hf_dir)
    single = Checkpoints(c.workdir, keep=1)  # a plain run's (or a conversion's) step
    model = ModelConfig.from_config(stage_configs(c)[0].model)
    state = init_state(model, make_optimizer(run_config(c).train), make_mesh(), seed=0)
    single.save(0, state, None, {})
    single.close()
    with pytest.raises(
        ConfigError,
        match=r"holds the checkpoints of a single run or a "
        r"conversion \(step 0\).*model\.init_from_checkpoint=",
    ):
        run_stages(c)
    assert sorted(os.listdir(c.workdir)) == ["checkpoints"]  # no stage written beside it

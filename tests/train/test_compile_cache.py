"""The persistent compilation cache on by default (issue 77 item 3): a run that starts again
with the same config (a requeued job, a restart after a crash) loads its step from the cache
instead of compiling it again. (A run with other steps or learning rates compiles its own:
the schedule is part of the program.)"""

import json
import os
import stat
import subprocess
import sys

import pytest
from support import ROOT, TINY_DEMO_ARGS

pytestmark = pytest.mark.slow  # starts processes


def _train(workdir, cache, steps):
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        WANDB_MODE="disabled",
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
    )
    env.pop("JAX_COMPILATION_CACHE_DIR")  # the test session's: the config's default decides
    done = subprocess.run(
        [
            sys.executable,
            "train.py",
            *TINY_DEMO_ARGS,
            f"--config.train.steps={steps}",
            f"--config.workdir={workdir}",
            f"--config.compile_cache={cache}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with open(workdir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_a_run_started_again_loads_its_step_from_the_cache(tmp_path):
    cache = tmp_path / "cache"
    first = _train(tmp_path / "first", cache, steps=2)
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700  # the programs it holds are run
    steps = {e for e in os.listdir(cache) if e.startswith("jit_step-")}
    assert steps
    again = _train(tmp_path / "again", cache, steps=2)
    # the step is not compiled again (smaller programs may be: JAX caches those whose compile
    # took longer than its threshold, which a busy machine may cross the second time only)
    assert {e for e in os.listdir(cache) if e.startswith("jit_step-")} == steps
    compiled, loaded = first[0]["compile_time"], again[0]["compile_time"]
    assert loaded < 0.7 * compiled, (compiled, loaded)

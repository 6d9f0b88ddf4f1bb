"""JAX's platforms as every CLI chooses them (lclm.platforms, called by lclm.cli.run_cli):
where libtpu is installed (the [test] extra) and no TPU is attached, JAX must not start
libtpu's TPU runtime, which prints its complaints about the missing TPU before every command
and takes a machine-wide lock; an explicit JAX_PLATFORMS is the user's and is kept. Importing
lclm chooses nothing.

The subprocesses run without what conftest.py sets for the test session (JAX_PLATFORMS=cpu,
ALLOW_MULTIPLE_LIBTPU_LOAD, the simulated devices' XLA_FLAGS): they see what a user's shell
would."""

import importlib.util
import json
import os
import subprocess
import sys
import tomllib

import pytest
from support import DEMO_CONFIG, ROOT

from lclm import platforms

HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None
# what libtpu prints when it starts its TPU runtime on a machine without a TPU
LIBTPU_NOISE = (
    "host bounds",
    "TPU_WORKER_HOSTNAMES",
    "TPU_ACCELERATOR_TYPE",
    "libtpu",
    "InitGoogle",
)

libtpu_without_a_tpu = pytest.mark.skipif(
    not HAVE_LIBTPU or platforms.tpu_attached() or platforms._other_accelerator(),
    reason="needs libtpu installed on a machine with no TPU, GPU or other JAX plugin (where "
    "there is one, lclm leaves the platforms to JAX)",
)


def user_env(**extra):
    """The environment of a user's shell: none of the test session's JAX settings."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("JAX_PLATFORMS", "ALLOW_MULTIPLE_LIBTPU_LOAD", "XLA_FLAGS", "NPROC")
        and not k.startswith("TPU_")
    }
    return env | extra


def _python(*args, env=None):
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env or user_env(),
        timeout=300,
    )


def _noise(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if any(n in line for n in LIBTPU_NOISE)]


@libtpu_without_a_tpu
def test_a_cli_that_starts_jax_prints_nothing_of_libtpu(tmp_path):
    """train.py counts the devices (JAX starts its backends) and then refuses a mesh of 64:
    its one error line is all of stderr."""
    done = _python(
        "train.py",
        "--config",
        DEMO_CONFIG,
        "--config.mesh.sp=32",
        "--config.mesh.fit=false",
        f"--config.workdir={tmp_path}",
    )
    assert done.returncode == 2, done.stderr
    assert _noise(done.stderr) == []
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: config.mesh:"), lines


CHOOSE = "from lclm.platforms import keep_jax_off_an_absent_tpu; keep_jax_off_an_absent_tpu(); "


@libtpu_without_a_tpu
def test_jax_imported_before_the_choice_is_kept_off_libtpu_too():
    """As in train.py, whose modules import JAX before run_cli chooses: the child processes
    (bench's parts) inherit the choice."""
    done = _python(
        "-c",
        "import os, jax; " + CHOOSE + "print(jax.config.jax_platforms, "
        "os.environ['JAX_PLATFORMS'], jax.devices())",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "cpu cpu [CpuDevice(id=0)]"
    assert _noise(done.stderr) == []


@libtpu_without_a_tpu
@pytest.mark.parametrize("explicit", ["", "cpu", "tpu,cpu"])
def test_an_explicit_jax_platforms_is_kept(explicit):
    """Even an empty one: JAX's own search, asked for by name."""
    show = "import os; " + CHOOSE + "print(repr(os.environ['JAX_PLATFORMS']))"
    done = _python("-c", show, env=user_env(JAX_PLATFORMS=explicit))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == repr(explicit)


@libtpu_without_a_tpu
def test_unset_jax_platforms_becomes_the_cpu():
    done = _python("-c", "import os; " + CHOOSE + "print(os.environ.get('JAX_PLATFORMS'))")
    assert done.stdout.strip() == "cpu"


# Every CLI, called with input that fails inside its run_cli (after the choice, before any
# model): the console scripts (lclm-generate is also `python -m lclm.generate`; train.py calls
# lclm-train's main) and the benchmarks' launcher.
def _cli_args(tmp: str) -> dict[str, list[str]]:
    missing = os.path.join(tmp, "missing")
    return {
        "lclm.train.program:main": ["train.py", "--config", missing],
        "lclm.plan.__main__:main": ["--config", missing, "--devices", "8"],
        "lclm.convert:main": ["--from-hf", missing, "--to-checkpoint", missing],
        "lclm.data.prepare:main": [
            "--source",
            "text",
            "--input",
            DEMO_CONFIG,
            "--tokenizer",
            DEMO_CONFIG,
            "--out",
            missing,
        ],
        "lclm.eval.__main__:main": ["passkey", "--hf", missing, "--samples", "0"],
        "lclm.eval.generate:main": ["--hf", missing, "--prompt", " "],
        "lclm.check.__main__:main": ["--config", missing],
        "lclm.extend.__main__:main": ["--config", missing],
        "lclm.generate:main": ["--hf", missing, "--prompt", " "],
        "bench.__main__:main": ["--suite", "cpu", "--out", DEMO_CONFIG],
    }


# In one process, as a user's shell starts it: JAX_PLATFORMS (the variable and JAX's config)
# and whether JAX's backends have started after importing every CLI, then JAX_PLATFORMS after
# each CLI's main (cleared between).
_RUN_CLIS = """
import importlib, json, os, sys
clis = json.loads(sys.argv[1])
mains = {t: getattr(importlib.import_module(t.split(":")[0]), t.split(":")[1]) for t in clis}
import jax
from jax._src import xla_bridge
imported = [os.environ.get("JAX_PLATFORMS"), jax.config.jax_platforms,
            xla_bridge.backends_are_initialized()]
chosen = {}
for target, argv in clis.items():
    os.environ.pop("JAX_PLATFORMS", None)
    jax.config.update("jax_platforms", None)
    try:
        status = mains[target](argv)
    except SystemExit as e:
        status = f"exit {e.code}"
    chosen[target] = [os.environ.get("JAX_PLATFORMS"), status]
print(json.dumps({"imported": imported, "chosen": chosen}))
"""


@pytest.fixture(scope="module")
def clis_run(tmp_path_factory):
    clis = _cli_args(str(tmp_path_factory.mktemp("clis")))
    done = _python("-c", _RUN_CLIS, json.dumps(clis))
    assert done.returncode == 0, done.stderr[-3000:]
    return clis, json.loads(done.stdout.strip().splitlines()[-1])


def test_every_console_script_is_among_the_clis_checked():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        scripts = set(tomllib.load(f)["project"]["scripts"].values())
    assert scripts <= set(_cli_args("/tmp"))


def test_importing_lclm_and_its_clis_chooses_nothing_and_starts_no_backend(clis_run):
    """The CLIs' choice at run_cli is in time: no module starts JAX's backends on import."""
    assert clis_run[1]["imported"] == [None, None, False]


@libtpu_without_a_tpu
def test_every_cli_chooses_the_platforms(clis_run):
    clis, run = clis_run
    assert set(run["chosen"]) == set(clis)
    # each stopped at its bad input (status 2) after choosing
    assert {t: r for t, r in run["chosen"].items() if r != ["cpu", 2]} == {}


@pytest.fixture
def choose(monkeypatch):
    """The choice made again, as a CLI makes it before JAX: returns JAX_PLATFORMS after it
    (None: left to JAX)."""
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.delenv("JAX_FORCE_TPU_INIT", raising=False)
    monkeypatch.setenv("TPU_LIBRARY_PATH", "/opt/libtpu/libtpu.so")  # libtpu, as JAX finds it
    monkeypatch.delitem(sys.modules, "jax")
    monkeypatch.setattr(platforms, "tpu_attached", lambda: False)
    monkeypatch.setattr(platforms, "_other_accelerator", lambda: False)

    def run():
        platforms.keep_jax_off_an_absent_tpu()
        return os.environ.get("JAX_PLATFORMS")

    return run


def test_only_the_cpu_left_is_chosen(choose):
    assert choose() == "cpu"


@pytest.mark.parametrize("why", ["a TPU", "a GPU or plugin", "no libtpu", "forced TPU init"])
def test_the_choice_is_left_to_jax(choose, monkeypatch, why):
    if why == "a TPU":
        monkeypatch.setattr(platforms, "tpu_attached", lambda: True)
    elif why == "a GPU or plugin":
        monkeypatch.setattr(platforms, "_other_accelerator", lambda: True)
    elif why == "no libtpu":  # JAX's TPU attempt is then silent and lock-free
        monkeypatch.delenv("TPU_LIBRARY_PATH")
        monkeypatch.setitem(sys.modules, "libtpu", None)  # not importable
    else:
        monkeypatch.setenv("JAX_FORCE_TPU_INIT", "1")
    assert choose() is None


def test_a_cuda_plugin_without_a_gpu_gets_the_cpu_too(choose, monkeypatch):
    # the [gpu-aot] extra on a machine without a GPU: no cuInit failure before each command
    monkeypatch.delenv("TPU_LIBRARY_PATH")
    monkeypatch.setitem(sys.modules, "libtpu", None)
    monkeypatch.setattr(platforms, "cuda_plugin", lambda: "jax_plugins.xla_cuda12")
    assert choose() == "cpu"


def test_another_pjrt_plugin_is_left_to_jax(monkeypatch):
    monkeypatch.setenv("PJRT_NAMES_AND_LIBRARY_PATHS", "mydevice:/opt/mydevice/pjrt.so")
    assert platforms._other_accelerator()


def test_the_planner_asks_the_platform_probe_about_cuda():
    # one place knows whether JAX's CUDA plugin is installed and an NVIDIA GPU attached: the
    # planner's GPU compiles ask the probe's functions instead of keeping their own
    from lclm.plan import aot

    assert aot.cuda_plugin is platforms.cuda_plugin
    assert aot.nvidia_gpu_attached is platforms.nvidia_gpu_attached

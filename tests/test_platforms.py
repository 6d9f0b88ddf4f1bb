"""JAX's platforms as `import lclm` chooses them: where libtpu is installed (the [test] extra)
and no TPU is attached, JAX must not start libtpu's TPU runtime, which prints its complaints
about the missing TPU before every command and takes a machine-wide lock; an explicit
JAX_PLATFORMS is the user's and is kept.

The subprocesses run without what conftest.py sets for the test session (JAX_PLATFORMS=cpu,
ALLOW_MULTIPLE_LIBTPU_LOAD, the simulated devices' XLA_FLAGS): they see what a user's shell
would."""

import importlib.util
import os
import subprocess
import sys

import pytest
from support import DEMO_CONFIG, ROOT

import lclm

HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None
# what libtpu prints when it starts its TPU runtime on a machine without a TPU
LIBTPU_NOISE = ("host bounds", "TPU_WORKER_HOSTNAMES", "TPU_ACCELERATOR_TYPE", "libtpu",
                "InitGoogle")

libtpu_without_a_tpu = pytest.mark.skipif(
    not HAVE_LIBTPU or lclm.tpu_attached() or lclm._other_accelerator(),
    reason="needs libtpu installed on a machine with no TPU, GPU or other JAX plugin (where "
           "there is one, lclm leaves the platforms to JAX)")


def user_env(**extra):
    """The environment of a user's shell: none of the test session's JAX settings."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_PLATFORMS", "ALLOW_MULTIPLE_LIBTPU_LOAD", "XLA_FLAGS", "NPROC")
           and not k.startswith("TPU_")}
    return env | extra


def _python(*args, env=None):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT,
                          env=env or user_env(), timeout=300)


def _noise(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if any(n in line for n in LIBTPU_NOISE)]


@libtpu_without_a_tpu
def test_a_cli_that_starts_jax_prints_nothing_of_libtpu(tmp_path):
    """train.py counts the devices (JAX starts its backends) and then refuses a mesh of 64:
    its one error line is all of stderr."""
    done = _python("train.py", "--config", DEMO_CONFIG, "--config.mesh.sp=32",
                   "--config.mesh.fit=false", f"--config.workdir={tmp_path}")
    assert done.returncode == 2, done.stderr
    assert _noise(done.stderr) == []
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: config.mesh:"), lines


@libtpu_without_a_tpu
def test_jax_imported_before_lclm_is_kept_off_libtpu_too():
    done = _python("-c", "import jax, lclm; print(jax.config.jax_platforms, jax.devices())")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "cpu [CpuDevice(id=0)]"
    assert _noise(done.stderr) == []


@libtpu_without_a_tpu
@pytest.mark.parametrize("explicit", ["", "cpu", "tpu,cpu"])
def test_an_explicit_jax_platforms_is_kept(explicit):
    """Even an empty one: JAX's own search, asked for by name."""
    show = "import os, lclm; print(repr(os.environ['JAX_PLATFORMS']))"
    done = _python("-c", show, env=user_env(JAX_PLATFORMS=explicit))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == repr(explicit)


@libtpu_without_a_tpu
def test_unset_jax_platforms_becomes_the_cpu():
    done = _python("-c", "import os, lclm; print(os.environ.get('JAX_PLATFORMS'))")
    assert done.stdout.strip() == "cpu"


@pytest.fixture
def choose(monkeypatch):
    """lclm's choice made again, as at import before JAX: returns JAX_PLATFORMS after it
    (None: left to JAX)."""
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.delenv("JAX_FORCE_TPU_INIT", raising=False)
    monkeypatch.setenv("TPU_LIBRARY_PATH", "/opt/libtpu/libtpu.so")  # libtpu, as JAX finds it
    monkeypatch.delitem(sys.modules, "jax")
    monkeypatch.setattr(lclm, "tpu_attached", lambda: False)
    monkeypatch.setattr(lclm, "_other_accelerator", lambda: False)

    def run():
        lclm._keep_jax_off_an_absent_tpu()
        return os.environ.get("JAX_PLATFORMS")
    return run


def test_only_the_cpu_left_is_chosen(choose):
    assert choose() == "cpu"


@pytest.mark.parametrize("why", ["a TPU", "a GPU or plugin", "no libtpu", "forced TPU init"])
def test_the_choice_is_left_to_jax(choose, monkeypatch, why):
    if why == "a TPU":
        monkeypatch.setattr(lclm, "tpu_attached", lambda: True)
    elif why == "a GPU or plugin":
        monkeypatch.setattr(lclm, "_other_accelerator", lambda: True)
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
    monkeypatch.setattr(lclm, "_cuda_plugin", lambda: True)
    assert choose() == "cpu"


def test_another_pjrt_plugin_is_left_to_jax(monkeypatch):
    monkeypatch.setenv("PJRT_NAMES_AND_LIBRARY_PATHS", "mydevice:/opt/mydevice/pjrt.so")
    assert lclm._other_accelerator()

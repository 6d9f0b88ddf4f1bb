"""Ahead-of-time compilation for TPU slices (lclm.aot, `python -m lclm.plan --compile`).

The slice names and the no-libtpu message are tested everywhere; compiling needs libtpu
(`pip install 'lclm[tpu]'`), which CI does not install (with it, every JAX start on a machine
without a TPU prints libtpu's warnings), so those tests skip without it."""

import importlib.util
import os
import subprocess
import sys

import pytest
from support import DEMO_CONFIG, ROOT

from lclm.aot import tpu_target
from lclm.errors import ConfigError

HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None


@pytest.mark.parametrize("name,topology,chip_config,devices,hbm_gib", [
    ("v4-64", "v4:2x4x4", "megacore", 32, 32),
    ("v4-8", "v4:2x2x1", "megacore", 4, 32),
    ("v5p-128", "v5p:4x4x4", "megacore", 64, 95),
    ("v5e-16", "v5e:4x4", None, 16, 16),
    ("v6e-32", "v6e:4x8", None, 32, 32),
    ("v5e-1", "v5e:1x1", None, 1, 16),
])
def test_slice_names_map_to_topologies(name, topology, chip_config, devices, hbm_gib):
    t = tpu_target(name)
    assert (t.topology, t.chip_config, t.devices, t.hbm_bytes) == (
        topology, chip_config, devices, hbm_gib * 2**30)


@pytest.mark.parametrize("name,needle", [("v9-8", "<generation>-<size>"),
                                         ("v4-12", "power-of-two number of chips"),
                                         ("v4-1", "power-of-two number of chips")])
def test_bad_slice_names_are_one_line_errors(name, needle):
    with pytest.raises(ConfigError, match=needle):
        tpu_target(name)


def _plan(*args):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run([sys.executable, "-m", "lclm.plan", "--config",
                           DEMO_CONFIG, *args],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)


@pytest.mark.skipif(HAVE_LIBTPU, reason="libtpu is installed: the message is for its absence")
def test_compile_without_libtpu_says_so_in_one_line():
    done = _plan("--compile", "v5e-8")
    assert done.returncode == 2
    assert done.stderr.strip() == ("error: --compile needs libtpu (it runs the TPU compiler on "
                                   "this machine): pip install 'lclm[tpu]'")


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_LIBTPU, reason="compiling for a TPU needs libtpu (lclm[tpu])")
def test_demo_compiles_for_a_tpu_slice_with_mosaic_kernels():
    done = _plan("--compile", "v5e-8", "--config.attention.impl=pallas_tpu",
                 "--config.attention.q_chunk=128", "--config.attention.kv_chunk=128")
    assert done.returncode == 0, done.stderr[-2000:]
    row = [line for line in done.stdout.splitlines() if line.startswith("| 0 |")][0]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert int(cells[8]) >= 3  # forward, dq and dk/dv kernels, compiled for Mosaic


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_LIBTPU, reason="compiling for a TPU needs libtpu (lclm[tpu])")
def test_a_step_that_overflows_hbm_exits_3_with_one_line():
    done = _plan("--compile", "v5e-8", "--config.data.batch_size=8192",
                 "--config.model.remat=none")
    assert done.returncode == 3, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "stage 0 (seq_len 512)" in errors[0] and "HBM" in errors[0]

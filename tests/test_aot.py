"""Ahead-of-time compilation for TPU slices (lclm.plan.aot, `python -m lclm.plan --compile`).

libtpu comes with the [test] extra on Linux x86-64 (it compiles for TPUs without one), so
CI runs the compile tests; elsewhere they skip. The no-libtpu message is tested everywhere,
with libtpu hidden from the process."""

import fcntl
import importlib.util
import os
import subprocess
import sys

import pytest
from support import DEMO_CONFIG, ROOT

from lclm.config import load_config
from lclm.errors import ConfigError
from lclm.ops.kernels import pallas_tpu
from lclm.plan.__main__ import main as plan_main
from lclm.plan.aot import compile_step, target_devices, tpu_target
from lclm.plan.memory import estimate
from lclm.platforms import tpu_attached

HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None


@pytest.mark.parametrize(
    "name,topology,chip_config,devices,hbm_gib",
    [
        ("v4-64", "v4:2x4x4", "megacore", 32, 32),
        ("v4-8", "v4:2x2x1", "megacore", 4, 32),
        ("v5p-128", "v5p:4x4x4", "megacore", 64, 95),
        ("v5e-16", "v5e:4x4", None, 16, 16),
        ("v6e-32", "v6e:4x8", None, 32, 32),
        ("v5e-1", "v5e:1x1", None, 1, 16),
    ],
)
def test_slice_names_map_to_topologies(name, topology, chip_config, devices, hbm_gib):
    t = tpu_target(name)
    assert (t.topology, t.chip_config, t.devices, t.hbm_bytes) == (
        topology,
        chip_config,
        devices,
        hbm_gib * 2**30,
    )


@pytest.mark.parametrize(
    "name,needle",
    [
        ("v9-8", "<generation>-<size>"),
        ("v4-12", "power-of-two number of chips"),
        ("v4-1", "power-of-two number of chips"),
    ],
)
def test_bad_slice_names_are_one_line_errors(name, needle):
    with pytest.raises(ConfigError, match=needle):
        tpu_target(name)


def _python(*args):
    """A fresh Python (without the simulated devices' XLA_FLAGS) in the repository root."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600
    )


def _plan(*args):
    return _python("-m", "lclm.plan", "--config", DEMO_CONFIG, *args)


def test_compile_without_libtpu_says_so_in_one_line():
    hide_libtpu = (
        "import sys; sys.modules['libtpu'] = None; from lclm.plan.__main__ import main; "
        f"sys.exit(main(['--config', {DEMO_CONFIG!r}, '--compile', 'v5e-8']))"
    )
    done = _python("-c", hide_libtpu)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "error: --compile needs libtpu (it runs the TPU compiler on "
        "this machine): pip install 'lclm[tpu]'"
    )


needs_libtpu = pytest.mark.skipif(
    not HAVE_LIBTPU, reason="compiling for a TPU needs libtpu (lclm[tpu])"
)


@needs_libtpu
def test_ring_kernels_compile_for_mosaic_without_callbacks():
    """The demo's ring (sp=4) with pallas_tpu, compiled for a v5e slice: the forward, dQ and
    dK/dV kernels are Mosaic custom calls, and nothing runs on the host (interpret mode would
    be callbacks, which cannot compile for a TPU anyway)."""
    config = load_config(DEMO_CONFIG, {"attention.impl": "pallas_tpu"})
    target = tpu_target("v5e-8")
    compiled = compile_step(config, target_devices(target))
    assert compiled.kernels >= 3 and compiled.callbacks == 0
    assert compiled.total > 0


@needs_libtpu
def test_a_kernel_that_overflows_vmem_exits_3_with_one_line(monkeypatch, capsys):
    """Tiles of 2048 x 2048 overflow a v4's VMEM (31 MB of 16 MB, measured): the stage is
    one line naming the overflow, exit 3."""
    monkeypatch.setitem(pallas_tpu.TPU_TILES, "TPU v4", (2048, 2048))
    code = plan_main(
        [
            "--config",
            DEMO_CONFIG,
            "--compile",
            "v4-8",
            "--config.attention.impl=pallas_tpu",
            "--config.mesh.sp=1",
            "--config.mesh.fsdp=4",
            "--config.data.seq_len=2048",
            "--config.model.n_layers=1",
        ]
    )
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 3 and len(errors) == 1, errors
    assert "stage 0 (seq_len 2,048): VMEM overflow on v4-8" in errors[0]


@pytest.mark.slow
@needs_libtpu
def test_demo_compiles_for_a_tpu_slice_with_mosaic_kernels():
    done = _plan(
        "--compile",
        "v5e-8",
        "--config.attention.impl=pallas_tpu",
        "--config.attention.q_chunk=128",
        "--config.attention.kv_chunk=128",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    row = [line for line in done.stdout.splitlines() if line.startswith("| 0 |")][0]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert int(cells[8]) >= 3  # forward, dq and dk/dv kernels, compiled for Mosaic


@pytest.mark.slow
@needs_libtpu
def test_a_step_that_overflows_hbm_exits_3_with_one_line():
    done = _plan("--compile", "v5e-8", "--config.data.batch_size=8192", "--config.model.remat=none")
    assert done.returncode == 3, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "stage 0 (seq_len 512)" in errors[0] and "HBM" in errors[0]


@pytest.mark.slow
@needs_libtpu
def test_the_planner_is_within_15_percent_of_xla():
    """LLaMA-1B shapes cut to 2 layers at 16K tokens over sp=4 on a v5e-4: XLA's per-device
    total (7.93 GiB when measured) and the planner's estimate agree within 15%."""
    config = load_config(
        os.path.join(ROOT, "configs", "llama1b.py"),
        {"model.n_layers": 2, "mesh.sp": 4, "data.seq_len": 16384, "model.remat": "attention"},
    )
    target = tpu_target("v5e-4")
    xla = compile_step(config, target_devices(target)).total
    planned = estimate(config, target.devices, "tpu-v5e").total
    assert abs(planned - xla) / xla < 0.15, (planned / 2**30, xla / 2**30)


LIBTPU_LOCK = "/tmp/libtpu_lockfile"


def _lock_is_held() -> bool:
    """Whether a process holds libtpu's lock (a POSIX lock on its file; a lock this test
    process took is dropped again with the file's closing)."""
    try:
        fd = os.open(LIBTPU_LOCK, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


@pytest.mark.slow
@needs_libtpu
@pytest.mark.skipif(tpu_attached(), reason="on a TPU VM libtpu's lock guards the chips")
def test_compile_while_another_process_holds_libtpus_lock():
    """A plain JAX process on a machine with libtpu and no TPU starts libtpu, which takes
    its machine-wide lock; a compile beside it needs no lock and prints nothing of libtpu's.
    Neither process gets the test session's ALLOW_MULTIPLE_LIBTPU_LOAD or JAX_PLATFORMS."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("JAX_PLATFORMS", "ALLOW_MULTIPLE_LIBTPU_LOAD", "XLA_FLAGS", "NPROC")
        and not k.startswith("TPU_")
    }
    hold = "import time, jax; jax.devices(); print('holding', flush=True); time.sleep(300)"
    holder = subprocess.Popen(
        [sys.executable, "-c", hold],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "holding\n"
        if not _lock_is_held():
            pytest.skip(f"this libtpu took no lock ({LIBTPU_LOCK})")
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "lclm.plan",
                "--config",
                DEMO_CONFIG,
                "--compile",
                "v5e-1",
                "--config.mesh.sp=1",
                "--config.mesh.fsdp=1",
                "--config.model.n_layers=1",
                "--config.data.seq_len=128",
                "--config.data.batch_size=1",
            ],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=600,
        )
    finally:
        holder.kill()
        holder.wait()
    assert done.returncode == 0, done.stderr[-2000:]
    noise = ("host bounds", "TPU_WORKER_HOSTNAMES", "TPU_ACCELERATOR_TYPE", "libtpu")
    assert [line for line in done.stderr.splitlines() if any(n in line for n in noise)] == []
    assert [line for line in done.stdout.splitlines() if line.startswith("| 0 | 128 |")]


def test_conditionals_are_counted_whatever_their_results_shape():
    """A conditional returning a tuple (as a `lax.cond` over a fused kernel's outputs does) is
    one, a computation's ROOT one too; a 'conditional(' in metadata is none."""
    from lclm.plan.aot import conditionals

    text = (
        "  %cond.12 = (bf16[1,8,2]{2,1,0}, f32[1,8]{1,0}) conditional(%p, %a, %b), "
        "branch_computations={%region_1, %region_2}\n"
        "  %c = f32[4]{0} conditional(%q, %x, %y), true_computation=%t\n"
        "  ROOT %r = (f32[4]{0}, f32[4]{0}) conditional(%q, %x, %y), true_computation=%t\n"
        '  %f = f32[4]{0} fusion(%x), metadata={op_name="cond/conditional("}\n'
    )
    assert conditionals(text) == 3

"""Ahead-of-time compilation for GPUs on a machine without one (lclm.plan.aot,
`plan --compile h100:N`).

The names, the shipped GPU descriptions, the budget and the kernel choice by target device are
tested everywhere; the compiles need JAX's CUDA plugin with ptxas (`lclm[gpu-aot]`) and skip,
saying so, where it is missing."""

import contextlib
import dataclasses
import importlib.util
import os
import subprocess
import sys
import types

import jax
import pytest
from jax._src import xla_bridge
from support import DEMO_CONFIG, ROOT

from lclm import hardware
from lclm.config import load_config
from lclm.config.run_config import run_config
from lclm.errors import ConfigError
from lclm.ops.context_parallel import ring
from lclm.ops.kernels import choose_kernel, compiling_for, recording, target_device, tokamax_gpu
from lclm.parallel.mesh import make_mesh
from lclm.plan import aot
from lclm.plan.memory import estimate

HAVE_CUDA_PLUGIN = (
    any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") is not None for v in (12, 13))
    if importlib.util.find_spec("jax_plugins")
    else False
)
needs_cuda_plugin = pytest.mark.skipif(
    not HAVE_CUDA_PLUGIN,
    reason="compiling for a GPU without one needs JAX's CUDA plugin and ptxas (lclm[gpu-aot])",
)
HAVE_TOKAMAX = importlib.util.find_spec("tokamax") is not None
needs_tokamax = pytest.mark.skipif(
    not HAVE_TOKAMAX, reason="tokamax is not installed (lclm[gpu-aot] has it on Python >= 3.12)"
)

# conftest's JAX_PLATFORMS=cpu comes after jax's import (lclm.parallel imports it), so jax's
# config may not have it: without it the first backend start tries the CUDA plugin's GPU, and
# a plugin that failed its start cannot describe GPUs for the rest of the session
if not xla_bridge.backends_are_initialized() and jax.config.jax_platforms is None:
    jax.config.update("jax_platforms", "cpu")


@pytest.mark.parametrize(
    "name,topology,devices,nodes,hbm_gib",
    [
        ("h100:1", "1x1x1", 1, 1, 79.10),
        ("h100:8", "1x1x8", 8, 1, 79.10),
        ("h100:4x8", "1x4x8", 32, 4, 79.10),
        ("H200:2x8", "1x2x8", 16, 2, 140.40),
        ("a100:4", "1x1x4", 4, 1, 80.00),
    ],
)
def test_gpu_names_map_to_topologies(name, topology, devices, nodes, hbm_gib):
    t = aot.target(name)
    assert (t.platform, t.topology, t.devices, t.nodes) == ("gpu", topology, devices, nodes)
    assert round(t.hbm_bytes / 2**30, 2) == hbm_gib
    assert t.planner_device in ("h100-nvlink", "h200-nvlink", "a100-nvlink")


def test_tpu_slices_are_targets_too():
    t = aot.target("v4-64")
    assert (t.platform, t.topology, t.devices) == ("tpu", "v4:2x4x4", 32)


@pytest.mark.parametrize("name", ["b200:8", "h100", "h100:0", "h100:2x", "v9-8", "gpu"])
def test_unknown_targets_are_one_line_listing_the_known(name):
    with pytest.raises(ConfigError) as e:
        aot.target(name)
    text = str(e.value)
    assert "\n" not in text and "h100:MxN" in text and "v4-N" in text


@pytest.mark.parametrize("model", sorted(hardware.GPUS))
def test_shipped_gpu_descriptions_name_their_sources(model):
    text = aot.target(f"{model}:1").config_text
    for field in (
        "core_count",
        "shared_memory_per_block_optin",
        "device_memory_size",
        "cuda_compute_capability",
        "dnn_version_info",
        "runtime_version",
    ):
        assert field in text, field
    assert "Sources:" in text


def test_the_budget_leaves_room_for_what_xla_does_not_count(monkeypatch):
    t = aot.target("h100:8")
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_ALLOCATOR", raising=False)
    budget, how = aot.gpu_budget(t)  # JAX's default pool: 0.75 of HBM, less 1 GiB
    assert budget == int(0.75 * t.hbm_bytes - 2**30) and "0.75" in how
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.99")
    budget, _ = aot.gpu_budget(t)  # 0.99 would leave NCCL and the context 0.8 GiB: 3 kept
    assert budget == t.hbm_bytes - 4 * 2**30


def _gpu(capability: str):
    return types.SimpleNamespace(
        platform="gpu", device_kind="NVIDIA GPU", compute_capability=capability
    )


def test_kernels_see_the_target_device_not_the_host(monkeypatch):
    """tokamax_gpu's Hopper check reads the device programs are built for: an H100 of a
    described topology on this CPU host is Hopper, an A100 is not."""
    monkeypatch.setattr(tokamax_gpu, "available", lambda: True)
    shapes = dict(head_dim=128, q_chunk=512, kv_chunk=512, block=4096, dtype="bfloat16")
    assert target_device().platform == "cpu"
    with compiling_for(_gpu("9.0")):
        assert tokamax_gpu.limits(platform="gpu", **shapes) is None
        assert choose_kernel("auto", platform="gpu", **shapes) == "cudnn_gpu"
    with compiling_for(_gpu("8.0")):
        assert "Hopper" in tokamax_gpu.limits(platform="gpu", **shapes)
        assert choose_kernel("auto", platform="gpu", **shapes) == "pallas_gpu"
    assert choose_kernel("auto", platform="gpu", device=_gpu("9.0"), **shapes) == "cudnn_gpu"


def test_a_recording_keeps_what_auto_passed_over_and_why(monkeypatch):
    """What `plan --compile` prints beside the kernels it compiled: on an A100 auto passes
    over the Hopper kernels, saying why; nothing is recorded outside `recording`."""
    monkeypatch.setattr(tokamax_gpu, "available", lambda: True)
    shapes = dict(head_dim=128, q_chunk=512, kv_chunk=512, block=4096, dtype="bfloat16")
    with recording() as record:
        assert choose_kernel("auto", platform="gpu", device=_gpu("8.0"), **shapes) == "pallas_gpu"
        choose_kernel("auto", platform="gpu", device=_gpu("9.0"), **shapes)
        choose_kernel("tokamax_gpu", platform="gpu", device=_gpu("9.0"), **shapes)
    assert list(record.passed_over) == ["cudnn_gpu", "tokamax_gpu"]
    assert all("Hopper" in why for why in record.passed_over.values())
    assert record.kernels == []  # choosing is not lowering


def _python(*args, hide=()):
    """A fresh Python (without the simulated devices' XLA_FLAGS) in the repository root."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    hiding = "".join(f"sys.modules[{m!r}] = None; " for m in hide)
    code = f"import sys; {hiding}from lclm.plan.__main__ import main; sys.exit(main({[*args]!r}))"
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600
    )


def test_compile_without_the_cuda_plugin_says_so_in_one_line():
    done = _python(
        "--config",
        DEMO_CONFIG,
        "--compile",
        "h100:8",
        hide=("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13"),
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip() == (
        "error: --compile h100:8 needs JAX's CUDA plugin and ptxas (it runs the GPU compiler "
        "on this machine): pip install 'lclm[gpu-aot]'"
    )


# a 2-layer model with LLaMA's head dim 64 in bf16, tiles Triton takes
SMALL = {
    "model.n_layers": 2,
    "model.dim": 256,
    "model.n_heads": 4,
    "model.n_kv_heads": 2,
    "model.ffn_dim": 512,
    "model.dtype": "bfloat16",
    "attention.q_chunk": 64,
    "attention.kv_chunk": 64,
    "data.seq_len": 1024,
    "data.batch_size": 2,
}


def _small(**overrides):
    return load_config(DEMO_CONFIG, {**SMALL, **overrides})


@needs_cuda_plugin
@pytest.mark.parametrize("impl", ["pallas_gpu", "tokamax_gpu"])
def test_ring_kernels_compile_for_an_h100_without_callbacks(impl):
    """The ring at sp=4, forward and backward, compiled for h100:4: the kernels are Triton
    (pallas_gpu: forward, dK/dV and dQ) or Mosaic GPU (tokamax_gpu) custom calls compiled to
    sm_90a, and nothing runs on the host (interpret mode would be callbacks); the compile
    names the kernel it lowered."""
    if impl == "tokamax_gpu" and not HAVE_TOKAMAX:
        pytest.skip("tokamax is not installed (lclm[gpu-aot] has it on Python >= 3.12)")
    config = _small(**{"attention.impl": impl, "mesh.sp": 4, "mesh.fsdp": 1})
    compiled = aot.compile_step(config, aot.target_devices(aot.target("h100:4")))
    assert compiled.kernels >= 3 and compiled.callbacks == 0
    assert compiled.collectives > 0 and compiled.total > 0
    assert compiled.attention.kernels == [f"{impl} (ring)"]
    assert compiled.attention.passed_over == {}


@needs_cuda_plugin
def test_plan_names_the_kernel_auto_compiled_for_a_ring_of_h100s():
    """`plan --compile h100:4` at sp=4 with auto: what a cluster with lclm[cuda] runs there,
    tokamax's ring passes (cudnn_gpu's, as auto names them); where tokamax cannot be installed
    (Python 3.11) pallas_gpu, and one line saying which kernels auto passed over and why."""
    small = [f"--config.{key}={value}" for key, value in SMALL.items()]
    done = _python(
        "--config",
        DEMO_CONFIG,
        "--compile",
        "h100:4",
        *small,
        "--config.mesh.sp=4",
        "--config.mesh.fsdp=1",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert next(x for x in lines if x.startswith("| stage |")).endswith("| attention kernel |")
    row = [c.strip() for c in next(x for x in lines if x.startswith("| 0 |")).strip("|").split("|")]
    notes = [x for x in lines if x.startswith("stage 0: attention.impl='auto' passed over")]
    if HAVE_TOKAMAX:
        assert row[-1] == "tokamax_gpu (ring)" and notes == [], (row, notes)
    else:
        assert row[-1] == "pallas_gpu (ring)", row
        assert notes == [
            "stage 0: attention.impl='auto' passed over cudnn_gpu, tokamax_gpu "
            f"(tokamax is not installed: {tokamax_gpu.INSTALL})"
        ], notes


@needs_cuda_plugin
@pytest.mark.skipif(HAVE_TOKAMAX, reason="tokamax is installed: it compiles (test above)")
def test_without_tokamax_an_explicit_tokamax_compile_says_so_in_one_line():
    small = [f"--config.{key}={value}" for key, value in SMALL.items()]
    done = _python(
        "--config",
        DEMO_CONFIG,
        "--compile",
        "h100:4",
        *small,
        "--config.attention.impl=tokamax_gpu",
        "--config.mesh.fsdp=1",
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert [line for line in done.stderr.splitlines() if "tokamax" in line] == [
        "error: attention.impl='tokamax_gpu' cannot serve this model: tokamax is not installed: "
        f"{tokamax_gpu.INSTALL}; attention.impl='auto' picks a kernel that can"
    ]


@needs_cuda_plugin
@needs_tokamax
def test_one_h100_compiles_cudnn_with_the_ring_as_its_fallback(monkeypatch):
    """sp=1 with auto: cuDNN's calls (plain causal, packed documents) and tokamax's ring for
    rows of more documents, the switch a real H100 runs; compiled deviceless because jax's
    cuDNN checks read the described H100 (`cudnn_gpu.checks_for`), not the absent local GPU.
    remat='full': 'attention' keeps the ring's named residuals, so it asks for the ring."""
    texts = []
    count = aot.kernel_calls
    monkeypatch.setattr(aot, "kernel_calls", lambda text: texts.append(text) or count(text))
    config = _small(**{"mesh.sp": 1, "mesh.fsdp": 1, "model.remat": "full"})
    compiled = aot.compile_step(config, aot.target_devices(aot.target("h100:1")))
    assert compiled.attention.kernels == ["cudnn_gpu", "tokamax_gpu (ring)"]
    assert compiled.callbacks == 0 and compiled.conditionals > 0
    assert "__cudnn$fmha" in texts[0] and "mosaic_gpu" in texts[0]

    # the fallback serves rows of more than MAX_DOCUMENTS documents only: the ring's
    # one-document shortcut (a conditional around a second tokamax call) is not compiled
    # into it; the same program with that knowledge dropped has both
    @contextlib.contextmanager
    def unknown(known):
        yield

    monkeypatch.setattr(ring, "several_documents", unknown)
    without = aot.compile_step(config, aot.target_devices(aot.target("h100:1")))
    mosaic = [t.count('custom_call_target="mosaic_gpu') for t in texts]
    assert compiled.conditionals < without.conditionals
    assert 0 < mosaic[0] < mosaic[1]


@needs_cuda_plugin
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ring", "all_gather", "ulysses", "usp"])
def test_every_strategy_compiles_for_one_h100_node(strategy):
    usp = {"attention.ulysses": 2} if strategy == "usp" else {}
    config = _small(
        **{
            "attention.impl": "pallas_gpu",
            "attention.strategy": strategy,
            "mesh.sp": 4,
            "mesh.fsdp": 2,
            **usp,
        }
    )
    compiled = aot.compile_step(config, aot.target_devices(aot.target("h100:8")))
    assert compiled.kernels >= 3 and compiled.callbacks == 0


@needs_cuda_plugin
def test_a_stage_over_the_budget_exits_3_with_one_line():
    """XLA:GPU compiles a program over HBM; lclm compares it with the budget and says so: 7.5B
    float32 parameters with their gradients and AdamW state (120 GB) on one H100."""
    done = _python(
        "--config",
        DEMO_CONFIG,
        "--compile",
        "h100:1",
        "--config.mesh.sp=1",
        "--config.mesh.fsdp=1",
        "--config.model.n_layers=8",
        "--config.model.dim=8192",
        "--config.model.n_heads=64",
        "--config.model.n_kv_heads=8",
        "--config.model.ffn_dim=28672",
        "--config.data.seq_len=256",
        "--config.data.batch_size=1",
        "--config.attention.impl=blockwise",
    )
    assert done.returncode == 3, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "stage 0 (seq_len 256)" in errors[0], errors
    assert "GiB budget on h100:1" in errors[0]


@needs_cuda_plugin
@pytest.mark.slow
@pytest.mark.parametrize(
    "remat, layers, seq_len", [("attention", 2, 16384), ("offload", 16, 524288)]
)
def test_the_planner_is_within_15_percent_of_xla_gpu(remat, layers, seq_len):
    """LLaMA-1B shapes on one H100: XLA:GPU's per-device total and the planner's estimate (for
    the kernel auto picks there) agree within 15%, with the layers' residuals on the device
    (cut to 2 layers) and offloaded to the host at 512K tokens (the planner said 54.7 GiB
    there, XLA 34.9)."""
    config = load_config(
        os.path.join(ROOT, "configs", "llama1b.py"),
        {"model.n_layers": layers, "data.seq_len": seq_len, "model.remat": remat},
    )
    target = aot.target("h100:1")
    devices = aot.target_devices(target)
    xla = aot.compile_step(config, devices).total
    with compiling_for(devices[0]):
        planned = estimate(config, target.devices, target.planner_device).total
    assert abs(planned - xla) / xla < 0.15, (planned / 2**30, xla / 2**30)


@needs_cuda_plugin
@pytest.mark.slow
def test_bench_compile_only_compiles_every_program_with_its_kernels(tmp_path):
    """`python -m bench --suite gpu-quick --compile-only`'s rows on a cut-down suite (every
    correctness case, one attention shape, a 2-layer model's baseline and lclm steps): each
    program compiles for an H100, pallas_gpu as Triton kernels (not interpret mode, which a
    CPU host's default backend gave the parts' local kernels) and the baseline's attention
    as cuDNN's fused call."""
    import dataclasses

    from bench import compile_only
    from bench.__main__ import TINY_MODEL, Suite
    from bench.attention import AttentionSpec
    from bench.correctness import CASES, CorrectnessSpec
    from bench.max_context import ONE_DEVICE
    from bench.train_step import ModelRun, TrainSpec

    suite = Suite(
        toy=False,
        separate_parts=True,
        needs_gpu=True,
        correctness=dataclasses.replace(CorrectnessSpec().smallest(), impls=("pallas_gpu",)),
        attention=dataclasses.replace(
            AttentionSpec().smallest(), blocks=(1024,), impls=("pallas_gpu",)
        ),
        # bfloat16: cuDNN's attention takes no float32 (the demo's dtype)
        train=TrainSpec(
            models=(
                ModelRun(
                    "configs/demo.py",
                    (256,),
                    (*ONE_DEVICE, *TINY_MODEL, "--config.model.dtype=bfloat16"),
                ),
            ),
            impls=("auto",),
        ),
    )
    failed = compile_only.run(suite, ["correctness", "attention", "train"], "h100:1", str(tmp_path))
    lines = (tmp_path / "compile_only.md").read_text().splitlines()
    rows = [
        [c.strip() for c in line.strip("|").split("|")]
        for line in lines
        if line.startswith("| ") and not line.startswith(("| part", "| ---"))
    ]
    assert failed == 0 and all(r[-1] == "ok" for r in rows), rows
    programs = {r[1]: int(r[4]) for r in rows}  # name -> fused-kernel calls
    assert len(programs) == 2 * len(CASES) + 2 * 2 + 4, sorted(programs)
    for name, kernels in programs.items():
        if "pallas_gpu" in name or "cuDNN" in name or name.startswith("lclm"):
            assert kernels > 0, (name, kernels)
    assert sum(name.startswith("baseline") for name in programs) == 3


@needs_cuda_plugin
@pytest.mark.parametrize("kind,max_new", [("forward", 0), ("decode", 9)])
def test_evaluation_programs_compile_for_an_h100(kind, max_new):
    """What `python -m lclm.extend` evaluates with, compiled as `plan --compile` compiles it
    for an extension: perplexity's token losses and a passkey's prefill with its decode step,
    the small model on a ring of 2 H100s, with fused attention and no host callbacks."""
    run = run_config(_small(**{"mesh.sp": 2, "mesh.fsdp": 1}))
    model = dataclasses.replace(run.model.resolved(), ffn_chunk=256, loss_chunk=256)
    devices = aot.target_devices(aot.target("h100:2"))
    mesh = make_mesh(dp=1, fsdp=1, tp=1, sp=2, devices=devices)
    compiled = aot.compile_eval(kind, model, run.attention, mesh, rows=1, row=1024, max_new=max_new)
    assert compiled.kernels >= 1 and compiled.callbacks == 0 and compiled.total > 0
    assert compiled.attention.kernels

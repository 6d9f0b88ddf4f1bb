"""Ahead-of-time compilation of the train step for a TPU slice or GPUs, on a machine without them.

With libtpu installed (`pip install 'lclm[tpu]'`), `jax.experimental.topologies` describes a
TPU slice's devices with no TPU present; lowering the step that train.py runs with abstract
arrays sharded over a mesh of those devices and compiling it runs the real XLA:TPU and Mosaic
compilers. Their per-device memory figures are what the run would allocate, and an HBM or
VMEM overflow is a compile error: found here, on a CPU, instead of at the first step of a
rented pod.

Slice names follow Cloud TPU's: `<generation>-<TensorCores>` for v4 and v5p (two
TensorCores per chip, used as one megacore device: v4-64 is 32 chips), `<generation>-<chips>`
for v5e and v6e (one TensorCore per chip).

GPUs the same way (`pip install 'lclm[gpu-aot]'`: the CUDA plugin and ptxas, no GPU): XLA:GPU
compiles for GPUs that are described rather than attached. `h100:8` is one node of 8 H100s,
`h100:4x8` four nodes of 8 (also `h200:...`, `a100:...`, the 80 GB parts); each model is
described by a GpuTargetConfigProto shipped in `lclm/targets/` (SM count, shared memory, HBM,
compute capability, CUDA and cuDNN versions; the sources of the numbers are named in each
file). XLA:GPU does not fail a program that is over HBM, so the fit is decided here, against
`gpu_budget` (see there).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.resources
import logging
import math
import os
import re
import time

import jax
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec

from lclm.config import ModelConfig
from lclm.data.loader import abstract_batch, batch_sharding
from lclm.errors import ConfigError
from lclm.eval.decode import decode_step, prefill
from lclm.eval.token_loss import token_losses
from lclm.hardware import BY_NAME, GPUS, TPUS, planner_device
from lclm.models.decoder import param_shapes
from lclm.ops.kernels import Lowered, compiling_for, cudnn_gpu, recording
from lclm.parallel.mesh import make_mesh
from lclm.platforms import cuda_plugin, nvidia_gpu_attached, tpu_attached
from lclm.train.remat_choice import AUTO, choose
from lclm.train.remat_choice import gpu_budget as gpu_pool_budget
from lclm.train.startup_checks import checked
from lclm.train.step import jit_train_step, make_optimizer
from lclm.workdir.state import init_state, param_shardings, state_shardings

KNOWN = (
    "v4-N, v5p-N (TensorCores), v5e-N, v6e-N (chips); h100:N (N GPUs on one node), "
    "h100:MxN (M nodes of N), h200:..., a100:... (80 GB)"
)


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # e.g. "v4-64", "h100:4x8"
    generation: str  # e.g. "v4", "h100"
    topology: str  # e.g. "v4:2x4x4", "1x4x8": what jax.experimental.topologies takes
    chip_config: str | None
    devices: int  # JAX devices of the slice (chips) or GPUs in all
    hbm_bytes: int  # per device
    # chips per host where a slice is smaller than the default host of 2x2x1 chips (libtpu
    # refuses such a topology otherwise): the whole slice on one host
    host_bounds: tuple[int, ...] | None = None
    platform: str = "tpu"  # "tpu" or "gpu"
    nodes: int = 1  # GPU nodes (hosts)
    config_text: str = ""  # GPUs: the GpuTargetConfigProto, text format

    @property
    def planner_device(self) -> str | None:
        """The planner's name of this target's device (`lclm.hardware.planner_device`; it
        may have no link figures, and then the planner has no entry for it)."""
        return planner_device(BY_NAME[self.generation])


def target(name: str) -> Target:
    """A TPU slice (`v4-64`) or GPU topology (`h100:4x8`); anything else is a one-line
    ConfigError listing the known names."""
    key = name.strip().lower()
    if key.split("-")[0] in TPUS:
        return tpu_target(key)
    m = re.fullmatch(r"(\w+):(?:(\d+)x)?(\d+)", key)
    if not m or m.group(1) not in GPUS:
        raise ConfigError(f"--compile {name!r} is not a known target; name one of: {KNOWN}")
    model, nodes, per_node = m.group(1), int(m.group(2) or 1), int(m.group(3))
    if nodes < 1 or per_node < 1:
        raise ConfigError(f"--compile {name!r}: at least one node of one GPU; name one of: {KNOWN}")
    description = GPUS[model].gpu_target
    assert description, model  # every GPU of the table names its file (tests/test_gpu_aot.py)
    text = (importlib.resources.files("lclm") / "targets" / description).read_text()
    found = re.search(r"device_memory_size:\s*(\d+)", text)
    assert found, description  # every shipped description has it
    return Target(
        name.strip(),
        model,
        f"1x{nodes}x{per_node}",
        None,
        nodes * per_node,
        int(found.group(1)),
        platform="gpu",
        nodes=nodes,
        config_text=text,
    )


def tpu_target(name: str) -> Target:
    """`v4-64` -> Target('v4-64', 'v4:2x4x4', 'megacore', 32 devices, 32 GiB each)."""
    m = re.fullmatch(rf"({'|'.join(TPUS)})-(\d+)", name.strip().lower())
    if not m:
        raise ConfigError(
            f"--compile {name!r}: name a TPU slice as <generation>-<size>, e.g. "
            f"v4-64, v5e-16, v5p-128, v6e-32 (generations {sorted(TPUS)})"
        )
    generation, size = m.group(1), int(m.group(2))
    chip = TPUS[generation]
    cores, chip_config, ndim = chip.tpu_cores, chip.tpu_chip_config, chip.tpu_torus_dims
    chips = size // cores
    if size % cores or chips < 1 or chips & (chips - 1):
        raise ConfigError(
            f"--compile {name!r}: {generation} slices have a power-of-two number "
            f"of chips ({cores} TensorCore(s) each), e.g. {generation}-{8 * cores}"
        )
    dims = [1] * ndim
    for _ in range(chips.bit_length() - 1):  # a torus as close to a cube as the count allows
        dims[dims.index(min(dims))] *= 2
    dims = sorted(d for d in dims if d > 1) + [1] * dims.count(1)
    host = tuple(dims + [1] * (3 - ndim)) if chips < 4 else None
    return Target(
        name,
        generation,
        f"{generation}:{'x'.join(map(str, dims))}",
        chip_config,
        chips,
        int(chip.hbm_gib * 2**30),
        host,
    )


def target_devices(target: Target):
    """The target's devices as JAX describes them (no TPU or GPU needed; libtpu, or the CUDA
    plugin, is)."""
    if target.platform == "gpu":
        return _gpu_devices(target)
    try:
        import libtpu  # noqa: F401  (only to say what is missing)
    except ImportError:
        raise ConfigError(
            "--compile needs libtpu (it runs the TPU compiler on this machine): "
            "pip install 'lclm[tpu]'"
        ) from None
    _compiler_only_libtpu()
    kwargs: dict = {"chip_config_name": target.chip_config} if target.chip_config else {}
    if target.host_bounds:
        kwargs["chips_per_host_bounds"] = list(target.host_bounds)
    topology = topologies.get_topology_desc(platform="tpu", topology_name=target.topology, **kwargs)
    return list(topology.devices)


# Read by libtpu when JAX initialises it, so set before the first topology is described.
# The lock guards a TPU's chips against two processes; a compile-only libtpu opens none, and
# without this a concurrent JAX process that started libtpu (any JAX program on a machine with
# libtpu but no TPU, unless JAX_PLATFORMS leaves the TPU out) fails the compile with
# "ABORTED: ... libtpu multi-process lockfile". The other two describe a one-host TPU system
# in place of the missing local one: without them libtpu's start prints five lines about
# TPU_ACCELERATOR_TYPE, host bounds and TPU_WORKER_HOSTNAMES (the slice compiled for is given
# by the topology, which they do not change: same devices, same memory figures).
_COMPILER_ONLY_ENV = {
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
    "TPU_HOST_BOUNDS": "1,1,1",
    "TPU_WORKER_HOSTNAMES": "localhost",
}


def _compiler_only_libtpu() -> None:
    """Start libtpu as a compiler only where no TPU is attached; on a TPU VM its lock and
    its view of the host stay as they are (this process may run on the chips)."""
    if not tpu_attached():
        for name, value in _COMPILER_ONLY_ENV.items():
            os.environ.setdefault(name, value)


def _gpu_devices(target: Target):
    """Described GPUs: XLA:GPU's compiler runs on this machine; nothing touches a GPU."""
    if cuda_plugin() is None:
        raise ConfigError(
            f"--compile {target.name} needs JAX's CUDA plugin and ptxas (it runs "
            "the GPU compiler on this machine): pip install 'lclm[gpu-aot]'"
        )
    # The plugin registers its compiler only when its CUDA check passes or is skipped; with no
    # GPU the check fails (cuInit error) and the topology is "not implemented for cuda". JAX
    # skips the check when only the CPU is asked for, which is all a compile needs here.
    from jax._src import config as jax_config
    from jax._src import xla_bridge

    platforms = jax_config.jax_platforms.value
    if not xla_bridge.backends_are_initialized() and platforms is None:
        jax.config.update("jax_platforms", "cpu")
    elif (platforms or "").split(",") != ["cpu"] and not nvidia_gpu_attached():
        raise ConfigError(
            f"--compile {target.name} compiles for described GPUs, which needs "
            "JAX_PLATFORMS=cpu on a machine without one (JAX is set to "
            f"{platforms or 'its default platforms'} here)"
        )
    try:
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=target.config_text, topology=target.topology
        )
    except Exception as e:  # noqa: BLE001  (one line, not the plugin's traceback)
        raise ConfigError(
            f"--compile {target.name}: JAX's CUDA plugin could not describe the "
            f"GPUs ({str(e).splitlines()[0]})"
        ) from None
    return list(topology.devices)


def gpu_budget(target: Target) -> tuple[int, str]:
    """(bytes per GPU the step's program may take, how that was derived, one line): XLA:GPU
    compiles a program that is over HBM (its scheduler only logs it), so the fit is decided
    against this (`remat_choice.gpu_budget`)."""
    return gpu_pool_budget(target.hbm_bytes)


@dataclasses.dataclass
class Compiled:
    seconds: float
    arguments: int  # per-device bytes, as XLA's memory analysis reports them
    temporaries: int
    outputs: int
    aliased: int  # donated arguments reused as outputs (counted once)
    kernels: int  # fused-kernel custom calls (Mosaic TPU or GPU, Triton) in the program
    callbacks: int  # host callbacks in it (a kernel left in interpret mode would be one)
    conditionals: int = 0  # conditional ops (a host sync each on XLA:GPU), in the program text
    collectives: int = 0  # collective ops in the program text (one in a loop body counts once)
    host: int = 0  # host-memory bytes (remat='offload'), where XLA reports them
    # the attention kernels lowered, as the kernels' code noted them (`compile_step`)
    attention: Lowered = dataclasses.field(default_factory=Lowered)
    remat: str = ""  # the remat policy compiled
    remat_choice: str = ""  # model.remat='auto': what it chose and why, one line

    @property
    def total(self) -> int:
        return self.arguments + self.temporaries + self.outputs - self.aliased


def abstract_state(model: ModelConfig, optimizer, mesh):
    """The train state's shapes, dtypes and shardings on `mesh` (nothing allocated)."""
    shapes = jax.eval_shape(lambda: init_state(model, optimizer, mesh, 0))
    return jax.tree.map(
        lambda s, w: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=w),
        shapes,
        state_shardings(model, optimizer, mesh),
    )


@contextlib.contextmanager
def lowering_for(device):
    """Within: programs are traced and lowered for `device` (a described TPU or GPU), not the
    host's CPU. `compiling_for` tells impl='auto' and the kernels' limits what the device is
    (compute capability); on GPUs tokamax's ops also look at the default device while they
    lower, and jax's cuDNN checks read it (`cudnn_gpu.checks_for`). Only around the lowering:
    a compile under another default device fails ("no attribute 'local_devices'")."""
    gpu = device.platform in ("gpu", "cuda", "rocm")
    absl = logging.getLogger("absl")
    absl.addFilter(_no_autotuning_notes)
    try:
        with contextlib.ExitStack() as within:
            within.enter_context(compiling_for(device))
            if gpu:
                within.enter_context(jax.default_device(device))
                within.enter_context(cudnn_gpu.checks_for(device))
            yield
    finally:
        absl.removeFilter(_no_autotuning_notes)


def analyse(compiled, seconds: float) -> Compiled:
    """What lclm reads of a compiled program: XLA's memory analysis and counts in its text."""
    memory, text = compiled.memory_analysis(), compiled.as_text()
    # None only from a backend that cannot say (jax's annotation); XLA's backends answer both
    assert memory is not None and text is not None
    host = sum(
        getattr(memory, f"host_{k}_size_in_bytes", 0) or 0 for k in ("argument", "temp", "output")
    )
    return Compiled(
        seconds,
        memory.argument_size_in_bytes,
        memory.temp_size_in_bytes,
        memory.output_size_in_bytes,
        memory.alias_size_in_bytes,
        kernel_calls(text),
        len(re.findall(r'custom_call_target="[^"]*callback', text)),
        conditionals(text),
        sum(collectives(text).values()),
        host,
    )


def compile_step(config, devices, budget: int | None = None) -> Compiled:
    """Lower and compile the train step train.py builds for `config` on `devices` (abstract
    state and batch in their real shardings; nothing is allocated). `model.remat='auto'` is
    chosen as a run chooses it (`lclm.train.remat_choice`), against `budget` bytes per
    device (None: its first candidate). A compile error (HBM or VMEM overflow among them)
    propagates."""

    _, sections, sizes = checked(config, len(devices))
    mesh = make_mesh(**sizes, devices=devices[: math.prod(sizes.values())])
    model, optimizer = sections.model.resolved(), make_optimizer(sections.train)
    # outside the lowering's context (a described device runs nothing); no policy changes them
    state = abstract_state(model, optimizer, mesh)
    batch = abstract_batch(sections.data.batch_size, sections.data.seq_len, batch_sharding(mesh))

    def compile_policy(policy: str) -> tuple[Compiled, int]:
        m = dataclasses.replace(model, remat=policy)
        step = jit_train_step(
            m,
            sections.attention,
            sections.train,
            mesh,
            optimizer,
            state_shardings(m, optimizer, mesh),
            document_mask=sections.data.document_mask,
        )
        started = time.perf_counter()
        with lowering_for(devices[0]), recording() as attention:
            lowered = step.lower(state, batch)
        compiled = dataclasses.replace(
            analyse(lowered.compile(), time.perf_counter() - started),
            attention=attention,
            remat=policy,
        )
        return compiled, compiled.total

    if sections.model.remat != AUTO:
        return compile_policy(model.remat)[0]
    choice = choose(compile_policy, budget)
    assert isinstance(choice.compiled, Compiled)
    return dataclasses.replace(choice.compiled, remat_choice=choice.line())


def compile_eval(
    kind: str, model: ModelConfig, attention, mesh, rows: int, row: int, max_new: int = 0
) -> Compiled:
    """Lower and compile an evaluation program on `mesh` (over described devices): 'forward',
    perplexity's token losses (`lclm.eval.token_loss`) over `[rows, row]`, or 'decode', the
    prefill of `[rows, row]` prompts with `max_new` decode slots and one decode step
    (`lclm.eval.decode`), both with the parameters in their training shardings. Memory and
    counts are the larger program's (the prefill's); seconds both."""
    params = jax.tree.map(
        lambda shape, sharding: jax.ShapeDtypeStruct(
            shape, jax.numpy.dtype(model.param_dtype), sharding=sharding
        ),
        param_shapes(model),
        param_shardings(model, mesh),
        is_leaf=lambda x: isinstance(x, tuple),
    )
    tokens = jax.ShapeDtypeStruct((rows, row), jax.numpy.int32, sharding=batch_sharding(mesh))
    started = time.perf_counter()
    with lowering_for(mesh.devices.flat[0]), recording() as attention_calls:
        if kind == "forward":
            batch = dict(tokens=tokens, targets=tokens, positions=tokens, segment_ids=tokens)
            lowered = jax.jit(functools.partial(token_losses, model, attention, mesh)).lower(
                params, batch
            )
            return dataclasses.replace(
                analyse(lowered.compile(), time.perf_counter() - started), attention=attention_calls
            )
        run_prefill = jax.jit(
            functools.partial(prefill, model, attention, mesh=mesh, max_new=max_new, last=row - 1)
        )
        compiled = run_prefill.lower(params, tokens, tokens, tokens).compile()
        _, cache = jax.eval_shape(run_prefill, params, tokens, tokens, tokens)
        _, cache_shardings = compiled.output_shardings
        cache = jax.tree.map(
            lambda x, w: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=w), cache, cache_shardings
        )
        one = jax.ShapeDtypeStruct(
            (rows,), jax.numpy.int32, sharding=NamedSharding(mesh, PartitionSpec())
        )
        step = jax.ShapeDtypeStruct(
            (), jax.numpy.int32, sharding=NamedSharding(mesh, PartitionSpec())
        )
        jax.jit(functools.partial(decode_step, model, mesh=mesh)).lower(
            params, cache, one, one, step
        ).compile()
    return dataclasses.replace(
        analyse(compiled, time.perf_counter() - started), attention=attention_calls
    )


def _no_autotuning_notes(record: logging.LogRecord) -> bool:
    """tokamax warns once per kernel shape that it has no tuned config for the device: always
    so with no GPU to tune on (its default config is compiled), so not worth a line each."""
    return not str(record.msg).startswith("Autotuning cache miss")


# custom-call targets of fused kernels: Mosaic TPU, Pallas-Triton, Mosaic GPU (tokamax), cuDNN's
# fused attention (bench's baseline)
_KERNEL_TARGETS = re.compile(
    r'custom_call_target="(tpu_custom_call|__gpu\$xla\.gpu\.triton|'
    r'mosaic_gpu[^"]*|__cudnn\$fmha[^"]*)"'
)
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


def kernel_calls(text: str) -> int:
    """Fused-kernel custom calls in a compiled program's text."""
    return len(_KERNEL_TARGETS.findall(text))


def conditionals(text: str) -> int:
    """`conditional` ops in a compiled program's text (on XLA:GPU each copies its predicate to
    the host and waits). One per instruction line, whatever its result's shape (a tuple's
    has spaces in it)."""
    return len(re.findall(r"(?m)^\s*(?:ROOT\s+)?\S+ = [^\n]* conditional\(", text))


def collectives(text: str) -> dict[str, int]:
    """Collective ops per kind in a compiled program's text (async pairs count once)."""
    counts = {}
    for kind in _COLLECTIVES:
        n = len(re.findall(rf"\s{kind}(?:-start)?\(", text))
        if n:
            counts[kind] = n
    return counts

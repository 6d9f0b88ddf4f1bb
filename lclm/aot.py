"""Ahead-of-time compilation of the train step for a TPU slice, on a machine without a TPU.

With libtpu installed (`pip install 'lclm[tpu]'`), `jax.experimental.topologies` describes a
TPU slice's devices with no TPU present; lowering the step that train.py runs with abstract
arrays sharded over a mesh of those devices and compiling it runs the real XLA:TPU and Mosaic
compilers. Their per-device memory figures are what the run would allocate, and an HBM or
VMEM overflow is a compile error: found here, on a CPU, instead of at the first step of a
rented pod.

Slice names follow Cloud TPU's: `<generation>-<TensorCores>` for v4 and v5p (two
TensorCores per chip, used as one megacore device: v4-64 is 32 chips), `<generation>-<chips>`
for v5e and v6e (one TensorCore per chip).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time

import jax
import jax.numpy as jnp
from jax.experimental import topologies

from lclm import tpu_attached
from lclm.config import AttentionConfig, LlamaConfig
from lclm.data.loader import batch_sharding
from lclm.errors import ConfigError
from lclm.parallel.mesh import make_mesh
from lclm.train.setup import validate
from lclm.train.state import init_state, state_shardings
from lclm.train.step import jit_train_step, make_optimizer

# generation -> (TensorCores per chip, chip config, torus dimensions, HBM GiB per device)
GENERATIONS = {
    "v4": (2, "megacore", 3, 32),
    "v5p": (2, "megacore", 3, 95),
    "v5e": (1, None, 2, 16),
    "v6e": (1, None, 2, 32),
}


@dataclasses.dataclass(frozen=True)
class Target:
    name: str           # e.g. "v4-64"
    generation: str     # e.g. "v4"
    topology: str       # e.g. "v4:2x4x4", what jax.experimental.topologies takes
    chip_config: str | None
    devices: int        # JAX devices of the slice (chips)
    hbm_bytes: int      # per device
    # chips per host where a slice is smaller than the default host of 2x2x1 chips (libtpu
    # refuses such a topology otherwise): the whole slice on one host
    host_bounds: tuple[int, ...] | None = None


def tpu_target(name: str) -> Target:
    """`v4-64` -> Target('v4-64', 'v4:2x4x4', 'megacore', 32 devices, 32 GiB each)."""
    m = re.fullmatch(r"(v4|v5p|v5e|v6e)-(\d+)", name.strip().lower())
    if not m:
        raise ConfigError(f"--compile {name!r}: name a TPU slice as <generation>-<size>, e.g. "
                          f"v4-64, v5e-16, v5p-128, v6e-32 (generations {sorted(GENERATIONS)})")
    generation, size = m.group(1), int(m.group(2))
    cores, chip_config, ndim, hbm_gib = GENERATIONS[generation]
    chips = size // cores
    if size % cores or chips < 1 or chips & (chips - 1):
        raise ConfigError(f"--compile {name!r}: {generation} slices have a power-of-two number "
                          f"of chips ({cores} TensorCore(s) each), e.g. {generation}-{8 * cores}")
    dims = [1] * ndim
    for _ in range(chips.bit_length() - 1):  # a torus as close to a cube as the count allows
        dims[dims.index(min(dims))] *= 2
    dims = sorted(d for d in dims if d > 1) + [1] * dims.count(1)
    host = tuple(dims + [1] * (3 - ndim)) if chips < 4 else None
    return Target(name, generation, f"{generation}:{'x'.join(map(str, dims))}", chip_config, chips,
                  hbm_gib * 2**30, host)


def target_devices(target: Target):
    """The slice's devices as JAX describes them (no TPU needed; libtpu is)."""
    try:
        import libtpu  # noqa: F401  (only to say what is missing)
    except ImportError:
        raise ConfigError("--compile needs libtpu (it runs the TPU compiler on this machine): "
                          "pip install 'lclm[tpu]'") from None
    _compiler_only_libtpu()
    kwargs: dict = {"chip_config_name": target.chip_config} if target.chip_config else {}
    if target.host_bounds:
        kwargs["chips_per_host_bounds"] = list(target.host_bounds)
    topology = topologies.get_topology_desc(platform="tpu", topology_name=target.topology,
                                            **kwargs)
    return list(topology.devices)


# Read by libtpu when JAX initialises it, so set before the first topology is described.
# The lock guards a TPU's chips against two processes; a compile-only libtpu opens none, and
# without this a concurrent JAX process that started libtpu (any JAX program on a machine with
# libtpu but no TPU, unless JAX_PLATFORMS leaves the TPU out) fails the compile with
# "ABORTED: ... libtpu multi-process lockfile". The other two describe a one-host TPU system
# in place of the missing local one: without them libtpu's start prints five lines about
# TPU_ACCELERATOR_TYPE, host bounds and TPU_WORKER_HOSTNAMES (the slice compiled for is given
# by the topology, which they do not change: same devices, same memory figures).
_COMPILER_ONLY_ENV = {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "TPU_HOST_BOUNDS": "1,1,1",
                      "TPU_WORKER_HOSTNAMES": "localhost"}


def _compiler_only_libtpu() -> None:
    """Start libtpu as a compiler only where no TPU is attached; on a TPU VM its lock and
    its view of the host stay as they are (this process may run on the chips)."""
    if not tpu_attached():
        for name, value in _COMPILER_ONLY_ENV.items():
            os.environ.setdefault(name, value)


@dataclasses.dataclass
class Compiled:
    seconds: float
    arguments: int   # per-device bytes, as XLA's memory analysis reports them
    temporaries: int
    outputs: int
    aliased: int     # donated arguments reused as outputs (counted once)
    kernels: int     # fused-kernel custom calls (Mosaic) in the compiled program
    callbacks: int   # host callbacks in it (a kernel left in interpret mode would be one)

    @property
    def total(self) -> int:
        return self.arguments + self.temporaries + self.outputs - self.aliased


def compile_step(config, devices) -> Compiled:
    """Lower and compile the train step train.py builds for `config` on `devices` (abstract
    state and batch in their real shardings; nothing is allocated). A compile error (HBM or
    VMEM overflow among them) propagates."""

    sizes = validate(config, len(devices))
    mesh = make_mesh(**sizes, devices=devices[:math.prod(sizes.values())])
    model = LlamaConfig.from_config(config.model)
    optimizer = make_optimizer(config.train)
    where = state_shardings(model, optimizer, mesh)
    shapes = jax.eval_shape(lambda: init_state(model, optimizer, mesh, 0))
    state = jax.tree.map(lambda s, w: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=w),
                         shapes, where)
    d = config.data
    batch = {k: jax.ShapeDtypeStruct((d.batch_size, d.seq_len),
                                     jnp.float32 if k == "loss_mask" else jnp.int32,
                                     sharding=batch_sharding(mesh))
             for k in ("tokens", "targets", "loss_mask", "positions", "segment_ids")}
    step = jit_train_step(model, AttentionConfig.from_config(config.attention), config.train,
                          mesh, optimizer, where, document_mask=d.document_mask)
    started = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    seconds = time.perf_counter() - started
    memory, text = compiled.memory_analysis(), compiled.as_text()
    # None only from a backend that cannot say (jax's annotation); XLA's backends answer both
    assert memory is not None and text is not None
    return Compiled(seconds, memory.argument_size_in_bytes, memory.temp_size_in_bytes,
                    memory.output_size_in_bytes, memory.alias_size_in_bytes,
                    text.count("tpu_custom_call"),
                    len(re.findall(r'custom_call_target="[^"]*callback', text)))


def overflow(error: Exception) -> str | None:
    """'HBM' or 'VMEM' when a compile error is a memory overflow, else None."""
    text = str(error).lower()
    # "Ran out of memory in memory space vmem" (v4), "CompileTimeScopedVmemOom" (v5p),
    # "CompileTimeHbmOom", "Ran out of memory on HBM ... exceeds available HBM"
    for kind in ("vmem", "hbm"):
        if f"{kind}oom" in text or "ran out of memory" in text and kind in text:
            return kind.upper()
    if "exceeds the memory capacity" in text:
        return "HBM"
    return None

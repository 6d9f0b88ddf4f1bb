"""`model.remat='auto'`: per stage, the remat policy that recomputes least among those whose
compiled train step fits the device.

The candidates are tried in `AUTO_ORDER`, fastest first: 'none' (nothing recomputed), then
'attention' (the backward reruns the layer's projections and feed-forward, never the attention),
'full', 'offload'. Each is compiled for the run's own devices and shapes, and XLA's memory
analysis of the compiled program (arguments + outputs + temporaries, less donated buffers) is
held against the device's memory less what XLA does not count; the first that fits is the
run's, and its compiled program is the one the first step runs (JAX reuses it: no second
compile). A step that fits is therefore one compile, as with a named policy; each policy
that does not fit costs one more. The matmul policies ('dots', 'dots_no_batch') are not
candidates: what they keep depends on the kernel (the blockwise kernel's score tiles are
matmuls), so they are for runs that name them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import jax

from lclm.config.model import ModelConfig
from lclm.config.run_config import RunConfig
from lclm.data.loader import abstract_batch, batch_sharding
from lclm.errors import ConfigError
from lclm.train.step import jit_train_step

AUTO = "auto"
AUTO_ORDER = ("none", "attention", "full", "offload")
# A GPU's budget is what JAX's allocator may take (XLA_PYTHON_CLIENT_MEM_FRACTION of the
# memory, 0.75 by JAX's default; at most HBM less GPU_OUTSIDE_POOL, what lives outside the
# pool: the CUDA context (~0.5 GiB) and NCCL's buffers (channels x peers x 4 MiB, 1-2 GiB on a
# 32-GPU mesh)), less GPU_ALLOWANCE inside it for what memory_analysis does not count:
# cuBLAS/cuDNN workspaces (deviceless compiles size no cuDNN plan and autotune no GEMM) and the
# allocator's fragmentation. An attached GPU states its pool (`bytes_limit`); a described one
# (lclm.plan.aot) and the planner's are derived from HBM as JAX would size the pool.
GPU_OUTSIDE_POOL = 3 * 2**30
GPU_ALLOWANCE = 2**30
_JAX_DEFAULT_FRACTION = 0.75
_CPU_SHARE = 0.75  # of the host's memory, where a CPU device states no limit of its own
OVERFLOW = -1  # a candidate's need where the compiler refused it for memory


def compiled_bytes(compiled) -> int | None:
    """XLA's own estimate of a compiled program's device memory: arguments + outputs +
    temporaries, less donated buffers reused as outputs; None where the backend gives none."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return (
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        + stats.temp_size_in_bytes
        - stats.alias_size_in_bytes
    )


def gpu_budget(hbm_bytes: float) -> tuple[int, str]:
    """(bytes per GPU of `hbm_bytes` a step's program may take, how that was derived, one
    line), with the pool JAX would make there (its environment read as a run reads it)."""
    raw = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    try:
        fraction = float(raw) if raw else _JAX_DEFAULT_FRACTION
    except ValueError:
        raise ConfigError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={raw!r} is not a number") from None
    if os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR") == "platform":
        fraction = 1.0  # no pool: only what lives outside it is set aside
    pool = min(fraction * hbm_bytes, hbm_bytes - GPU_OUTSIDE_POOL)
    budget = int(pool - GPU_ALLOWANCE)
    how = (
        f"{budget / 2**30:.2f} GiB: XLA_PYTHON_CLIENT_MEM_FRACTION={fraction:g} of "
        f"{hbm_bytes / 2**30:.2f} GiB (at most HBM - {GPU_OUTSIDE_POOL / 2**30:g} GiB "
        f"for the CUDA context and NCCL), less {GPU_ALLOWANCE / 2**30:g} GiB for "
        "workspaces and fragmentation"
    )
    return budget, how


def device_budget(device: jax.Device) -> int | None:
    """Bytes a step's program may take on `device`: the allocator's limit (GPUs: less
    `GPU_ALLOWANCE`), or on a CPU `_CPU_SHARE` of the host's memory; None where neither is
    known."""
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        gpu = device.platform in ("gpu", "cuda", "rocm")
        return int(stats["bytes_limit"]) - (GPU_ALLOWANCE if gpu else 0)
    if device.platform == "cpu":
        try:
            return int(_CPU_SHARE * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        except (ValueError, OSError):
            return None
    return None


@dataclasses.dataclass(frozen=True)
class Choice:
    """The policy 'auto' chose, the compiled step it chose (None: the caller compiles), and
    what each candidate tried needed (bytes; None: the backend did not say; `OVERFLOW`: the
    compiler refused it for memory)."""

    policy: str
    compiled: object
    needed: dict[str, int | None]
    budget: int | None

    def line(self) -> str:
        """e.g. `model.remat='auto' -> 'attention': 40.2 GiB of the 74.3 GiB budget (none
        needs 95.1 GiB)`, for the start-up log."""
        budget = "" if self.budget is None else f" of the {self.budget / 2**30:.1f} GiB budget"
        others = "; ".join(
            f"{p} needs {_amount(b)}" for p, b in self.needed.items() if p != self.policy
        )
        return (
            f"model.remat='auto' -> {self.policy!r}: {_amount(self.needed[self.policy])}"
            f"{budget}" + (f" ({others})" if others else "")
        )


def _amount(needed: int | None) -> str:
    if needed == OVERFLOW:
        return "more than the device has (the compiler refused it)"
    if needed is None:
        return "an amount the backend does not report"
    return f"{needed / 2**30:.2f} GiB"


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


def choose(
    compile_policy: Callable[[str], tuple[object, int | None]], budget: int | None
) -> Choice:
    """The first policy of `AUTO_ORDER` whose program needs at most `budget` bytes (None: the
    first that compiles is taken); `compile_policy(policy)` -> (the compiled program, the
    bytes it needs or None where the backend does not say). A compile error that is a memory
    `overflow` (XLA:TPU refuses a program over HBM) counts as not fitting; any other
    propagates. None fits: a ConfigError naming the fixes."""
    needed: dict[str, int | None] = {}
    for policy in AUTO_ORDER:
        try:
            compiled, need = compile_policy(policy)
        except Exception as e:
            if overflow(e) is None:
                raise
            needed[policy] = OVERFLOW
            continue
        needed[policy] = need
        if budget is None or need is None or need <= budget:
            return Choice(policy, compiled, needed, budget)
    tried = "; ".join(f"{p} needs {_amount(b)}" for p, b in needed.items())
    raise ConfigError(
        f"model.remat='auto': no remat policy fits the device's "
        f"{(budget or 0) / 2**30:.1f} GiB budget ({tried}); shard more "
        "(mesh.fsdp, mesh.sp) or lower data.batch_size"
    )


def train_step(
    sections: RunConfig, model: ModelConfig, mesh, optimizer, state, state_sharding
) -> tuple[ModelConfig, Callable, str | None]:
    """(`model` with the remat policy its step compiles, the jitted train step, the log line
    of an 'auto' choice: None where `sections.model.remat` names the policy) for a run whose first
    state is `state` (`state_sharding`: its shardings)."""

    def jitted(m: ModelConfig):
        return jit_train_step(
            m,
            sections.attention,
            sections.train,
            mesh,
            optimizer,
            state_sharding,
            document_mask=sections.data.document_mask,
        )

    if sections.model.remat != AUTO:
        return model, jitted(model), None
    batch = abstract_batch(sections.data.batch_size, sections.data.seq_len, batch_sharding(mesh))
    steps = {}

    def compile_policy(policy: str):
        m = dataclasses.replace(model, remat=policy)
        steps[policy] = m, jitted(m)
        compiled = steps[policy][1].lower(state, batch).compile()
        return compiled, compiled_bytes(compiled)

    choice = choose(compile_policy, device_budget(mesh.devices.flat[0]))
    chosen, step = steps[choice.policy]
    return chosen, step, choice.line()

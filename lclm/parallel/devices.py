"""What XLA reads from the environment when JAX starts its backends: simulated CPU devices on
machines without an accelerator, safe CPU compiler flags, and the GPU's pinned host memory.

Both functions must run before JAX initialises its backends (importing it does not).
`request_cpu_devices`' flags only affect the CPU platform, so they are harmless on GPU/TPU
machines, where the accelerators are used and a mesh larger than them is a configuration
error; `allow_gpu_host_memory` only affects the GPU platform.
"""

from __future__ import annotations

import os

_FLAG = "--xla_force_host_platform_device_count"
# A CPU gains nothing from more simulated devices than this; larger meshes are a config error.
MAX_SIMULATED_DEVICES = 16


def available(devices) -> str:
    """What a mesh could use, said as what it is, for a message that ends 'needs N devices
    but ...': the accelerators ('1 gpu device'), or on a CPU the devices lclm simulated,
    whose count is not the machine's (capped at `MAX_SIMULATED_DEVICES` whatever its cores).
    `devices`: jax.devices()."""
    n, platform = len(devices), devices[0].platform
    if platform != "cpu":
        return f"this machine has {n} {platform} device{'s' * (n != 1)}"
    return (
        f"lclm simulates {n} CPU device{'s' * (n != 1)} on this machine "
        f"({os.cpu_count()} cores; at most {MAX_SIMULATED_DEVICES} are simulated on any)"
    )


# XLA's concurrency-optimised CPU scheduler let simulated devices of one program enter the
# ring's collective-permute and an FSDP all-gather in different orders: a deadlock that XLA
# aborts after 40 s (reproduced with jax 0.12 on 2 cores; gone with this flag).
CPU_FLAGS = ("--xla_cpu_enable_concurrency_optimized_scheduler=false",)
# Simulated devices run their programs' operations on one shared pool of XLA:CPU worker
# threads, and an in-process collective blocks its thread until every device has joined it.
# XLA orders a device's collectives only by when they start, so collectives that are ready
# at the same time (an FSDP gather beside a loop that holds gathers) run concurrently, each
# on its own thread. The pool is small (measured: 4 threads for 4 simulated devices on 2
# cores): devices with two collectives in flight each can block all of it while the device
# that would complete them waits for a thread, until XLA aborts after 40 s. Real GPUs and
# TPUs run one static schedule per device and never block a shared pool. XLA sizes the pool
# from the NPROC environment variable where it is set; idle threads cost nothing.
POOL_THREADS_PER_DEVICE = 4


def request_cpu_devices(n: int) -> None:
    """Ask XLA for `min(n, MAX_SIMULATED_DEVICES)` host devices (unless the environment already
    chose a count), set `CPU_FLAGS`, and give XLA:CPU's worker pool enough threads for that
    many devices' collectives (NPROC, unless set). No effect once JAX has started: call it
    first."""
    flags = os.environ.get("XLA_FLAGS", "")
    extra = [f for f in CPU_FLAGS if f.split("=")[0] not in flags]
    n = min(n, MAX_SIMULATED_DEVICES)
    if n > 1 and _FLAG not in flags:
        extra.append(f"{_FLAG}={n}")
    os.environ["XLA_FLAGS"] = " ".join([flags, *extra]).strip()
    simulated = n if _FLAG not in flags else _flag_count(flags)
    if simulated > 1 and "NPROC" not in os.environ:
        os.environ["NPROC"] = str(max(os.cpu_count() or 1, POOL_THREADS_PER_DEVICE * simulated))


# XLA:GPU's allocator of pinned host memory, where remat='offload' keeps activations, is
# capped unless this is set (in GiB): its default cap was below the 65 GiB that LLaMA-3.2-1B's
# 524,288-token step asks for at once (RESOURCE_EXHAUSTED on a 128 GiB H200 host, jax 0.11.2);
# with 115 it trained (bench/results/gpu-lease-h200/README.md, second lease)
GPU_HOST_MEMORY_LIMIT = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
HOST_MEMORY_SHARE = 0.9  # of the machine's memory, split between its processes


def allow_gpu_host_memory(local_processes: int = 1) -> None:
    """Let XLA:GPU's pinned host allocator grow to `HOST_MEMORY_SHARE` of this machine's
    memory, split between its `local_processes` (unless the environment already sets
    `GPU_HOST_MEMORY_LIMIT`). A cap, not a reservation: nothing is pinned until offloaded
    activations need it. No effect once JAX has started: call it first."""
    if GPU_HOST_MEMORY_LIMIT in os.environ:
        return
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no such query here: keep XLA's default
        return
    gib = int(total * HOST_MEMORY_SHARE / max(local_processes, 1) / 2**30)
    if gib > 0:
        os.environ[GPU_HOST_MEMORY_LIMIT] = str(gib)


def _flag_count(flags: str) -> int:
    """The device count an XLA_FLAGS string already asks for (1 if unreadable)."""
    for part in flags.split():
        if part.startswith(_FLAG + "="):
            try:
                return int(part.split("=", 1)[1])
            except ValueError:
                return 1
    return 1

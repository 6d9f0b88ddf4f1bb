"""Simulated CPU devices on machines without an accelerator, and safe CPU compiler flags.

`request_cpu_devices` must run before JAX initialises its backends (it sets XLA_FLAGS);
the flags only affect the CPU platform, so they are harmless on GPU/TPU machines, where the
accelerators are used and a mesh larger than them is a configuration error.
"""

from __future__ import annotations

import os

_FLAG = "--xla_force_host_platform_device_count"
# A CPU gains nothing from more simulated devices than this; larger meshes are a config error.
MAX_SIMULATED_DEVICES = 16
# XLA's concurrency-optimised CPU scheduler let simulated devices of one program enter the
# ring's collective-permute and an FSDP all-gather in different orders: a deadlock that XLA
# aborts after 40 s (reproduced with jax 0.12 on 2 cores; gone with this flag).
CPU_FLAGS = ("--xla_cpu_enable_concurrency_optimized_scheduler=false",)


def request_cpu_devices(n: int) -> None:
    """Ask XLA for `min(n, MAX_SIMULATED_DEVICES)` host devices (unless the environment already
    chose a count) and set `CPU_FLAGS`. No effect once JAX has started: call it first."""
    flags = os.environ.get("XLA_FLAGS", "")
    extra = [f for f in CPU_FLAGS if f.split("=")[0] not in flags]
    n = min(n, MAX_SIMULATED_DEVICES)
    if n > 1 and _FLAG not in flags:
        extra.append(f"{_FLAG}={n}")
    os.environ["XLA_FLAGS"] = " ".join([flags, *extra]).strip()

"""Which devices a run uses, and simulated CPU devices on machines without an accelerator.

`request_cpu_devices` must run before JAX initialises its backends (it sets XLA_FLAGS);
the flag only affects the CPU platform, so it is harmless on GPU/TPU machines, where the
accelerators are used and a mesh larger than them is a configuration error.
"""

from __future__ import annotations

import os

_FLAG = "--xla_force_host_platform_device_count"
# A CPU gains nothing from more simulated devices than this; larger meshes are a config error.
MAX_SIMULATED_DEVICES = 16


def request_cpu_devices(n: int) -> None:
    """Ask XLA for `min(n, MAX_SIMULATED_DEVICES)` host devices, unless the environment
    already chose a count. No effect once JAX has started: call it before the first JAX use."""
    flags = os.environ.get("XLA_FLAGS", "")
    n = min(n, MAX_SIMULATED_DEVICES)
    if n > 1 and _FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {_FLAG}={n}".strip()


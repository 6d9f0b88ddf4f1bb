"""Which devices a run uses, and simulated CPU devices when there are too few real ones.

`request_cpu_devices` must run before JAX initialises its backends (it sets XLA_FLAGS);
the flag only affects the CPU platform, so it is harmless on GPU/TPU machines.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)
_FLAG = "--xla_force_host_platform_device_count"


def request_cpu_devices(n: int) -> None:
    """Ask XLA for `n` host (CPU) devices, unless the environment already chose a count.

    Has no effect once JAX has started its backends: call it before the first JAX use."""
    flags = os.environ.get("XLA_FLAGS", "")
    if n > 1 and _FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {_FLAG}={n}".strip()


def select_devices(n: int | None):
    """The default backend's devices when it has `n` (None = all), else simulated CPU ones."""
    import jax
    devices = jax.devices()
    if n is None or len(devices) >= n:
        return devices
    cpus = jax.devices("cpu")
    if len(cpus) >= n:
        log.warning("the mesh needs %d devices and %s has %d: running on %d simulated CPU "
                    "devices", n, devices[0].platform, len(devices), len(cpus))
        return cpus
    return devices  # too few: validation reports the mismatch with a fix

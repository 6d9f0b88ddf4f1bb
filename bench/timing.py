"""Timing of jitted functions: compile once, warm up, median of several synchronised runs."""

from __future__ import annotations

import statistics
import time


def median_seconds(fn, *args, warmup: int = 1, iters: int = 5) -> tuple[float, float]:
    """(median seconds per call, seconds of the first call) of `fn(*args)`.

    The first call compiles and is reported separately; `warmup` more calls are discarded
    (allocator and autotuning effects); each timed call ends with `block_until_ready`, so
    asynchronous dispatch cannot hide device time. The median resists one-off stalls from
    other processes sharing the machine.
    """
    import jax

    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(max(iters, 1)):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), first

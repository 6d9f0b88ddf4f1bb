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


class Budget:
    """The wall-clock seconds a part may spend starting measurements (None: no limit).

    A quick part checks `spent()` before each row and reports the rows it did not start as
    skipped, so the part ends in about its budget plus one row, whatever the device's speed;
    `left()` bounds a child process's timeout.
    """

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self._end = None if seconds is None else time.monotonic() + seconds

    def left(self) -> float:
        return float("inf") if self._end is None else self._end - time.monotonic()

    def spent(self, need: float = 0.0) -> bool:
        """Whether less than `need` seconds are left."""
        return self.left() <= need

    def skipped(self) -> str:
        """The status of a row not started."""
        return f"skipped: the part's {self.seconds:g} s budget was spent"

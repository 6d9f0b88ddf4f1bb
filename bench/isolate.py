"""Run one measurement in a child process and read its result back.

Running out of device memory cannot be caught reliably in-process (the allocator may abort,
and a process's peak-memory counter never goes down), so probes that may not fit, and rows
whose peak memory is reported, run as `python -m <module> ...` children. A child prints one
`BENCH_RECORD {json}` line per result (`emit_record`); the parent parses them (`run_child`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from bench import ROOT

PREFIX = "BENCH_RECORD "
_PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"
# the user's own setting, before `launcher_process` changes it for this process
_USER_PREALLOCATE = os.environ.get(_PREALLOCATE)
# Out-of-memory messages of XLA (CPU/GPU/TPU) and of the operating system.
_OOM_MARKERS = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "MemoryError")


def emit_record(record: dict) -> None:
    """Child side: print a result for the parent."""
    print(PREFIX + json.dumps(record), flush=True)


def launcher_process() -> None:
    """Call before JAX starts in a process that launches measuring children: JAX would
    otherwise reserve most of the GPU's memory here at start-up, leaving the children short."""
    os.environ[_PREALLOCATE] = "false"


def child_env() -> dict:
    """The environment of a child: this one, with GPU memory nearly all usable.

    JAX preallocates 75% of GPU memory by default, which would report a smaller device; a
    0.95 fraction leaves room for the CUDA context. The user's explicit settings are kept.
    """
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    env.pop(_PREALLOCATE, None)
    if _USER_PREALLOCATE is not None:
        env[_PREALLOCATE] = _USER_PREALLOCATE
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    return env


def run_child(module: str, argv: list[str], timeout: float) -> tuple[list[dict], str]:
    """Run `python -m module *argv`; returns (its records, status).

    status is 'ok' (exit 0), 'OOM' (an out-of-memory message, or SIGKILL: how the kernel's OOM
    killer ends a process), 'timeout', or 'failed: <last error line>'.
    """
    try:
        proc = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True,
                              text=True, timeout=timeout, env=child_env(), cwd=ROOT)
    except subprocess.TimeoutExpired:
        return [], "timeout"
    records = [json.loads(line[len(PREFIX):]) for line in proc.stdout.splitlines()
               if line.startswith(PREFIX)]
    if proc.returncode == 0:
        return records, "ok"
    output = proc.stdout + proc.stderr
    if proc.returncode == -9 or any(m in output for m in _OOM_MARKERS):
        return records, "OOM"
    last = [line for line in proc.stderr.strip().splitlines() if line.strip()][-1:] or ["?"]
    return records, f"failed: {last[0][:120]}"

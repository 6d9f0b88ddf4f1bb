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
from bench.report import oom_status

PREFIX = "BENCH_RECORD "
_PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"
# the user's own setting, before `launcher_process` changes it for this process
_USER_PREALLOCATE = os.environ.get(_PREALLOCATE)


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


def run_child(
    module: str, argv: list[str], timeout: float, on_record=None
) -> tuple[list[dict], str]:
    """Run `python -m module *argv`; returns (its records, status).

    Records are read as the child prints them: `on_record(record)` is called for each one the
    moment it arrives (so the parent can write it down before the child ends, or is killed).
    status is 'ok' (exit 0), 'OOM: <the message's line>' (an out-of-memory message, or
    SIGKILL: how the kernel's OOM killer ends a process), 'timeout' (killed after `timeout`
    seconds), or 'failed: <last error line>'.
    """
    import tempfile
    import threading

    records: list[dict] = []
    output: list[str] = []
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *argv],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=child_env(),
            cwd=ROOT,
        )
        assert proc.stdout is not None  # stdout=PIPE
        stdout = proc.stdout
        expired = threading.Event()

        def kill():
            expired.set()
            proc.kill()

        timer = threading.Timer(timeout, kill)
        timer.start()
        try:
            for line in stdout:
                if line.startswith(PREFIX):
                    record = json.loads(line[len(PREFIX) :])
                    records.append(record)
                    if on_record is not None:
                        on_record(record)
                else:
                    output.append(line)
                    del output[:-200]  # the tail is enough for an error line
            returncode = proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:  # on_record raised: do not leave the child running
                proc.kill()
                proc.wait()
            stdout.close()
        err.seek(0)
        stderr = err.read()
    if expired.is_set():
        return records, "timeout"
    if returncode == 0:
        return records, "ok"
    text = "".join(output) + stderr
    if returncode == -9:  # how the kernel's OOM killer ends a process
        return records, "OOM: killed by SIGKILL (host memory?)"
    oom = oom_status(text)
    if oom:
        return records, oom
    last = [line for line in stderr.strip().splitlines() if line.strip()][-1:] or ["?"]
    return records, f"failed: {last[0][:120]}"

"""One live run per workdir: `<workdir>/lock` names the run that holds it.

Process 0 of a run creates the lock file atomically (`O_CREAT | O_EXCL`) with its host, pid
and process start time; every other process of the same multi-host run learns the outcome
from process 0, so the processes of one run never compete with each other. A second run on
the same workdir is refused. A lock whose holder is gone (same host, pid no longer running,
or the pid now belongs to a newer process) is taken over with a warning; a lock held from
another host cannot be checked from here, so the message says how to clear it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import time

from lclm.errors import StartupError

log = logging.getLogger(__name__)
LOCK_FILE = "lock"


class WorkdirBusy(StartupError):
    """Another live run holds the workdir."""


def _start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (tells a reused pid from the original), if known."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(holder: dict) -> bool:
    """Whether the process named in a lock on this host is still the one that wrote it."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        pass
    started = holder.get("start")
    return started is None or _start_time(pid) in (None, started)


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            holder = json.load(f)
        return holder if isinstance(holder, dict) else {}
    except (OSError, ValueError):
        return {}   # unreadable or half-written: treated as a holder that cannot be alive


def _describe(holder: dict) -> str:
    since = holder.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if since else "?"
    return f"pid {holder.get('pid')} on {holder.get('host')} since {when}"


class WorkdirLock:
    """`acquire()` at start, `release()` at the end (also on errors)."""

    def __init__(self, workdir: str):
        self.path = os.path.join(workdir, LOCK_FILE)
        self.mine = dict(host=socket.gethostname(), pid=os.getpid(),
                         start=_start_time(os.getpid()), since=time.time())
        self.held = False

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(self.mine, f)
        return True

    def _try(self) -> str | None:
        """Take the lock; None on success, else why not (one line)."""
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        if self._create():
            return None
        # Checking and replacing a stale lock is serialised between runs on this host, so
        # two runs that find the same dead holder cannot both take it over.
        with open(self.path + ".takeover", "a") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            holder = _read(self.path)
            if holder.get("host") not in (None, self.mine["host"]):
                return (f"workdir {os.path.dirname(self.path)} is held by a run of "
                        f"{_describe(holder)}; if that run is dead, delete {self.path}")
            if not holder and time.time() - os.path.getmtime(self.path) < 10:
                return (f"workdir {os.path.dirname(self.path)} is being taken by another run "
                        "right now")
            if holder and _alive(holder):
                return (f"workdir {os.path.dirname(self.path)} is in use by a live run "
                        f"({_describe(holder)}); stop it or use another workdir")
            log.warning("taking over the lock of a run that is gone (%s)", _describe(holder))
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)
            if self._create():
                return None
            return f"workdir {os.path.dirname(self.path)} was just taken by another run"

    def acquire(self) -> None:
        import jax
        import numpy as np
        from jax.experimental import multihost_utils

        why = None
        if jax.process_index() == 0:
            try:
                why = self._try()
            except OSError as e:
                why = f"cannot write the lock in {os.path.dirname(self.path)} ({e})"
        self.held = why is None and jax.process_index() == 0
        if jax.process_count() > 1:  # every process of the run stops, or none
            failed = multihost_utils.broadcast_one_to_all(np.int32(why is not None))
            if int(failed) and why is None:
                why = f"process 0 could not take the lock of {os.path.dirname(self.path)}"
        if why is not None:
            raise WorkdirBusy(why)

    def release(self) -> None:
        if self.held and _read(self.path).get("pid") == self.mine["pid"]:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)
        self.held = False

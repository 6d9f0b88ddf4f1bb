"""One live run per workdir: `<workdir>/lock` names the run that holds it, as a lease.

Process 0 of a run puts the lock in place (host, pid, process start time, lease, a random
token); every other process of the same multi-host run learns the outcome from process 0, so
the processes of one run never compete with each other. The lock is written under a
temporary name and hard-linked into place: `link` fails when the name exists, as `O_EXCL`
does, is atomic on NFS too, and nobody ever reads a half-written lock.

The holder renews its lease every lease/5 from a daemon thread. A second run is refused while
the lease is fresh; a lock not renewed for longer than the lease (the holder's, recorded in
the lock, or the newcomer's, whichever is longer) was left by a dead run (a lost node, a
requeued job) and is taken over with a warning. A lock of this host whose process is gone
(pid not running, or reused by a newer process) is taken over at once; one whose process
runs is refused whatever its lease.

Clock: renewing sets the lock's mtime to "now" (`os.utime(path, None)`), and a newcomer
measures the lease's age against the mtime it stamps the same way on a guard file beside it
(`<workdir>/lock.takeover`): both times come from the filesystem. On NFS a `utime` to "now"
is stamped by the server's clock, so the hosts' clocks do not enter at all; filesystems that
stamp with the writing client's clock (Lustre does) need the hosts' clocks to agree within a
small part of the lease, as NTP keeps them. A time written inside the file would always need
that, and rewriting the file to renew it could replace the lock of a run that has just taken
over: touching the mtime changes nothing else.

Takeover: runs on one host serialise on `flock` of the guard. Across hosts, the stale lock is
moved to a private name (only one run can move a given file), checked to be the very lock
judged stale (else put back), then ours is linked into place and read back. A run whose lock
was replaced anyway (taken over while its renewals could not reach the filesystem) learns it
at its next renewal: `lost()`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import tempfile
import threading
import time
import uuid

from lclm import storage
from lclm.errors import StartupError

log = logging.getLogger(__name__)
LOCK_FILE = "lock"
# `link` on filesystems without hard links (some FUSE mounts): the lock is created in place
_NO_HARD_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}
# `flock` on mounts without it (Lustre without -o flock): the moved-lock check still holds
_NO_FLOCK = {errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL}


class WorkdirBusy(StartupError):
    """Another live run holds the workdir."""


def _start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (tells a reused pid from the original), if known."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _pid(holder: dict) -> int | None:
    pid = holder.get("pid")
    return pid if isinstance(pid, int) and pid > 0 else None


def _alive(holder: dict, pid: int) -> bool:
    """Whether `pid`, named in a lock on this host, is still the process that wrote it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        pass
    started = holder.get("start")
    return started is None or _start_time(pid) in (None, started)


def _inspect(path: str) -> tuple[dict, os.stat_result] | None:
    """The lock's holder (empty if unreadable) and its stat, or None if there is no lock."""
    try:
        with open(path) as f:
            stat = os.fstat(f.fileno())  # after open: NFS revalidates attributes on open
            text = f.read()
    except FileNotFoundError:
        return None
    try:
        holder = json.loads(text)
    except ValueError:
        holder = {}
    return (holder if isinstance(holder, dict) else {}), stat


def _describe(holder: dict) -> str:
    if not holder:
        return "an unknown run (unreadable lock)"
    since = holder.get("since")
    when = (
        time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since))
        if isinstance(since, (int, float))
        else "?"
    )
    return f"pid {holder.get('pid')} on {holder.get('host')} since {when}"


@contextlib.contextmanager
def _guard(path: str):
    """Serialise takeovers between runs on this host; yields the filesystem's "now", stamped
    on the guard file (the clock the holder's renewals are stamped by)."""
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError as e:
            if e.errno not in _NO_FLOCK:
                raise
        os.utime(f.fileno(), None)
        yield os.fstat(f.fileno()).st_mtime


def _remove_stale(path: str, judged: os.stat_result, private: str) -> bool:
    """Remove the lock judged stale; False if what lies at `path` now is another lock (a
    racing run's, or the holder renewed): that one is put back."""
    try:
        os.rename(path, private)  # atomic: of two racing runs, one moves any given file
    except FileNotFoundError:
        return True  # another run removed it: linking ours into place decides
    found = _inspect(private)
    same = found is not None and (
        (found[1].st_ino, found[1].st_mtime_ns) == (judged.st_ino, judged.st_mtime_ns)
    )
    if same:
        os.remove(private)
    else:
        os.rename(private, path)
    return same


class WorkdirLock:
    """`acquire()` at start, `release()` at the end (also on errors); while held, `lost()`
    says whether another run took the lock over. Made by `lclm.workdir.object_lock.
    workdir_lock`, which picks the class by the path: a file lock taken on a gs:// path would
    guard a local './gs:/...' folder while the bucket stays open to every writer."""

    # whether the class keeps its lock in a bucket (lclm.workdir.object_lock.ObjectLock)
    OBJECT_STORE = False

    def __init__(self, workdir: str, lease_minutes: float = 10.0):
        if storage.is_remote(workdir) != self.OBJECT_STORE:
            raise TypeError(
                f"{type(self).__name__} cannot lock {workdir!r}; take a workdir's "
                "lock with lclm.workdir.object_lock.workdir_lock"
            )
        self.workdir = workdir
        self.path = os.path.join(workdir, LOCK_FILE)
        self.lease_minutes = lease_minutes
        self.mine = dict(
            host=socket.gethostname(),
            pid=os.getpid(),
            start=_start_time(os.getpid()),
            since=time.time(),
            lease_minutes=lease_minutes,
            token=uuid.uuid4().hex,
        )
        self.held = False
        self.renew_every = lease_minutes * 60 / 5  # seconds: several may fail within a lease
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self._lost: str | None = None
        self._failing = False  # renewals failing: logged when it starts and when it ends

    # -- taking the lock ------------------------------------------------------------------

    def _create(self) -> bool:
        """Put our lock in place unless a lock exists."""
        fd, tmp = tempfile.mkstemp(dir=self.workdir, prefix=f".{LOCK_FILE}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.mine, f)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
            try:
                os.link(tmp, self.path)
            except FileExistsError:
                return False
            except OSError as e:
                if e.errno not in _NO_HARD_LINKS:
                    raise
                return self._create_in_place()
            return True
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)

    def _create_in_place(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(self.mine, f)
        return True

    def _ours(self, found: tuple[dict, os.stat_result] | None) -> bool:
        return found is not None and found[0].get("token") == self.mine["token"]

    def _taken(self) -> str:
        return f"workdir {self.workdir} was just taken by another run"

    def _refusal(self, holder: dict, age: float) -> str | None:
        """Why the lock of `holder`, renewed `age` seconds ago, cannot be taken over; None
        (logged) if it can."""
        pid = _pid(holder)
        if holder.get("host") == self.mine["host"] and pid is not None:
            if _alive(holder, pid):
                return (
                    f"workdir {self.workdir} is in use by a live run ({_describe(holder)}); "
                    "stop it or use another workdir"
                )
            log.warning("taking over the lock of a run that is gone (%s)", _describe(holder))
            return None
        theirs = holder.get("lease_minutes")
        lease = 60 * max(self.lease_minutes, theirs if isinstance(theirs, (int, float)) else 0)
        if age < lease:
            left = lease - age
            until = time.strftime("%H:%M:%S", time.localtime(time.time() + left))
            return (
                f"workdir {self.workdir} is held by {_describe(holder)}, lease renewed "
                f"{max(age, 0):.0f} s ago; if that run is dead, its lease expires in "
                f"{left / 60:.1f} min (at {until}) and a new run takes the workdir over"
            )
        log.warning(
            "taking over the lock of %s: its lease was last renewed %.1f min ago (lease %.1f min)",
            _describe(holder),
            age / 60,
            lease / 60,
        )
        return None

    def _try(self) -> str | None:
        """Take the lock; None on success, else why not (one line)."""
        os.makedirs(self.workdir, exist_ok=True)
        if not self._create():
            with _guard(self.path + ".takeover") as now:
                found = _inspect(self.path)
                if self._ours(found):  # our link worked, its reply was lost: NFS's retry got EEXIST
                    return None
                if found is not None:
                    why = self._refusal(found[0], now - found[1].st_mtime)
                    if why is not None:
                        return why
                    private = os.path.join(self.workdir, f".{LOCK_FILE}.{self.mine['token']}")
                    if not _remove_stale(self.path, found[1], private):
                        return self._taken()
                if not self._create():
                    return self._taken()
        # a run taking over the same stale lock from another host may have replaced ours
        return None if self._ours(_inspect(self.path)) else self._taken()

    def acquire(self) -> None:
        import jax
        import numpy as np
        from jax.experimental import multihost_utils

        why = None
        if jax.process_index() == 0:
            try:
                why = self._try()
            except Exception as e:  # noqa: BLE001  (OSError here; any client's error in a bucket)
                why = f"cannot write the lock in {self.workdir} ({e})"
        self.held = why is None and jax.process_index() == 0
        if jax.process_count() > 1:  # every process of the run stops, or none
            failed = multihost_utils.broadcast_one_to_all(np.int32(why is not None))
            if int(failed) and why is None:
                why = f"process 0 could not take the lock of {self.workdir}"
        if why is not None:
            raise WorkdirBusy(why)
        if self.held:
            self._renewer = threading.Thread(
                target=self._renew_until_stopped, daemon=True, name="lclm-workdir-lease"
            )
            self._renewer.start()

    # -- holding it -------------------------------------------------------------------------

    def _renew(self) -> str | None:
        """Renew the lease; why the lock is no longer ours, or None. I/O errors are retried
        at the next renewal: the lease outlasts several of them."""
        try:
            holder = self._touch()
        except Exception as e:  # noqa: BLE001  (OSError here; any client's error in a bucket)
            if not self._failing:
                log.warning(
                    "cannot renew the lease of %s (%s); retrying every %.0f s",
                    self.path,
                    storage.error_text(e),
                    self.renew_every,
                )
            self._failing = True
            return None
        if self._failing:
            log.warning("the lease of %s is renewed again", self.path)
            self._failing = False
        if holder is None:
            return f"the lock {self.path} was deleted"
        if holder.get("token") != self.mine["token"]:
            return f"the lock {self.path} was taken over by {_describe(holder)}"
        return None

    def _touch(self) -> dict | None:
        """Renew the lock if it is ours (its mtime: the lease's clock); the holder found, or
        None where there is no lock."""
        found = _inspect(self.path)
        if self._ours(found):
            os.utime(self.path, None)
        return None if found is None else found[0]

    def _renew_until_stopped(self) -> None:
        while not self._stop.wait(self.renew_every):
            lost = self._renew()
            if lost is not None:
                log.error("%s: another run may be writing to %s", lost, self.workdir)
                self._lost = lost
                return

    def lost(self) -> str | None:
        """Why the held lock is no longer this run's (taken over or deleted), else None.
        Checked by process 0 only: the others hold nothing."""
        return self._lost

    def release(self) -> None:
        """Stop renewing and remove the lock if it is still ours. Never raises: the end of a
        run must not hide its outcome, and a lock left behind expires with its lease."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
            self._renewer = None
        if self.held:
            try:
                self._remove_if_ours()
            except Exception as e:  # noqa: BLE001  (OSError here; any client's error in a bucket)
                log.warning("could not remove the lock %s (%s)", self.path, storage.error_text(e))
        self.held = False

    def _remove_if_ours(self) -> None:
        if self._ours(_inspect(self.path)):
            os.remove(self.path)

"""The workdir lock as a lease: refused while its holder renews it, taken over once a dead
run's lease has run out, and a holder whose lock was taken over finds out. Locks of "another
host" are written by hand or taken under a patched host name; no train() (test_faults covers
a second run refused by train)."""

import errno
import json
import logging
import os
import socket
import time

import pytest

from lclm.workdir.lock import WorkdirBusy, WorkdirLock

LEASE = 0.02  # minutes: 1.2 s, renewed every 0.24 s


def _write(path, mtime=None, **holder):
    path.write_text(json.dumps(dict(dict(host="other-host", pid=1, since=time.time()), **holder)))
    if mtime is not None:
        os.utime(path, (mtime, mtime))


def _holder(path):
    return json.loads(path.read_text())


def _stop_renewing(lock):
    """What a lost node does: the lease is no longer renewed, the lock stays."""
    lock._stop.set()
    lock._renewer.join()


def test_a_fresh_lease_from_another_host_is_refused(tmp_path):
    _write(tmp_path / "lock", lease_minutes=10.0)
    with pytest.raises(
        WorkdirBusy,
        match=r"held by pid 1 on other-host since .*, lease renewed "
        r"0 s ago; if that run is dead, its lease expires in 10\.0 min \(at ",
    ):
        WorkdirLock(str(tmp_path)).acquire()
    assert _holder(tmp_path / "lock")["host"] == "other-host"


def test_an_expired_lease_is_taken_over_and_logged(tmp_path, caplog):
    _write(tmp_path / "lock", mtime=time.time() - 3600, lease_minutes=10.0)
    with caplog.at_level(logging.WARNING):
        lock = WorkdirLock(str(tmp_path))
        lock.acquire()
    assert "taking over the lock of pid 1 on other-host since " in caplog.text
    assert "last renewed 60.0 min ago (lease 10.0 min)" in caplog.text
    assert _holder(tmp_path / "lock")["pid"] == os.getpid()
    lock.release()
    assert sorted(os.listdir(tmp_path)) == ["lock.takeover"]  # no temporary file left


def test_the_longer_of_the_two_leases_counts(tmp_path):
    _write(tmp_path / "lock", mtime=time.time() - 3600, lease_minutes=120.0)
    with pytest.raises(WorkdirBusy, match=r"expires in 60\.0 min"):
        WorkdirLock(str(tmp_path), lease_minutes=10.0).acquire()
    _write(tmp_path / "lock", mtime=time.time() - 60, lease_minutes=LEASE)
    with pytest.raises(WorkdirBusy, match=r"expires in 9\.0 min"):
        WorkdirLock(str(tmp_path), lease_minutes=10.0).acquire()


def test_an_unreadable_lock_is_judged_by_its_lease(tmp_path, caplog):
    (tmp_path / "lock").write_text("{half-writ")
    with pytest.raises(WorkdirBusy, match="held by an unknown run"):
        WorkdirLock(str(tmp_path)).acquire()
    os.utime(tmp_path / "lock", (time.time() - 3600,) * 2)
    with caplog.at_level(logging.WARNING):
        lock = WorkdirLock(str(tmp_path))
        lock.acquire()
    assert "taking over the lock of an unknown run" in caplog.text
    lock.release()


def test_a_live_run_on_this_host_is_refused_whatever_its_lease(tmp_path):
    holder = WorkdirLock(str(tmp_path), lease_minutes=LEASE)
    holder.acquire()
    _stop_renewing(holder)
    os.utime(tmp_path / "lock", (time.time() - 3600,) * 2)
    with pytest.raises(WorkdirBusy, match=f"in use by a live run \\(pid {os.getpid()} on "):
        WorkdirLock(str(tmp_path), lease_minutes=LEASE).acquire()
    holder.release()
    assert not (tmp_path / "lock").exists()


def test_a_dead_or_reused_pid_on_this_host_is_taken_over_at_once(tmp_path, caplog):
    # pid 1 is alive, but it started long before the run that wrote this lock
    _write(tmp_path / "lock", host=socket.gethostname(), start="1", lease_minutes=10.0)
    with caplog.at_level(logging.WARNING):
        lock = WorkdirLock(str(tmp_path))
        lock.acquire()
    assert "taking over the lock of a run that is gone (pid 1 on " in caplog.text
    lock.release()


def test_renewals_keep_the_lease_until_the_holder_dies(tmp_path, monkeypatch, caplog):
    holder = WorkdirLock(str(tmp_path), lease_minutes=LEASE)
    holder.acquire()
    monkeypatch.setattr(socket, "gethostname", lambda: "other-host")
    newcomer = WorkdirLock(str(tmp_path), lease_minutes=LEASE)
    time.sleep(1.6)  # longer than the lease: only renewals keep it
    with pytest.raises(WorkdirBusy, match=r"lease renewed \d s ago"):
        newcomer.acquire()
    _stop_renewing(holder)
    time.sleep(1.5)
    with caplog.at_level(logging.WARNING):
        newcomer.acquire()
    assert f"taking over the lock of pid {os.getpid()} on {holder.mine['host']} " in caplog.text
    assert _holder(tmp_path / "lock")["host"] == "other-host"
    holder.release()  # not its lock any more: left alone
    assert _holder(tmp_path / "lock")["host"] == "other-host"
    newcomer.release()
    assert not (tmp_path / "lock").exists()


def _wait_for(condition):
    deadline = time.monotonic() + 5  # many renewals, even on a loaded machine
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)


def _wait_lost(lock):
    _wait_for(lambda: lock.lost() is not None)
    return lock.lost()


def test_a_lock_taken_over_or_deleted_is_reported_lost(tmp_path, caplog):
    lock = WorkdirLock(str(tmp_path), lease_minutes=LEASE)
    lock.acquire()
    assert lock.lost() is None
    replacement = tmp_path / "replacement"
    _write(replacement, token="theirs")
    os.replace(replacement, tmp_path / "lock")
    with caplog.at_level(logging.ERROR):
        assert "was taken over by pid 1 on other-host" in _wait_lost(lock)
    assert "another run may be writing to" in caplog.text
    lock.release()
    assert _holder(tmp_path / "lock")["token"] == "theirs"

    os.remove(tmp_path / "lock")
    lock = WorkdirLock(str(tmp_path), lease_minutes=LEASE)
    lock.acquire()
    os.remove(tmp_path / "lock")
    assert "was deleted" in _wait_lost(lock)
    lock.release()


def test_renewal_errors_are_logged_once_and_retried(tmp_path, monkeypatch, caplog):
    lock = WorkdirLock(str(tmp_path), lease_minutes=LEASE)
    lock.acquire()
    utime = os.utime

    def failing(path, *args, **kwargs):
        if path == lock.path:
            raise OSError(errno.EIO, "Input/output error")
        return utime(path, *args, **kwargs)

    with caplog.at_level(logging.WARNING):
        monkeypatch.setattr(os, "utime", failing)
        time.sleep(1.0)  # about four failed renewals
        monkeypatch.setattr(os, "utime", utime)
        _wait_for(lambda: "renewed again" in caplog.text)
    assert caplog.text.count("cannot renew the lease") == 1
    assert "Input/output error" in caplog.text and "renewed again" in caplog.text
    assert lock.lost() is None
    lock.release()


def test_a_takeover_that_finds_a_newer_lock_puts_it_back(tmp_path):
    """Two runs take over the same stale lock from two hosts: the slower one moves the
    faster one's new lock aside, sees it is not the lock it judged, and restores it."""
    _write(tmp_path / "lock", mtime=time.time() - 3600)
    lock = WorkdirLock(str(tmp_path))
    judge = lock._refusal

    def racer_wins(holder, age):
        _write(tmp_path / "replacement", token="racer")
        os.replace(tmp_path / "replacement", tmp_path / "lock")
        return judge(holder, age)

    lock._refusal = racer_wins
    with pytest.raises(WorkdirBusy, match="was just taken by another run"):
        lock.acquire()
    assert _holder(tmp_path / "lock")["token"] == "racer"
    assert sorted(os.listdir(tmp_path)) == ["lock", "lock.takeover"]


def test_without_hard_links_the_lock_is_created_in_place(tmp_path, monkeypatch):
    def no_links(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    lock = WorkdirLock(str(tmp_path))
    lock.acquire()
    assert _holder(tmp_path / "lock")["token"] == lock.mine["token"]
    with pytest.raises(WorkdirBusy, match="in use by a live run"):
        WorkdirLock(str(tmp_path)).acquire()
    lock.release()
    assert sorted(os.listdir(tmp_path)) == ["lock.takeover"]

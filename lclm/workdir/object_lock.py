"""The workdir lease of a run whose workdir is on object storage (gs://, s3://): the object
`<workdir>/lock`, kept with conditional writes.

The same lease as a local lock (lclm.workdir.lock: refusals, takeover of a stale lease, `lost`)
on what a bucket offers instead of links and renames. Every step is one conditional write,
so two runs (or a run and its own retried request) never both think they hold it:
- taking it: create the object only if there is none (GCS `ifGenerationMatch=0`, S3
  `If-None-Match: *`);
- renewing it: rewrite it only if it is still the version this run wrote last (GCS
  generation, S3 ETag); the store stamps the write's time;
- taking over a stale lease: replace it only if it is still the version judged stale.

Clock: the lease's age is the store's time now (the time it stamps on a probe object this run
writes) minus the store's time of the lock's last write; the hosts' clocks never enter.
"""

from __future__ import annotations

import json
import logging
import uuid

from lclm import storage
from lclm.workdir.lock import WorkdirLock

log = logging.getLogger(__name__)


class ObjectLock(WorkdirLock):
    """`WorkdirLock` for a gs:// or s3:// workdir."""

    OBJECT_STORE = True

    def __init__(self, workdir: str, lease_minutes: float = 10.0):
        super().__init__(workdir.rstrip("/"), lease_minutes)
        self.path = storage.join(self.workdir, "lock")
        self._data = json.dumps(self.mine).encode()

    def _found(self) -> tuple[dict, storage.Version] | None:
        found = storage.stat(self.path)
        if found is None:
            return None
        try:
            holder = json.loads(found[0])
        except ValueError:
            holder = {}
        return (holder if isinstance(holder, dict) else {}), found[1]

    def _now(self) -> float:
        """The store's clock now: the time it stamps on a probe object."""
        probe = storage.join(self.workdir, f".lock.clock.{uuid.uuid4().hex}")
        version = storage.create(probe, b"")
        storage.remove(probe)
        assert version is not None  # a fresh random name
        return version.updated

    def _try(self) -> str | None:
        if storage.create(self.path, self._data) is not None:
            return None
        found = self._found()
        if found is None:  # released between our write and our look: try once more
            return None if storage.create(self.path, self._data) else self._taken()
        holder, version = found
        if holder.get("token") == self.mine["token"]:  # our create worked, its reply was lost
            return None
        why = self._refusal(holder, self._now() - version.updated)
        if why is not None:
            return why
        return None if storage.replace_if(self.path, self._data, version) else self._taken()

    def _touch(self) -> dict | None:
        found = self._found()
        if found is not None and found[0].get("token") == self.mine["token"]:
            if storage.replace_if(self.path, self._data, found[1]) is None:
                found = self._found()  # replaced since we looked: say by whom
        return None if found is None else found[0]

    def _remove_if_ours(self) -> None:
        found = self._found()
        if found is not None and found[0].get("token") == self.mine["token"]:
            storage.remove(self.path)


def workdir_lock(workdir: str, lease_minutes: float = 10.0) -> WorkdirLock:
    """The lease lock of `workdir`: a file (lclm.workdir.lock), or for a gs:// or s3:// workdir
    an object. Every writer of a workdir (training, `lclm.convert --to-checkpoint`) takes its
    lock here; each class refuses the other's paths."""
    if storage.is_remote(workdir):
        return ObjectLock(workdir, lease_minutes)
    return WorkdirLock(workdir, lease_minutes)

"""The workdir lease of a run whose workdir is on object storage (gs://, s3://): the object
`<workdir>/lock`, kept with conditional writes.

The same lease as a local lock (lclm.train.lock: refusals, takeover of a stale lease, `lost`)
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
from lclm.train.lock import WorkdirLock, _describe

log = logging.getLogger(__name__)


class ObjectLock(WorkdirLock):
    """`WorkdirLock` for a gs:// or s3:// workdir."""

    def __init__(self, workdir: str, lease_minutes: float = 10.0):
        super().__init__(workdir.rstrip("/"), lease_minutes)
        self.path = storage.join(self.workdir, "lock")
        self._data = json.dumps(self.mine).encode()
        self._version: storage.Version | None = None   # of our lock's last write

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
        assert version is not None   # a fresh random name
        return version.updated

    def _try(self) -> str | None:
        self._version = storage.create(self.path, self._data)
        if self._version is not None:
            return None
        found = self._found()
        if found is None:   # released between our write and our look: try once more
            self._version = storage.create(self.path, self._data)
            return None if self._version is not None else self._taken()
        holder, version = found
        if holder.get("token") == self.mine["token"]:   # our create worked, its reply was lost
            self._version = version
            return None
        why = self._refusal(holder, self._now() - version.updated)
        if why is not None:
            return why
        self._version = storage.replace_if(self.path, self._data, version)
        return None if self._version is not None else self._taken()

    def _renew(self) -> str | None:
        try:
            found = self._found()
            if found is not None and found[0].get("token") == self.mine["token"]:
                renewed = storage.replace_if(self.path, self._data, found[1])
                if renewed is not None:
                    self._version = renewed
                else:   # replaced since we looked: who holds it now is the next renewal's
                    found = self._found()
        except Exception as e:  # noqa: BLE001  (each client has its own error types)
            if not self._failing:
                log.warning("cannot renew the lease of %s (%s); retrying every %.0f s",
                            self.path, e, self.renew_every)
            self._failing = True
            return None
        if self._failing:
            log.warning("the lease of %s is renewed again", self.path)
            self._failing = False
        if found is None:
            return f"the lock {self.path} was deleted"
        if found[0].get("token") != self.mine["token"]:
            return f"the lock {self.path} was taken over by {_describe(found[0])}"
        return None

    def _remove_if_ours(self) -> None:
        found = self._found()
        if found is not None and found[0].get("token") == self.mine["token"]:
            storage.remove(self.path)



def workdir_lock(workdir: str, lease_minutes: float = 10.0) -> WorkdirLock:
    """The lease lock of `workdir`: a file (lclm.train.lock), or for a gs:// or s3:// workdir
    an object."""
    if storage.is_remote(workdir):
        return ObjectLock(workdir, lease_minutes)
    return WorkdirLock(workdir, lease_minutes)

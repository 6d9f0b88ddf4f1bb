"""Paths that may be local or on object storage: every path a user gives lclm (a workdir, a
data file, an HF directory, an output folder) may be `gs://bucket/...` or `s3://bucket/...`.

A Cloud TPU pod slice has no shared filesystem, so its runs keep their workdirs in a bucket.
Local paths keep their own code (atomic renames, `O_APPEND`, hard links: lclm.writes,
lclm.workdir.lock); object-store paths go through fsspec's clients (gcsfs, s3fs), which read
the variables the cloud SDKs read (`STORAGE_EMULATOR_HOST`, `AWS_ENDPOINT_URL`, credentials).
Orbax writes checkpoint arrays through tensorstore (`TENSORSTORE_GCS_HTTP_URL`). What lclm
does by scheme (its client, conditional writes, whether checkpoints can be kept there) is one
entry of `SCHEMES`.

Object stores have no rename and no append; a single object write is atomic (readers see
the old object or the new one), which is what `write_bytes` relies on. Conditional writes
(`create`, `replace_if`: GCS generation preconditions, S3 `If-None-Match`/`If-Match`) are
what the workdir lease (lclm.workdir.object_lock) is built on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import posixpath
import re
import tempfile
import types
from collections.abc import Callable
from typing import Any

from lclm.errors import StartupError

log = logging.getLogger(__name__)

# how a missing client is installed: lclm's extra that lists every scheme's package
INSTALL = "pip install 'lclm[cloud]'"


@dataclasses.dataclass(frozen=True)
class Scheme:
    """An object store lclm reads and writes: an entry of `SCHEMES` (the end of this module),
    which every choice by a path's scheme asks."""

    name: str  # 'gs' of 'gs://bucket/x', also fsspec's name of the protocol
    client: str  # the module of fsspec's client, imported to find whether it is installed
    package: str  # the pip package that brings `client` (lclm's 'cloud' extra lists it)
    # an object's `Version` from the client's info (`fs.info`)
    version: Callable[[dict], Version]
    # write an object only if it is at `Version` (None: only if there is none), its new
    # version; raises the client's precondition error when refused. None: the store offers
    # no conditional writes, and so no workdir lease (lclm.workdir.object_lock)
    put_if: Callable[[Any, str, bytes, Version | None], Version] | None
    # a tool that mounts such a bucket as a local path (for what lclm cannot do there)
    mount: str
    # whether Orbax (0.12, lclm's checkpoint writer, through tensorstore) keeps checkpoints
    # there (lclm.workdir.checkpoint.path_problem)
    checkpoints: bool = False
    # the tensorstore context resource that bounds its driver's retries of one request (for
    # Orbax's reads and writes of checkpoint arrays)
    tensorstore_retries: str | None = None
    # `cat_file` keywords that read the object at the version of the client's info
    read_at: Callable[[dict], dict] = lambda info: {}
    # run before the client is imported (variables it reads once, at import)
    before_import: Callable[[], None] = lambda: None
    # run after it is imported: bound its retries of one request and how long one try waits
    # for the store (`REQUEST_SECONDS`), so that lclm's `storage_patience_seconds`, not the
    # client, decides how long a run waits for a bucket
    bound_requests: Callable[[], None] = lambda: None
    # the client's modules that log failed requests with tracebacks on their own, besides
    # its top logger (named as `client`): a logger's filters see only the records logged on it
    loggers: tuple[str, ...] = ()


def listing(where: Callable[[Scheme], bool] = lambda s: True, last: str = "") -> str:
    """The schemes that `where` accepts as a message names them ('gs:// or s3://'), `last`
    after them ('gs://, s3:// or a local or mounted path')."""
    items = [f"{s.name}://" for s in SCHEMES.values() if where(s)] + ([last] if last else [])
    return " or ".join(filter(None, (", ".join(items[:-1]), items[-1])))


def scheme(path: str) -> str | None:
    """'gs' for 'gs://bucket/x' (any 'scheme://' prefix), else None."""
    head, sep, _ = str(path).partition("://")
    return head if sep and head and "/" not in head else None


def is_remote(path: str) -> bool:
    return scheme(path) is not None


def client_problem(path: str) -> str | None:
    """Why `path`'s scheme cannot be used here (unknown, or its client is not installed);
    None for a local path or a usable scheme (whose client is then imported and set up)."""
    s = scheme(path)
    if s is None:
        return None
    if s not in SCHEMES:
        return (
            f"uses {s}://, which lclm does not read or write; use "
            f"{listing(last='a local or mounted path')}"
        )
    entry = SCHEMES[s]
    try:
        _import_client(entry)
    except ImportError:
        return f"is on {s}://, which needs the {entry.package} package: {INSTALL}"
    return None


def _import_client(entry: Scheme) -> None:
    """The one place a scheme's client is imported, and set up around its import."""
    entry.before_import()
    __import__(entry.client)
    entry.bound_requests()
    # from the first request on: a bucket unreachable at start is one line, not the client's
    # traceback of each request (its logger's filters see only the records logged on it)
    quiet_tracebacks((entry.client, *entry.loggers, "fsspec", "fsspec.asyn"))


def filesystem(path: str):
    """(fsspec filesystem, the path in its terms) for a local or object-store path; a
    StartupError naming the package when the scheme's client is missing."""
    problem = client_problem(path)
    if problem:
        raise StartupError(f"{path!r} {problem}")
    import fsspec

    s = scheme(path)
    if s is None:
        return fsspec.filesystem("file"), os.path.abspath(path)
    fs = fsspec.filesystem(s)
    return fs, fs._strip_protocol(path)


def join(path: str, *parts: str) -> str:
    """`os.path.join` for local paths, '/'-joined for object stores."""
    return posixpath.join(path, *parts) if is_remote(path) else os.path.join(path, *parts)


def basename(path: str) -> str:
    return posixpath.basename(path.rstrip("/")) if is_remote(path) else os.path.basename(path)


def dirname(path: str) -> str:
    return posixpath.dirname(path.rstrip("/")) if is_remote(path) else os.path.dirname(path)


def absolute(path: str) -> str:
    """A local path made absolute; an object-store path as it is (without a trailing '/')."""
    return path.rstrip("/") if is_remote(path) else os.path.abspath(path)


def exists(path: str) -> bool:
    if not is_remote(path):
        return os.path.exists(path)
    fs, p = filesystem(path)
    fs.invalidate_cache(p)
    return fs.exists(p)


def isdir(path: str) -> bool:
    """A local directory, or an object-store prefix holding at least one object."""
    if not is_remote(path):
        return os.path.isdir(path)
    fs, p = filesystem(path)
    fs.invalidate_cache(p)
    return fs.isdir(p)


def isfile(path: str) -> bool:
    if not is_remote(path):
        return os.path.isfile(path)
    fs, p = filesystem(path)
    fs.invalidate_cache(p)
    return fs.isfile(p)


def listdir(path: str) -> list[str]:
    """The names directly in `path` (files and folders); [] when there is none."""
    if not is_remote(path):
        return os.listdir(path) if os.path.isdir(path) else []
    fs, p = filesystem(path)
    fs.invalidate_cache(p)
    try:
        return sorted({posixpath.basename(e.rstrip("/")) for e in fs.ls(p, detail=False)})
    except FileNotFoundError:
        return []


def read_bytes(path: str) -> bytes:
    if not is_remote(path):
        with open(path, "rb") as f:
            return f.read()
    fs, p = filesystem(path)
    return fs.cat_file(p)


def read_text(path: str) -> str:
    return read_bytes(path).decode("utf-8")


def write_bytes(path: str, data: bytes, within: float | None = None) -> None:
    """`path` replaced by `data` whole: readers see the old contents or the new ones.
    `within`: seconds an object-store write may take in all (its request and the client's
    tries of it) before it is given up (`TimeoutError`); None: as long as the client's own
    bounds let it."""
    if not is_remote(path):
        _replace_local(path, data)
        return
    fs, p = filesystem(path)
    fs.pipe_file(p, data, timeout=within)  # fsspec's bound of the whole call


def error_text(error: BaseException) -> str:
    """A storage client's error in one line (a timeout has no message of its own)."""
    # every wait on the store is bounded by REQUEST_SECONDS (a try, or a whole write lclm
    # bounds by as much), and each client words its timeout its own way or not at all (fsspec:
    # no message; aiohttp: "Timeout on reading data from socket"; Orbax re-raises one as
    # "ChainedFuture completed 0/1 futures but timed out after 9.98 seconds")
    if timed_out(error):
        return f"no answer from the store within {REQUEST_SECONDS} s"
    text = " ".join(str(error).split())[:200]
    return text or type(error).__name__


def timed_out(error: BaseException) -> bool:
    """Whether `error`, or an error it was raised from, is a timeout."""
    seen: BaseException | None = error
    for _ in range(16):  # a chain is short; a cycle is not followed for ever
        if seen is None:
            return False
        if isinstance(seen, TimeoutError):
            return True
        seen = seen.__cause__
    return False


def _replace_local(path: str, data: bytes) -> None:
    """Write a temporary file beside `path`, flush it to disk, rename it onto `path`."""
    directory, name = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def remove(path: str) -> None:
    """Remove a file or object; nothing if it is not there."""
    if not is_remote(path):
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
        return
    fs, p = filesystem(path)
    try:
        fs.rm_file(p)
    except FileNotFoundError:
        pass


def remove_tree(path: str) -> None:
    """Remove a folder (or every object under a prefix) and all it holds."""
    fs, p = filesystem(path)
    fs.invalidate_cache(p)
    if fs.exists(p):
        fs.rm(p, recursive=True)


def move(path: str, target: str) -> None:
    """Move a file or folder to `target` (whose parent folders are made). On object storage
    this copies every object then deletes the originals: not atomic, so only for what no
    reader looks at meanwhile (a damaged checkpoint set aside)."""
    if not is_remote(path):
        os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
        os.rename(path, target)
        return
    fs, p = filesystem(path)
    _, t = filesystem(target)
    fs.invalidate_cache(p)
    fs.mv(p, t, recursive=True)


def forget_listings(path: str) -> None:
    """Drop the folder listings that every client of `path`'s object store in this process
    has cached (nothing for a local path). Orbax lists a checkpoint folder through its own
    gcsfs instance (etils.epath makes it with other options than `filesystem`'s), which
    keeps a step moved or deleted through lclm's instance in its listing: the manager,
    reloaded, would still count the step and refuse to save it again ('Checkpoint for step
    N already exists')."""
    if not is_remote(path):
        return
    fs, _ = filesystem(path)
    # fsspec keeps each instance of a filesystem class, one per set of options, in the
    # class's instance cache (what `clear_instance_cache` empties)
    for instance in list(type(fs)._cache.values()):
        instance.invalidate_cache()


def makedirs(path: str) -> None:
    """Create a local folder; object stores have no folders (a prefix exists once an object
    is written under it)."""
    if not is_remote(path):
        os.makedirs(path, exist_ok=True)


def open_file(path: str, mode: str = "rb"):
    """A file object: local, or an object read by ranged requests as it is read (seek and
    read fetch only what is asked for, in blocks)."""
    if not is_remote(path):
        return open(path, mode)
    fs, p = filesystem(path)
    return fs.open(p, mode)


def download(path: str, local: str) -> None:
    """Copy a file or a folder (recursively) from object storage to the local path `local`."""
    fs, p = filesystem(path)
    if fs.isdir(p):
        fs.get(p.rstrip("/") + "/", local.rstrip("/") + "/", recursive=True)
    else:
        fs.get_file(p, local)


def upload(local: str, path: str) -> None:
    """Copy a local file or folder (recursively) to object storage at `path`."""
    fs, p = filesystem(path)
    if os.path.isdir(local):
        fs.put(local.rstrip("/") + "/", p.rstrip("/") + "/", recursive=True)
    else:
        fs.put_file(local, p)


# -- errors ---------------------------------------------------------------------------------

# tensorstore reports a failed read or write (a full disk, a file gone) as a ValueError whose
# text starts with the status code
_STORAGE_STATUS = re.compile(
    r"(RESOURCE_EXHAUSTED|NOT_FOUND|PERMISSION_DENIED|UNAVAILABLE|"
    r"OUT_OF_RANGE|DATA_LOSS|ABORTED|DEADLINE_EXCEEDED|FAILED_PRECONDITION|"
    r"CANCELLED|UNKNOWN|INTERNAL): "
)


def is_io_error(e: BaseException | None) -> bool:
    """Whether `e`, or an exception it was raised from or while handling, is a storage
    error: an OSError, or tensorstore's wrapping of one."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) or _STORAGE_STATUS.match(str(e)):
            return True
        e = e.__cause__ or e.__context__
    return False


class OneLineStorageErrors(logging.Filter):
    """Orbax's save threads each log a failed write (one full disk: half a dozen records with
    tracebacks, an unreachable bucket: one per thread of the save), asyncio and the storage
    clients (gcsfs, fsspec: '_request out of retries', 'Consumer caught an error', for every
    request while a bucket is unreachable) report the same failures again with 50-line
    tracebacks, while lclm reports the failure itself in one line (`SaveFailed`, a failed
    metrics write, a one-line error at start): such records are not shown, only kept in one
    line at DEBUG under lclm's logger. So is the record of a failed save's thread that Orbax
    leaves running and that finds the interpreter shutting down at exit. Errors that are not
    storage errors keep their tracebacks."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is None:
            return True
        if not (
            is_io_error(error)
            or (
                isinstance(error, RuntimeError)
                and "cannot schedule new futures after" in str(error)
            )
        ):
            return True
        if record.name != "asyncio":  # asyncio's repeat Orbax's unawaited tasks at exit
            message = (record.getMessage().strip().splitlines() or [""])[0]
            log.debug("%s: %s (%s)", record.name, message, error_text(error))
        return False


def quiet_tracebacks(names) -> None:
    """The loggers `names` show storage errors in one line (`OneLineStorageErrors`)."""
    for name in names:
        logger = logging.getLogger(name)
        if not any(isinstance(f, OneLineStorageErrors) for f in logger.filters):
            logger.addFilter(OneLineStorageErrors())


# -- conditional writes (the workdir lease) ---------------------------------------------------


class Version:
    """What a conditional write compares: a GCS object's generation, an S3 object's ETag;
    and the store's own time of the object's last write (seconds since the epoch)."""

    def __init__(self, tag: str, updated: float):
        self.tag, self.updated = tag, updated

    def __eq__(self, other):
        return isinstance(other, Version) and other.tag == self.tag

    def __hash__(self):
        return hash(self.tag)

    def __repr__(self):
        return f"Version({self.tag!r})"


def stat(path: str) -> tuple[bytes, Version] | None:
    """An object's contents and version, or None if there is no such object. The contents
    are read at the version looked up where the store can (GCS): an object replaced in
    between is looked up again (not reported missing)."""
    fs, p = filesystem(path)
    entry = SCHEMES[scheme(path) or ""]
    for _ in range(5):
        fs.invalidate_cache(p)
        try:
            info = fs.info(p)
        except FileNotFoundError:
            return None
        try:
            data = fs.cat_file(p, **entry.read_at(info))
        except FileNotFoundError:  # replaced (or removed) since `info`: look again
            continue
        return data, entry.version(info)
    return None


def _precondition_failed(error: BaseException) -> bool:
    """A conditional write refused: gcsfs maps HTTP 412 to FileExistsError; s3fs turns
    botocore's PreconditionFailed (or a concurrent write's ConditionalRequestConflict) into
    an OSError that keeps only the message."""
    if isinstance(error, FileExistsError):
        return True
    text = f"{error} {error.__cause__ or ''}"
    return any(
        word in text
        for word in ("pre-condition", "PreconditionFailed", "ConditionalRequestConflict")
    )


def create(path: str, data: bytes) -> Version | None:
    """Write the object `path` only if there is none; its version, or None if one exists."""
    return _conditional_put(path, data, None)


def replace_if(path: str, data: bytes, version: Version) -> Version | None:
    """Replace the object `path` only if it is still at `version`; the new version, or None
    if it changed (or is gone)."""
    return _conditional_put(path, data, version)


def _conditional_put(path: str, data: bytes, version: Version | None) -> Version | None:
    fs, p = filesystem(path)
    entry = SCHEMES.get(scheme(path) or "")
    if entry is None or entry.put_if is None:
        raise StartupError(
            f"{path!r}: conditional writes need {listing(lambda s: s.put_if is not None)}"
        )
    try:
        return entry.put_if(fs, p, data, version)
    except Exception as e:  # noqa: BLE001 (each client has its own error types)
        if _precondition_failed(e) or isinstance(e, FileNotFoundError):
            return None
        raise


# -- the clients' quirks ------------------------------------------------------------------------

# tries of one request by gcsfs (its own: 6, about 33 s of pauses): a blip of a few seconds is
# ridden out by the client, anything longer by lclm's `storage_patience_seconds`, which decides
# when a run stops (with the client's 6 tries, every request of a stop during an outage cost
# 33 s, and a run past its patience took minutes to stop)
GCS_TRIES = 3

# how long one try of a request may wait for the store: to connect, or for the next byte of
# its answer (a transfer that moves on is never cut). The clients' own: forever (gcsfs,
# tensorstore), so a bucket that accepts connections and never answers (a stalled proxy, a
# black-holed route) hung a run, its SIGTERM and its exit (Python waits for Orbax's save
# threads). A real store's first byte comes within a second or two.
REQUEST_SECONDS = 10


def _bound_gcs_requests() -> None:
    """Give gcsfs's request method `GCS_TRIES` tries (pauses of about 1 and 2 s), and each try
    `REQUEST_SECONDS` to connect and between the bytes of the answer. gcsfs fixes the count
    when its class is defined (a decorator argument, not an option), so the undecorated method
    is decorated again, once per process; the wait is an option (`requests_timeout`), given to
    every instance (lclm's and Orbax's, made through etils.epath with other options) as
    fsspec's configured default for the protocol."""
    import aiohttp
    import fsspec.config
    from gcsfs.core import GCSFileSystem
    from gcsfs.retry import retry_request

    request = GCSFileSystem._request
    if getattr(request, "_lclm_tries", None) != GCS_TRIES:
        bounded = retry_request(retries=GCS_TRIES)(_unanswered_not_retried(request.__wrapped__))
        bounded._lclm_tries = GCS_TRIES
        GCSFileSystem._request = bounded
    wait = aiohttp.ClientTimeout(sock_connect=REQUEST_SECONDS, sock_read=REQUEST_SECONDS)
    for protocol in GCSFileSystem.protocol:
        fsspec.config.conf.setdefault(protocol, {}).setdefault("requests_timeout", wait)


def _unanswered_not_retried(request):
    """gcsfs's undecorated request method, whose try that the store left unanswered for
    `REQUEST_SECONDS` is not tried again by gcsfs (a store that stays silent would cost each
    request three times that): the run's patience decides when to try again. A refused or
    cut connection is still retried (seconds)."""
    import functools

    import aiohttp

    @functools.wraps(request)
    async def once_if_unanswered(*args, **kwargs):
        try:
            return await request(*args, **kwargs)
        except aiohttp.ServerTimeoutError as e:  # a ClientError: gcsfs would retry it
            raise TimeoutError(f"no answer from the store within {REQUEST_SECONDS} s") from e

    return once_if_unanswered


def _quiet_emulator_probe() -> None:
    """gcsfs asks each bucket over gRPC whether it is a zonal bucket; a local GCS server
    serves no gRPC and every probe waits 60 s before falling back (and logs a warning per
    call). Only with an emulator, and before gcsfs is imported: it reads the variable once,
    to choose its filesystem class."""
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


def _gcs_version(info: dict) -> Version:
    return Version(str(info["generation"]), info["mtime"].timestamp())


def _s3_version(info: dict) -> Version:
    return Version(str(info["ETag"]), info["LastModified"].timestamp())


def _gcs_put_if(fs, path: str, data: bytes, version: Version | None) -> Version:
    from fsspec.asyn import sync

    info = sync(fs.loop, _gcs_put, fs, path, data, "0" if version is None else version.tag)
    return _gcs_version(fs._process_object(path.split("/", 1)[0], info))


def _s3_put_if(fs, path: str, data: bytes, version: Version | None) -> Version:
    from fsspec.asyn import sync

    bucket, key = path.split("/", 1)
    condition = {"IfNoneMatch": "*"} if version is None else {"IfMatch": version.tag}
    reply = sync(fs.loop, fs._call_s3, "put_object", Bucket=bucket, Key=key, Body=data, **condition)
    fs.invalidate_cache(path)
    return Version(str(reply["ETag"]), _s3_time(fs, path, str(reply["ETag"])))


def _s3_time(fs, path: str, etag: str) -> float:
    """The store's time of the write that gave `etag` (S3's reply to a put carries none)."""
    import time

    try:
        info = fs.info(path)
    except FileNotFoundError:
        return time.time()
    return info["LastModified"].timestamp() if str(info["ETag"]) == etag else time.time()


async def _gcs_put(fs, path: str, data: bytes, generation: str) -> dict:
    """One multipart upload with `ifGenerationMatch` (0: only if absent); the object's
    metadata. gcsfs's own uploads take only the 'absent' condition."""
    import json
    from urllib.parse import quote

    bucket, key = path.split("/", 1)
    meta = json.dumps({"name": key})
    body = (
        b"--==0==\nContent-Type: application/json; charset=UTF-8\n\n"
        + meta.encode()
        + b"\n--==0==\nContent-Type: application/octet-stream\n\n"
        + data
        + b"\n--==0==--"
    )
    out = await fs._call(
        "POST",
        f"{fs._location}/upload/storage/v1/b/{quote(bucket)}/o",
        uploadType="multipart",
        ifGenerationMatch=generation,
        headers={"Content-Type": 'multipart/related; boundary="==0=="'},
        data=body,
        json_out=True,
    )
    fs.invalidate_cache(path)
    return out


# -- the schemes --------------------------------------------------------------------------------

# Adding a store is one entry here (with its client's quirks above, if it has any): the
# messages that name the schemes lclm reads, writes conditionally or keeps checkpoints on are
# made from it, and lclm's 'cloud' extra (pyproject.toml) lists its package.
SCHEMES = types.MappingProxyType(
    {
        s.name: s
        for s in (
            Scheme(
                "gs",
                client="gcsfs",
                package="gcsfs",
                version=_gcs_version,
                put_if=_gcs_put_if,
                mount="gcsfuse",
                checkpoints=True,
                tensorstore_retries="gcs_request_retries",
                read_at=lambda info: {"generation": info["generation"]},
                before_import=_quiet_emulator_probe,
                bound_requests=_bound_gcs_requests,
                loggers=("gcsfs.credentials", "gcsfs.zonal_file"),
            ),
            # Orbax 0.12 writes arrays to GCS and file paths only
            Scheme(
                "s3",
                client="s3fs",
                package="s3fs",
                version=_s3_version,
                put_if=_s3_put_if,
                mount="mountpoint-s3",
            ),
        )
    }
)

"""Writing a file so that nobody ever sees it half-written: readers, a crash and a full disk
leave either the old file or the new one whole.

The data goes to a temporary file in the same directory (so the rename stays on one
filesystem), is flushed to disk, then `os.replace`d onto the target: a reader that opened the
old file (or memory-mapped it) keeps reading the old inode.

Every CLI asks `check_output` about each path it will write (and `check_input` about the
paths it reads) before its work, so that an hour of evaluation or tokenising is never lost
to an output that could not have been written.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
import uuid

from lclm import storage
from lclm.errors import StartupError


@contextlib.contextmanager
def replacing(path: str, mode: int = 0o644, binary: bool = False):
    """`with replacing(path) as f: f.write(...)`: `path` is replaced when the block ends
    without an error; on an error the temporary file is removed and `path` is untouched.
    `mode`: the new file's permissions (0o644: readable by every user, whatever the umask).
    On object storage (gs://, s3://) the contents are written as one object at the end (a
    single write is atomic there)."""
    if storage.is_remote(path):
        buffer = io.BytesIO() if binary else io.StringIO()
        yield buffer
        data = buffer.getvalue()
        storage.write_bytes(path, data if isinstance(data, bytes) else data.encode("utf-8"))
        return
    directory, name = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if binary else "w") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def write_json(path: str, obj, mode: int = 0o644) -> None:
    """`obj` as indented JSON at `path`, replaced atomically."""
    with replacing(path, mode) as f:
        json.dump(obj, f, indent=1)
        f.write("\n")


def output_problem(path: str, folder: bool = True, remote: bool = False) -> str | None:
    """Why a CLI could not write `path` (a folder it would create or fill, or with
    `folder=False` a file it would replace), found before any work rather than after it; None
    when it can. `remote`: the CLI writes gs:// and s3:// paths (through lclm.storage);
    others refuse them (a local './gs:/...' folder would not be what was meant). Creates
    nothing: the probe is a temporary file in the nearest existing directory (on object
    storage: a temporary object beside `path`), removed at once."""
    if not path:  # os.path.abspath('') is the current directory: never what was meant
        return "is empty; pass a path"
    if storage.is_remote(path):
        if not remote:
            return (
                f"is on object storage ({storage.scheme(path)}://), which this command "
                "does not write; write to a local or mounted path and copy it"
            )
        return storage.client_problem(path) or _object_store_problem(path, folder)
    target = os.path.abspath(path)
    if os.path.exists(target):
        if folder and not os.path.isdir(target):
            return "is a file; pass a folder"
        if not folder and os.path.isdir(target):
            return "is a folder; pass a file name"
    elif os.path.islink(target):  # makedirs and open would fail on it, or write elsewhere
        return "is a broken symbolic link; pass another path"
    existing = target if folder else os.path.dirname(target)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"cannot be made: {existing!r} is a file; pass another path"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        return f"cannot be written: {existing!r}: {e.strerror or e}; pass a writable path"
    if os.path.exists(target) and not folder and not os.access(target, os.W_OK):
        return "cannot be written (no write permission); pass a writable path"
    return None


def _object_store_problem(path: str, folder: bool) -> str | None:
    """Why `path` on object storage cannot be written: the bucket is missing, or refuses
    this process's writes (credentials, scopes, a read-only bucket)."""
    probe = storage.join(
        path if folder else storage.dirname(path), f".lclm-write-probe-{uuid.uuid4().hex}"
    )
    try:
        storage.write_bytes(probe, b"")
        storage.remove(probe)
    except Exception as e:  # noqa: BLE001 (each client has its own error types)
        text = " ".join(str(e).split())[:200] or type(e).__name__
        return f"cannot be written ({text}); check the bucket's name and this machine's access"
    return None


def input_problem(path: str) -> str | None:
    """Why a CLI could not read the input `path` names, found before it looks: a scheme lclm
    cannot read, or whose client is not installed; None otherwise (a missing file is for its
    reader to report, in its own words)."""
    return storage.client_problem(path)


def check_output(flag: str, path: str, folder: bool = True, remote: bool = False) -> None:
    """A StartupError `FLAG 'PATH' <why>` where `output_problem` finds one."""
    problem = output_problem(path, folder, remote)
    if problem:
        raise StartupError(f"{flag} {path!r} {problem}")


def check_input(flag: str, path: str | None) -> None:
    """A StartupError `FLAG 'PATH' <why>` where `input_problem` finds one (None: not given)."""
    problem = input_problem(path) if path else None
    if problem:
        raise StartupError(f"{flag} {path!r} {problem}")

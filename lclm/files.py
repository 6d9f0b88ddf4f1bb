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
import json
import os
import tempfile

from lclm.errors import StartupError


@contextlib.contextmanager
def replacing(path: str, mode: int = 0o644, binary: bool = False):
    """`with replacing(path) as f: f.write(...)`: `path` is replaced when the block ends
    without an error; on an error the temporary file is removed and `path` is untouched.
    `mode`: the new file's permissions (0o644: readable by every user, whatever the umask)."""
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


def _scheme(path: str) -> str | None:
    """'gs' for 'gs://bucket/x' (any 'scheme://' prefix), else None."""
    head, sep, _ = path.partition("://")
    return head if sep and head and "/" not in head else None


def output_problem(path: str, folder: bool = True) -> str | None:
    """Why a CLI could not write `path` (a folder it would create or fill, or with
    `folder=False` a file it would replace), found before any work rather than after it; None
    when it can. Creates nothing: the probe is a temporary file in the nearest existing
    directory, removed at once."""
    if not path:   # os.path.abspath('') is the current directory: never what was meant
        return "is empty; pass a path"
    scheme = _scheme(path)
    if scheme:   # until object stores are supported: a local './gs:/...' folder is not one
        return (f"is on object storage ({scheme}://), which this command cannot write yet; "
                "write to a local or mounted path (e.g. gcsfuse) and copy it")
    target = os.path.abspath(path)
    if os.path.exists(target):
        if folder and not os.path.isdir(target):
            return "is a file; pass a folder"
        if not folder and os.path.isdir(target):
            return "is a folder; pass a file name"
    elif os.path.islink(target):   # makedirs and open would fail on it, or write elsewhere
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


def input_problem(path: str) -> str | None:
    """Why a CLI could not read the input `path` names, found before it looks: a 'scheme://'
    path until object stores are supported (looked up locally, it would be reported missing
    as './gs:/...'); None otherwise (a missing file is for its reader to report, in its own
    words)."""
    scheme = _scheme(path)
    if scheme:
        return (f"is on object storage ({scheme}://), which this command cannot read yet; "
                "copy it to a local or mounted path (e.g. gcsfuse) and pass that")
    return None


def check_output(flag: str, path: str, folder: bool = True) -> None:
    """A StartupError `FLAG 'PATH' <why>` where `output_problem` finds one."""
    problem = output_problem(path, folder)
    if problem:
        raise StartupError(f"{flag} {path!r} {problem}")


def check_input(flag: str, path: str | None) -> None:
    """A StartupError `FLAG 'PATH' <why>` where `input_problem` finds one (None: not given)."""
    problem = input_problem(path) if path else None
    if problem:
        raise StartupError(f"{flag} {path!r} {problem}")

"""Writing a file so that nobody ever sees it half-written: readers, a crash and a full disk
leave either the old file or the new one whole.

The data goes to a temporary file in the same directory (so the rename stays on one
filesystem), is flushed to disk, then `os.replace`d onto the target: a reader that opened the
old file (or memory-mapped it) keeps reading the old inode.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile


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

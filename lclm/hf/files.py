"""Files and directories of an export, readable by every user whatever the umask: files
0o644, directories 0o755."""

import os


def world_readable(path: str, directory: bool = False) -> None:
    os.chmod(path, 0o755 if directory else 0o644)


def make_dir(path: str) -> None:
    """`os.makedirs`, with every directory it creates 0o755."""
    missing = []
    path = os.path.abspath(path)
    while not os.path.exists(path):
        missing.append(path)
        path = os.path.dirname(path)
    os.makedirs(missing[0] if missing else path, exist_ok=True)
    for d in missing:
        world_readable(d, directory=True)

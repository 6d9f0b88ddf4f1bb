"""Benchmarks: each writes a markdown table (and plots) stamped with device, JAX version and date.

`python -m bench --suite gpu` runs them all at real sizes, `--suite cpu` at toy sizes.
"""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def repo_path(path: str) -> str:
    """An absolute path; relative ones are taken from the repository root (suites name
    config files like 'configs/llama1b.py' whatever the working directory)."""
    return path if os.path.isabs(path) else os.path.join(ROOT, path)


def int_list(text: str) -> tuple[int, ...]:
    """'4096,8192' -> (4096, 8192): the sizes arguments of every benchmark's command line."""
    return tuple(int(x) for x in text.split(",") if x)

"""JAX's persistent compilation cache, on by default: a restart, a resume, a requeued job or a
later stage of the same shapes loads its compiled programs instead of compiling them again
(the step of a 1B model takes 24 s to compile on an H100 host; a TPU pod's, minutes).

The cache holds executables that JAX loads and runs: whoever can write to its folder can run
code in the runs that read it, so it lives in the user's own cache folder (made private)
unless the config names another; never in a workdir, which others may write."""

from __future__ import annotations

import logging
import os

import jax

log = logging.getLogger(__name__)


def use_compile_cache(directory: str) -> str | None:
    """Turn JAX's persistent compilation cache on in `directory` (`~` expanded; '' leaves it
    off), unless one is on already (JAX_COMPILATION_CACHE_DIR, or an earlier call): the
    folder in use, or None. Takes effect for every program compiled after it, also when
    programs were compiled before (JAX opens the cache at the first compile that has one)."""
    current = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]
    if current:
        return current
    if not directory:
        return None
    path = os.path.expanduser(directory)
    if "://" not in path:  # a bucket's access is its own
        os.makedirs(path, mode=0o700, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    log.debug("persistent compilation cache: %s", path)
    return path

"""One log-line format for every lclm command: lclm's own loggers, Orbax/absl and Python warnings.

    2026-11-23 05:47:45,586 INFO mesh {...} on 8 cpu devices; model 0.92M params

Libraries that log through Python's `logging` (Orbax via absl, jax, datasets) inherit the
root handler set here; `warnings.warn` messages are routed into logging too, so nothing
reaches stderr in a second format. Only XLA's C++ messages bypass Python and keep theirs.
"""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(message)s"

# Loggers that speak at INFO on every run without saying anything a user acts on.
_QUIET = (
    "absl",  # Orbax's per-save / per-restore chatter
    "jax._src.xla_bridge",  # "Unable to initialize backend 'tpu'" on every machine without one
)


def configure(level: int = logging.INFO, *, main_process: bool = True) -> None:
    """Set the root handler and format for a command-line run (idempotent).

    Processes other than 0 of a multi-process run log warnings and errors only, so a pod's
    console is not repeated once per host.
    """
    logging.basicConfig(format=FORMAT)  # no-op where a handler exists (pytest's, a caller's)
    for handler in logging.getLogger().handlers:
        # absl's first log line (Orbax logs one when imported) calls logging.basicConfig()
        # with Python's default format: that handler takes lclm's
        if (
            type(handler) is logging.StreamHandler
            and handler.formatter is not None
            and handler.formatter._fmt == logging.BASIC_FORMAT
        ):
            handler.setFormatter(logging.Formatter(FORMAT))
    logging.getLogger().setLevel(level if main_process else max(level, logging.WARNING))
    logging.captureWarnings(True)
    for name in _QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)

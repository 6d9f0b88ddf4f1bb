"""The error every lclm CLI turns into one line (`error: ...`, exit status 2).

Its own module with no dependencies, so that every part of lclm (data, checkpoints, HF
loading, config) can raise it without importing the config machinery.
"""


class StartupError(ValueError):
    """Bad input found at start (config, paths, data files, checkpoints, a busy workdir): the
    message is one line that names the fix. Raise a subclass of it for such errors anywhere
    in the start-up path."""


class ConfigError(StartupError):
    """An invalid configuration; the message is one line that says how to fix it."""


class TrainingHalted(RuntimeError):
    """A run that stopped itself (non-finite steps in a row, checkpoints that cannot be
    saved); the message says why and which checkpoint to resume from, in one line. CLIs
    print it and exit with status 3."""

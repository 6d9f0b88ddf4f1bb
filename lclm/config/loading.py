"""Config files and keys: `get_config()` of a file with overrides, and the lookup of a dotted
key (`model.n_layers`) that names the closest existing key when it is wrong."""

from __future__ import annotations

import difflib
import importlib.util
import os
import traceback
from collections.abc import Iterator

import ml_collections

from lclm.errors import ConfigError


def load_config(path: str, overrides: dict | None = None) -> ml_collections.ConfigDict:
    """`get_config()` of a config file, with `{"section.field": value}` overrides applied.

    For programs other than train.py (benchmarks, tests); a missing file, an unknown key or a
    value of the wrong type is a ConfigError.
    """
    spec = importlib.util.spec_from_file_location("lclm_user_config", path)
    if spec is None or not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} not found")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None  # spec_from_file_location gives each spec it makes a loader
    try:
        spec.loader.exec_module(module)
        get_config = getattr(module, "get_config", None)
        if not callable(get_config):
            raise ConfigError(
                f"config file {path!r} defines no get_config(); a config file "
                "returns its ConfigDict from get_config() (see configs/demo.py)"
            )
        config = get_config()
    except ConfigError:
        raise
    except SyntaxError as e:
        raise ConfigError(f"config file {path!r} line {e.lineno}: {e.msg}") from None
    except Exception as e:  # noqa: BLE001  (the user's code: one line naming where it failed)
        raise ConfigError(
            f"config file {path!r} line {_line_in(e, path)}: {type(e).__name__}: {e}"
        ) from None
    for key, value in (overrides or {}).items():
        set_field(config, key, value)
    return config


def set_field(config, key: str, value, where: str = "config key") -> None:
    """`config.<key> = value`; an unknown key or a value of the wrong type is a ConfigError
    beginning with `where`."""
    node, name = field(config, key)
    try:
        node[name] = value
    except TypeError:
        raise ConfigError(
            f"{where} {key}={value!r}: expected type {type(node[name]).__name__}"
        ) from None


def _line_in(error: Exception, path: str) -> int | str:
    """The last line of `path` that `error`'s traceback passes through ('?' if none)."""
    lines = [
        frame.lineno
        for frame in traceback.extract_tb(error.__traceback__)
        if os.path.abspath(frame.filename) == os.path.abspath(path)
    ]
    return lines[-1] if lines and lines[-1] is not None else "?"


def field(config, key: str) -> tuple[ml_collections.ConfigDict, str]:
    """(the section holding `key`, its last name); an unknown key is a ConfigError."""
    parts = key.split(".")
    node = config
    for i, part in enumerate(parts):
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            raise ConfigError(_unknown_key(parts, i, node))
        if i < len(parts) - 1:
            node = node[part]
    return node, parts[-1]


def flat_items(tree: dict, prefix: str = "") -> Iterator[tuple[str, object]]:
    """(dotted key, value) of every leaf of a nested dict, keys sorted."""
    for name in sorted(tree):
        if isinstance(tree[name], dict):
            yield from flat_items(tree[name], f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", tree[name]


def _unknown_key(parts: list[str], i: int, node) -> str:
    """'unknown config key model.n_layer (did you mean model.n_layers?)'."""
    message = f"unknown config key {'.'.join(parts)}"
    names = list(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
    close = difflib.get_close_matches(parts[i], names, n=1)
    if close:
        return f"{message} (did you mean {'.'.join([*parts[:i], close[0], *parts[i + 1 :]])}?)"
    if names:
        return f"{message} ({'.'.join(parts[:i]) or 'the config'} has {', '.join(sorted(names))})"
    return f"{message} ({'.'.join(parts[:i])} is a value, not a section)"

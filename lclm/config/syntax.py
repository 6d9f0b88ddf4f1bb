"""The string syntaxes of configs and command lines, parsed in one place: token counts
(`2k`), lists of lengths (`2k,4k`) and stage schedules (`seq_len:rope_theta:steps[:sp], ...`)."""

from __future__ import annotations

import re
from typing import NamedTuple

from lclm.errors import ConfigError


def parse_tokens(text: str) -> int:
    """A token count: '2k' -> 2048, '512' -> 512, '1m' -> 1048576 (k = 1024)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", text)
    if not m:
        raise ValueError(f"bad length {text!r}; use e.g. 512, 2k or 1m")
    n = int(float(m.group(1)) * {"": 1, "k": 1024, "m": 1024**2}[m.group(2).lower()])
    if n < 1:
        raise ValueError(f"length {text!r} must be positive")
    return n


def format_tokens(n: int) -> str:
    """The short form `parse_tokens` reads: 2048 -> '2k', 1048576 -> '1m', 1000 -> '1000'."""
    for suffix, unit in (("m", 1024**2), ("k", 1024)):
        if n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


def parse_lengths(text: str) -> list[int]:
    """'2k,4k' -> [2048, 4096]."""
    return [parse_tokens(t) for t in text.split(",") if t.strip()]


class Stage(NamedTuple):
    seq_len: int
    rope_theta: float
    steps: int
    sp: int | None = None


def parse_schedule(schedule: str) -> list[Stage]:
    """`"32k:1e6:400,128k:1e7:200:8"` -> [Stage(32768, 1e6, 400), Stage(131072, 1e7, 200, 8)]."""
    stages = []
    for entry in filter(None, (e.strip() for e in schedule.split(","))):
        try:
            seq, theta, steps, *sp = entry.split(":")
            if len(sp) > 1:
                raise ValueError
            stage = Stage(parse_tokens(seq), float(theta), int(steps), int(sp[0]) if sp else None)
        except ValueError:
            raise ConfigError(
                f"stages.schedule entry {entry!r} is not "
                "seq_len:rope_theta:steps[:sp] (e.g. 32k:1e6:400:8)"
            ) from None
        if min(stage.seq_len, stage.steps, stage.rope_theta, stage.sp or 1) <= 0:
            raise ConfigError(f"stages.schedule entry {entry!r} needs positive values")
        stages.append(stage)
    return stages

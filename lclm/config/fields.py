"""A config field's type, default, help, accepted values and range, in one place: the section
dataclasses (`lclm.config.model`, `lclm.config.schema`) declare each field with `setting`,
and every CLI's `--help` (`lclm.cli.config_help`) and the single-field checks
(`schema.check_fields`) are generated from those declarations. No JAX here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple, TypeVar

_Section = TypeVar("_Section")


class Rule(NamedTuple):
    """What a numeric field accepts: `accepts(value)`, and the message's words for it."""

    accepts: Callable[[Any], bool]
    says: str


AT_LEAST_1 = Rule(lambda x: x >= 1, "must be >= 1")
AT_LEAST_0 = Rule(lambda x: x >= 0, "must be >= 0")
# a nan fails every comparison
FINITE_POSITIVE = Rule(lambda x: 0 < x < math.inf, "must be a finite number > 0")
FINITE_NON_NEGATIVE = Rule(lambda x: 0 <= x < math.inf, "must be a finite number >= 0")
FRACTION = Rule(lambda x: 0 <= x <= 1, "must be in [0, 1]")
BELOW_1 = Rule(lambda x: 0 <= x < 1, "must be in [0, 1)")


def setting(
    default, help: str = "", *, choices: tuple = (), rule: Rule | None = None, note: str = ""
):
    """A dataclass field of a config section: `help` is its line in `--help`; `choices` the
    names it takes (checked at start); `rule` its numeric range (checked at start), `note`
    what its bounds mean, added to the rule's message (e.g. "0: none by step count")."""
    return dataclasses.field(
        default=default, metadata=dict(help=help, choices=choices, rule=rule, note=note)
    )


class Field(NamedTuple):
    name: str
    default: Any
    help: str
    choices: tuple
    rule: Rule | None
    note: str

    def problem(self, value) -> str | None:
        """Why `value` is not accepted (None: it is), as the end of `key=value ...`."""
        if self.choices and value not in self.choices:
            return f"; use one of {self.choices}"
        if self.rule is not None and not self.rule.accepts(value):
            return f" {self.rule.says}" + (f" ({self.note})" if self.note else "")
        return None


def fields_of(section: type) -> Iterator[Field]:
    """The declared fields of a section dataclass, in declaration order."""
    for f in dataclasses.fields(section):
        meta = f.metadata
        yield Field(
            f.name,
            f.default,
            meta.get("help", ""),
            meta.get("choices", ()),
            meta.get("rule"),
            meta.get("note", ""),
        )


def from_saved(section: type[_Section], values: Mapping[str, Any]) -> _Section:
    """The section dataclass `section` from a saved dict (a checkpoint's or a run's config):
    the keys it declares; others (a field this version of lclm no longer has, or does not
    have yet) are dropped, and fields the dict lacks take their defaults."""
    names = {f.name for f in dataclasses.fields(section)}  # type: ignore[arg-type]
    return section(**{k: v for k, v in values.items() if k in names})

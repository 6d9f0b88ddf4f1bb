"""Stage gates: what a stage must reach before the next one starts (Llama 3 advanced its
context stages only once short-context skill had recovered).

A stage's `gate` (a key of its record in `stages.list`) is a dict:
- `short_loss`: a fraction f. The held-out loss at the shortest validation length at the
  stage's end must be at most (1 + f) x its value at the stage's start (the stage's own first
  weights, measured before its first step: `validation.at_start`), i.e. the longer context
  was not bought with the short one.
- `on_fail`: 'stop' (the default: the run stops, exit 3, before the next stage) or 'warn'.

A gate is evaluated from the stage's metrics.jsonl whenever the stage is finished, so
re-running a stopped run evaluates it again (after the stage was trained longer, or the gate
changed) and goes on only once it passes. Its verdict is logged and written to
`<stage workdir>/gate.json`.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from lclm import storage
from lclm.config.stages import validation_lengths
from lclm.files import write_json
from lclm.train.metrics import read_metrics

log = logging.getLogger(__name__)

class Verdict(NamedTuple):
    passed: bool
    line: str    # what was measured, against what
    stop: bool   # whether a failure stops the run


def _short_loss(record: dict, length: int, own_length: int) -> float | None:
    value = record.get(f"val_loss@{length}")
    if value is None and length == own_length:
        value = record.get("val_loss")
    return value


def evaluate(config, gate: dict, name: str) -> Verdict:
    """The verdict of a finished stage's `gate` (`config`: the stage's config), read from
    its metrics.jsonl and written to its gate.json."""
    length = validation_lengths(config)[0]
    records = read_metrics(config.workdir)
    start = next((_short_loss(r, length, config.data.seq_len) for r in records
                  if r.get("step") == 0), None)
    end = next((v for r in reversed(records)
                if r.get("step", 0) > 0
                and (v := _short_loss(r, length, config.data.seq_len)) is not None), None)
    limit = gate["short_loss"]
    stop = gate.get("on_fail", "stop") == "stop"
    if start is None or end is None:
        verdict = Verdict(False, f"stage {name} gate: no held-out loss at {length} tokens "
                                 f"{'at its start' if start is None else 'at its end'} in "
                                 f"{config.workdir}/metrics.jsonl", stop)
    else:
        change = end / start - 1
        passed = change <= limit
        verdict = Verdict(passed, f"stage {name} gate: val_loss@{length} {start:.4f} -> "
                                  f"{end:.4f} ({change:+.1%}, limit {limit:+.1%}): "
                                  f"{'passed' if passed else 'FAILED'}", stop)
    write_json(storage.join(config.workdir, "gate.json"),
               dict(gate=gate, length=length, start=start, end=end, passed=verdict.passed,
                    line=verdict.line))
    (log.info if verdict.passed else log.warning)("%s", verdict.line)
    return verdict

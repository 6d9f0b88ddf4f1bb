"""Stage gates: what a stage must reach before the next one starts (Llama 3 advanced its
context stages only once short-context skill had recovered).

A stage's `gate` (a key of its record in `stages.list`) is a dict of one or both of:
- `short_loss`: a fraction f. The held-out loss at the shortest validation length at the
  stage's end must be at most (1 + f) x its value at the stage's start (the stage's own first
  weights, measured before its first step: `validation.at_start`), i.e. the longer context
  was not bought with the short one.
- `ruler`: a RULER subset, e.g. dict(min_score=80, tasks='niah_single_1,vt', samples=10):
  RULER's average over those tasks at `length` (default: the stage's seq_len), scored on the
  stage's final checkpoint on its own mesh as `python -m lclm.eval ruler --checkpoint
  <stage workdir>` scores it, must be at least `min_score` (percent). The scoring is
  evaluation's (`lclm.eval.ruler.score_gate`: training stands above evaluation); its report
  goes to `<stage workdir>/ruler_gate/`.
and `on_fail`: 'stop' (the default: the run stops, exit 3, before the next stage) or 'warn'.

A gate is evaluated whenever the stage is finished, so re-running a stopped run evaluates it
again (after the stage was trained longer, or the gate changed) and goes on only once it
passes. Its verdict is logged and written to `<stage workdir>/gate.json`.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from lclm import storage
from lclm.config.run_config import RunConfig
from lclm.config.stages import gate_ruler, validation_lengths
from lclm.eval.ruler import score_gate
from lclm.train.metrics import read_metrics
from lclm.writes import write_json

log = logging.getLogger(__name__)


class Verdict(NamedTuple):
    passed: bool
    line: str  # what was measured, against what
    stop: bool  # whether a failure stops the run


def _short_loss(record: dict, length: int, own_length: int) -> float | None:
    value = record.get(f"val_loss@{length}")
    if value is None and length == own_length:
        value = record.get("val_loss")
    return value


def _short_loss_part(stage: RunConfig, limit: float) -> tuple[bool | None, str, dict]:
    """(passed or None where it could not be measured, its line, its gate.json fields)."""
    own = stage.data.seq_len
    length = validation_lengths(own, stage.validation.lengths)[0]
    records = read_metrics(stage.workdir)
    start = next((_short_loss(r, length, own) for r in records if r.get("step") == 0), None)
    end = next(
        (
            v
            for r in reversed(records)
            if r.get("step", 0) > 0 and (v := _short_loss(r, length, own)) is not None
        ),
        None,
    )
    fields = dict(length=length, start=start, end=end)
    if start is None or end is None:
        return (
            None,
            (
                f"no held-out loss at {length} tokens "
                f"{'at its start' if start is None else 'at its end'} in "
                f"{stage.workdir}/metrics.jsonl"
            ),
            fields,
        )
    change = end / start - 1
    return (
        change <= limit,
        (f"val_loss@{length} {start:.4f} -> {end:.4f} ({change:+.1%}, limit {limit:+.1%})"),
        fields,
    )


def _ruler_part(stage: RunConfig, spec: dict) -> tuple[bool, str, dict]:
    result = score_gate(stage.workdir, spec)
    score = result["average"][spec["length"]]
    return (
        score >= spec["min_score"],
        (
            f"RULER {spec['tasks']} at {spec['length']} tokens {score:.1f} (min "
            f"{spec['min_score']:g}, {spec['samples']} prompts each)"
        ),
        dict(ruler=dict(spec, scores=result["scores"], average=score)),
    )


def evaluate(stage: RunConfig, gate: dict, name: str) -> Verdict:
    """The verdict of a finished `stage`'s `gate` (its config's sections): its held-out
    losses read from its metrics.jsonl, its RULER subset scored by evaluation's scorer;
    written to its gate.json."""
    parts = []
    fields: dict = {}
    if "short_loss" in gate:
        parts.append(_short_loss_part(stage, gate["short_loss"]))
    spec = gate_ruler(gate, stage.data.seq_len)
    if spec is not None:
        parts.append(_ruler_part(stage, spec))
    for _, _, more in parts:
        fields.update(more)
    passed = all(p is True for p, _, _ in parts)
    line = f"stage {name} gate: " + "; ".join(
        f"{text}: {'passed' if p else 'FAILED'}" if p is not None else text for p, text, _ in parts
    )
    verdict = Verdict(passed, line, gate.get("on_fail", "stop") == "stop")
    write_json(
        storage.join(stage.workdir, "gate.json"),
        dict(gate=gate, **fields, passed=verdict.passed, line=verdict.line),
    )
    (log.info if verdict.passed else log.warning)("%s", verdict.line)
    return verdict

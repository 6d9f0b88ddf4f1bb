"""The numbers an extension report shows and the verdict on each of the config's targets
(`targets` section), read from the evaluation parts' own reports (`measured`: part key ->
the task's JSON). A target that was not measured (its part was cut, failed or not asked
for) is said to be so, never met.
"""

from __future__ import annotations

import dataclasses
import math

from lclm.config.schema import Targets
from lclm.config.syntax import format_tokens
from lclm.extend.plan import AFTER, BEFORE, YARN, Lengths, Part


@dataclasses.dataclass(frozen=True)
class Verdict:
    name: str
    met: bool | None  # None: not measured
    line: str  # the numbers, against the target

    @property
    def word(self) -> str:
        return {True: "met", False: "NOT MET", None: "not measured"}[self.met]


class Measured:
    """Lookups into the evaluation parts' reports by (task, model, length)."""

    def __init__(self, parts: list[Part], reports: dict[str, dict]):
        self.parts, self.reports = parts, reports

    def report(self, task: str, model: str, length: int) -> dict | None:
        for p in self.parts:
            if p.task == task and p.model == model and length in p.lengths:
                return self.reports.get(p.key)
        return None

    def perplexity(self, model: str, length: int) -> dict | None:
        """The perplexity report's entry of `length` (loss, buckets, documents)."""
        found = self.report("perplexity", model, length)
        entry = next((r for r in (found or {}).get("lengths", []) if r["length"] == length), None)
        return entry if entry and entry.get("loss") is not None else None

    def loss(self, model: str, length: int) -> float | None:
        entry = self.perplexity(model, length)
        return entry["loss"] if entry else None

    def range_loss(self, model: str, length: int, span: tuple[int, int]) -> float | None:
        """The mean token loss over positions [start, end) (the buckets inside it, weighted
        by their tokens)."""
        entry = self.perplexity(model, length)
        if not entry:
            return None
        inside = [b for b in entry["buckets"] if span[0] <= b["lo"] and b["hi"] <= span[1]]
        tokens = sum(b["tokens"] for b in inside)
        return sum(b["loss"] * b["tokens"] for b in inside) / tokens if tokens else None

    def passkey(self, model: str, length: int) -> list[float] | None:
        """Accuracy per depth bin at `length`."""
        found = self.report("passkey", model, length)
        if not found:
            return None
        cells = sorted(
            (c for c in found["cells"] if c["length"] == length), key=lambda c: c["depth_bin"]
        )
        return [c["accuracy"] for c in cells] or None

    def ruler(self, model: str, length: int) -> float | None:
        found = self.report("ruler", model, length)
        if not found or not found.get("complete", True):
            return None
        average = found["average"]
        value = average.get(str(length), average.get(length))
        return None if value is None else float(value)


def _span(span: tuple[int, int]) -> str:
    return f"{format_tokens(span[0]) if span[0] else 0}-{format_tokens(span[1])}"


def _at_least(name: str, target: float, measured: tuple[float, str] | None) -> Verdict:
    """The verdict of a score that must reach `target` ((the score, its words) or None)."""
    if measured is None:
        return Verdict(name, None, "not measured")
    return Verdict(name, measured[0] >= target, f"{measured[1]} (at least {target:g})")


def judge(targets: Targets, lengths: Lengths, m: Measured) -> list[Verdict]:
    """One verdict per target the config sets (a negative value, or False, sets none)."""
    out = []
    final, short = lengths.final, lengths.short
    if targets.far_near >= 0:
        far = m.range_loss(AFTER, final, lengths.far)
        near = m.range_loss(AFTER, final, lengths.near)
        name = f"loss over positions {_span(lengths.far)} vs {_span(lengths.near)}"
        if far is None or near is None:
            out.append(
                Verdict(name, None, f"after training at {format_tokens(final)}: not measured")
            )
        else:
            ratio = far / near
            was_far = m.range_loss(BEFORE, final, lengths.far)
            was_near = m.range_loss(BEFORE, final, lengths.near)
            was = (
                f"; the starting weights {was_far / was_near:.3f}"
                if was_far is not None and was_near
                else ""
            )
            out.append(
                Verdict(
                    name,
                    ratio <= targets.far_near,
                    f"{far:.4f} / {near:.4f} = {ratio:.3f} (at most {targets.far_near:g}){was}",
                )
            )
    if targets.passkey >= 0:
        acc = m.passkey(AFTER, final)
        out.append(
            _at_least(
                f"passkey at {format_tokens(final)}, every depth",
                targets.passkey,
                None
                if acc is None
                else (
                    min(acc),
                    f"lowest bin {min(acc):.2f}, all {', '.join(f'{a:.2f}' for a in acc)}",
                ),
            )
        )
    if targets.short_loss >= 0:
        before, after = m.loss(BEFORE, short), m.loss(AFTER, short)
        name = f"loss at {format_tokens(short)} kept"
        if before is None or after is None:
            out.append(Verdict(name, None, "not measured"))
        else:
            change = after / before - 1
            out.append(
                Verdict(
                    name,
                    change <= targets.short_loss,
                    f"{before:.4f} -> {after:.4f} ({change:+.2%}, at most "
                    f"{targets.short_loss:+.2%})",
                )
            )
    if targets.ruler >= 0:
        score = m.ruler(AFTER, final)
        out.append(
            _at_least(
                f"RULER subset at {format_tokens(final)}",
                targets.ruler,
                None if score is None else (score, f"{score:.1f}"),
            )
        )
    if targets.beat_yarn:
        yarn, after = m.loss(YARN, final), m.loss(AFTER, final)
        name = f"loss at {format_tokens(final)} below YaRN's"
        if yarn is None or after is None:
            out.append(Verdict(name, None, "not measured"))
        else:
            before = m.loss(BEFORE, final)
            plain = "" if before is None else f" ({before:.4f} with neither)"
            out.append(
                Verdict(
                    name,
                    after < yarn and math.isfinite(after),
                    f"{after:.4f} trained vs {yarn:.4f} with YaRN{plain}",
                )
            )
    return out

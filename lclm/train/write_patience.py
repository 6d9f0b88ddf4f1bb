"""How long a run rides out a storage fault before it stops (`WritePatience`, one for
checkpoint saves and metrics writes: `save_faults` and `step_faults` share it), and how the
fault messages say a duration."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class WritePatience:
    """How long a run rides out a storage fault (a disk full until a clean-up job runs, a
    bucket unreachable while its network fails over) before it stops (exit 3) rather than
    lose work: `seconds` (the config's `storage_patience_seconds`), the same for checkpoint
    saves and metrics writes, and a time, not a count of failures (at a fast log rate or a
    small `checkpoint.every` a two-second hiccup is many failed writes).

    Meanwhile a failed save is tried again after `first_pause` seconds, each pause twice the
    last up to `max_pause`: training goes on between the tries, except for a final,
    preemption or stopping save, which waits for them. Failed metrics writes are held in
    memory and retried at each logged step."""

    seconds: float = 300.0
    first_pause: float = 1.0
    max_pause: float = 30.0

    def pause(self, tries: int) -> float:
        """The pause after the `tries`-th failed try (1, 2, ...)."""
        return min(self.max_pause, self.first_pause * 2 ** (tries - 1))


def seconds_text(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:,.0f} s"

"""What a data source left out: malformed records, each counted once, with the first few
named (shared by every reader of records and documents)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class SourceStats:
    """Malformed records left out, each counted once (a source is read again every epoch)."""

    skipped: int = 0
    examples: list = dataclasses.field(default_factory=list)

    def skip(self, where: str, why: str) -> None:
        self.skipped += 1
        if len(self.examples) < 5:
            self.examples.append(f"{where}: {why}")

    def summary(self) -> str:
        return f"{self.skipped} records skipped (first: {'; '.join(self.examples)})"

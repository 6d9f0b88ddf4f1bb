"""The one way benchmarks report: a markdown table, printed and optionally written."""

from __future__ import annotations

import os


def emit_table(title: str, notes: list[str], header: list[str], rows, out: str = "") -> str:
    """Print `# title`, the notes (device, versions, date...) and a markdown table."""
    lines = [f"# {title}", "", *notes, "",
             "| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    table = "\n".join(lines)
    print(table)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            f.write(table + "\n")
    return table

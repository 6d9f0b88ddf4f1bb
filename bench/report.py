"""The one way benchmarks report: a stamp, a markdown table, optional plots, printed and written."""

from __future__ import annotations

import datetime
import os

TOY_NOTE = "**CPU toy sizes: not a performance result.**"
# Where a run's results go unless --out names a folder: under the current directory, outside the
# tracked tree (gitignored). The committed reference results in bench/results/ change only when
# --out names them (e.g. `python -m bench --suite cpu --out bench/results/cpu`).
RESULTS_DIR = "bench_results"


def default_out_dir(name: str) -> str:
    """`bench_results/<name>-<YYYYmmdd-HHMMSS>` (relative to the current directory): every run
    without --out gets a folder of its own, so no run overwrites another's results."""
    return os.path.join(RESULTS_DIR, f"{name}-{datetime.datetime.now():%Y%m%d-%H%M%S}")


def stamp(toy: bool = False) -> list[str]:
    """Note lines naming the device, JAX version and date (and, on a CPU or at toy sizes,
    that the numbers are not a performance result). Imports JAX: call after start-up."""
    import jax

    devices = jax.devices()
    d = devices[0]
    lines = [f"device: {d.device_kind} ({d.platform}, {len(devices)} visible); "
             f"jax {jax.__version__}; {datetime.date.today().isoformat()}"]
    if d.platform == "cpu":
        lines.append(TOY_NOTE)
    elif toy:
        lines.append("**Toy sizes: not a performance result.**")
    return lines


def emit_table(title: str, notes: list[str], header: list[str], rows, out: str = "",
               images=()) -> str:
    """Print `# title`, the notes (device, versions, date...) and a markdown table.

    `images` are PNG paths shown below the table (linked relative to `out`'s folder).
    """
    lines = [f"# {title}", "", *notes, "",
             "| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    for image in images:
        lines += ["", f"![{os.path.basename(image)}]({os.path.basename(image)})"]
    table = "\n".join(lines)
    print(table)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            f.write(table + "\n")
    return table


def fmt(x, spec: str = ",.1f", scale: float = 1.0, missing: str = "-") -> str:
    """`x * scale` formatted with `spec`, or `missing` when x is None (a skipped or failed
    cell). E.g. `fmt(seconds, ",.1f", 1e3)` for milliseconds."""
    return missing if x is None else format(x * scale, spec)


def error_status(e: Exception) -> str:
    """A table cell for a failed measurement: 'OOM', or the error's type and first line."""
    text = str(e)
    if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
        return "OOM"
    first = text.strip().splitlines()[:1] or [""]
    return f"failed: {type(e).__name__}: {first[0][:100]}"

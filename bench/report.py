"""The one way benchmarks report: a stamp, a markdown table that grows row by row, best-effort
plots.

A part opens a `Table` before it measures anything: the title, the stamp and the header go to
its `.md` file and to stdout at once, then every row the moment it is measured (flushed), so a
part killed midway (a device session's per-command limit) leaves every finished row behind.
Plots come after the table and never cost it: `try_plot` logs a failure and goes on.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys

TOY_NOTE = "**CPU toy sizes: not a performance result.**"
# Where a run's results go unless --out names a folder: under the current directory, outside the
# tracked tree (gitignored). The committed reference results in bench/results/ change only when
# --out names them (e.g. `python -m bench --suite cpu --out bench/results/cpu`).
RESULTS_DIR = "bench_results"
# lclm's MFU, stated under every table that has an MFU column (lclm.train.metrics)
MFU_NOTE = (
    "MFU = model FLOPs / (step time x peak): lclm's formula, 6N + 6 L T D FLOPs per token "
    "(N matmul parameters, L layers, T sequence length, D model width), i.e. causal "
    "attention counted as half the square; n/a without a known peak (e.g. on CPU)."
)

log = logging.getLogger("bench")


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
    lines = [
        f"device: {d.device_kind} ({d.platform}, {len(devices)} visible); "
        f"jax {jax.__version__}; {datetime.date.today().isoformat()}"
    ]
    if d.platform == "cpu":
        lines.append(TOY_NOTE)
    elif toy:
        lines.append("**Toy sizes: not a performance result.**")
    return lines


def _line(cells) -> str:
    return "| " + " | ".join(str(x) for x in cells) + " |"


class Table:
    """A markdown report written as it is measured.

    Opening it writes `# title`, the notes and the table header; `add` writes one row; `note`
    and `image` append text and plots below the table; `section` starts another table. Each
    write goes to stdout and is appended to `path` (when given) and flushed at once: the file
    always holds everything measured so far.
    """

    def __init__(self, title: str, notes, header, path: str = ""):
        self.path = path
        self.header = list(header)
        self.rows: list[tuple] = []
        self.lines: list[str] = []
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            open(path, "w").close()
        self._emit([f"# {title}", "", *notes, "", *self._head()])

    def _head(self) -> list[str]:
        return [_line(self.header), _line("---" for _ in self.header)]

    def _emit(self, lines: list[str]) -> None:
        text = "\n".join(lines) + "\n"
        self.lines += lines
        sys.stdout.write(text)
        sys.stdout.flush()
        if self.path:
            with open(self.path, "a") as f:  # closed (flushed to the OS) after every write
                f.write(text)

    def add(self, row) -> None:
        """Write one row now (cells formatted with str)."""
        row = tuple(row)
        if len(row) != len(self.header):
            raise ValueError(f"a row of {len(row)} cells for {len(self.header)} columns")
        self.rows.append(row)
        self._emit([_line(row)])

    def note(self, *lines: str) -> None:
        """Paragraphs below the table (a table goes on only after `section`)."""
        if lines:
            self._emit(["", *lines])

    def section(self, title: str, header, notes=()) -> None:
        """A second table below: `## title`, its notes and header; `add` writes to it."""
        self.header = list(header)
        self._emit(["", f"## {title}", "", *notes, *([""] if notes else []), *self._head()])

    def image(self, png: str | None) -> None:
        """Link a PNG (relative to the report's folder); None (a failed plot) is skipped."""
        if png:
            self._emit(["", f"![{os.path.basename(png)}]({os.path.basename(png)})"])

    def text(self) -> str:
        return "\n".join(self.lines)


def emit_table(
    title: str, notes: list[str], header: list[str], rows, out: str = "", images=()
) -> str:
    """Print `# title`, the notes (device, versions, date...) and a markdown table, all at
    once (for tables whose rows are known together); `out` also gets it. `images` are PNG
    paths shown below the table (linked relative to `out`'s folder). Returns the text."""
    table = Table(title, notes, header, out)
    for row in rows:
        table.add(row)
    for image in images:
        table.image(image)
    return table.text()


def try_plot(make, *args, **kwargs) -> str | None:
    """`make(*args, **kwargs)` (a function that writes a PNG and returns its path), or None
    after logging why it failed: a plot is never worth a part's table or exit status."""
    try:
        return make(*args, **kwargs)
    except Exception as e:  # noqa: BLE001  (matplotlib, an empty figure, a full disk...)
        log.warning(
            "plot %s failed (%s: %s); the table is complete without it",
            getattr(make, "__name__", make),
            type(e).__name__,
            str(e)[:200],
        )
        return None


def fmt(x, spec: str = ",.1f", scale: float = 1.0, missing: str = "-") -> str:
    """`x * scale` formatted with `spec`, or `missing` when x is None (a skipped or failed
    cell). E.g. `fmt(seconds, ",.1f", 1e3)` for milliseconds."""
    return missing if x is None else format(x * scale, spec)


# Out-of-memory messages of XLA (CPU/GPU/TPU) and of the operating system, in lower case:
# matched whatever the case
OOM_MARKERS = ("resource_exhausted", "out of memory", "memoryerror")


def oom_status(text: str) -> str | None:
    """'OOM: <the first line that says so>' (which memory, how many bytes: XLA's message
    names them) when `text` reports running out of memory, else None."""
    for line in text.splitlines():
        if any(m in line.lower() for m in OOM_MARKERS):
            return f"OOM: {line.strip()[:160]}".replace("|", "/")
    return None


def error_status(e: Exception) -> str:
    """A table cell for a failed measurement: 'OOM: <its line>', or the error's type and
    first line."""
    text = str(e)
    oom = oom_status(text)
    if oom:
        return oom
    first = text.strip().splitlines()[:1] or [""]
    return f"failed: {type(e).__name__}: {first[0][:100]}".replace("|", "/")


# -- targets: the figures a suite is judged by, one table across its parts --------------------

TARGETS_HEADER = ["part", "what", "lclm", "reference", "ratio", "target", "verdict"]


def target_row(
    part: str,
    what: str,
    lclm: str,
    reference: str,
    ratio: float | None,
    *,
    at_least: float | None = None,
    at_most: float | None = None,
    unit: str = "",
    judged: float | None = None,
) -> dict:
    """One judged figure: lclm's measurement beside its reference, measured in the same run,
    their ratio, and the target it is held to: `judged` (by default the ratio) `at_least` or
    `at_most` a limit (`unit` written after it, e.g. "x"); whether it is met follows."""
    value = ratio if judged is None else judged
    assert value is not None and (at_least is None) != (at_most is None)
    if at_least is not None:
        target, met = f">= {at_least}{unit}", value >= at_least
    else:
        assert at_most is not None
        target, met = f"<= {at_most}{unit}", value <= at_most
    return dict(
        part=part, what=what, lclm=lclm, reference=reference, ratio=ratio, target=target, met=met
    )


def write_targets(out_dir: str, module: str, rows: list[dict]) -> None:
    """`<module>.targets.json` in `out_dir`: the part's judged figures, for the suite's index."""
    import json

    with open(os.path.join(out_dir, f"{module}.targets.json"), "w") as f:
        json.dump(rows, f, indent=1)
        f.write("\n")


def read_targets(out_dir: str, modules) -> list[tuple]:
    """The table rows of every `<module>.targets.json` in `out_dir`, in `modules`' order."""
    import json

    rows = []
    for module in modules:
        path = os.path.join(out_dir, f"{module}.targets.json")
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            for r in json.load(f):
                verdict = "met" if r["met"] else "**not met**"
                ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
                rows.append(
                    (r["part"], r["what"], r["lclm"], r["reference"], ratio, r["target"], verdict)
                )
    return rows

"""PNG plots of benchmark results (matplotlib, non-interactive 'Agg' backend).

Callers go through `bench.report.try_plot`: a failed plot is logged and the part goes on (its
table is already written). Every figure carries the report's stamp (device, JAX version, date,
toy-size warning) as its subtitle, so a plot copied out of its report still says where it was
measured.
"""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass
class Panel:
    """One axes of a figure: named series of (x, y) points."""

    title: str
    xlabel: str
    ylabel: str
    series: dict[str, tuple[list, list]] = dataclasses.field(default_factory=dict)
    logx: bool = True  # sizes grow in powers of two
    styles: dict[str, str] = dataclasses.field(default_factory=dict)  # label -> fmt string

    def add(self, label: str, x, y, style: str = "") -> None:
        """Append a point to series `label` (skipped when y is None: a failed or skipped run)."""
        if y is None:
            return
        xs, ys = self.series.setdefault(label, ([], []))
        xs.append(x)
        ys.append(y)
        if style:
            self.styles[label] = style


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display on benchmark machines
    import matplotlib.pyplot as plt

    return plt


def save_lines(path: str, title: str, stamp: list[str], panels: list[Panel]) -> str:
    """Write line plots (one panel per `Panel`, two per row) to `path`; returns `path`.
    Raises ValueError when no panel has a point (every row failed or was skipped)."""
    if not any(panel.series for panel in panels):
        raise ValueError(f"nothing to plot in {os.path.basename(path)}: no measured point")
    plt = _pyplot()
    cols = min(len(panels), 2)
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 1.2 + 4.2 * rows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, panel in zip(axes.flat, panels):
        for label, (xs, ys) in panel.series.items():
            ax.plot(xs, ys, panel.styles.get(label, "o-"), label=label)
        if panel.logx:
            ax.set_xscale("log", base=2)
            ticks = sorted({x for xs, _ in panel.series.values() for x in xs})
            ax.set_xticks(ticks, [_size(x) for x in ticks])
            ax.minorticks_off()
        ax.set(title=panel.title, xlabel=panel.xlabel, ylabel=panel.ylabel)
        ax.set_ylim(bottom=0)  # ratios and rates read honestly only from zero
        ax.grid(True, alpha=0.3)
        if panel.series:
            ax.legend(fontsize=7)
    _finish(fig, plt, path, title, stamp)
    return path


def save_bars(
    path: str,
    title: str,
    stamp: list[str],
    ylabel: str,
    bars: dict[str, float],
    labels: dict[str, str] | None = None,
) -> str:
    """Write a bar chart of `bars` (name -> value, with optional text above each bar)."""
    if not bars:
        raise ValueError(f"nothing to plot in {os.path.basename(path)}: no bars")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.8))
    names = list(bars)
    ax.bar(names, [bars[n] for n in names], color="tab:blue")
    for i, name in enumerate(names):
        text = (labels or {}).get(name, f"{bars[name]:,.0f}")
        ax.text(i, bars[name], text, ha="center", va="bottom", fontsize=9)
    ax.set(ylabel=ylabel)
    ax.grid(True, axis="y", alpha=0.3)
    _finish(fig, plt, path, title, stamp)
    return path


def _size(x) -> str:
    """Tick label of a size: 4096 -> '4K', 3 -> '3'."""
    return f"{x // 1024}K" if x >= 1024 and x % 1024 == 0 else f"{x:g}"


def _finish(fig, plt, path: str, title: str, stamp: list[str]) -> None:
    subtitle = "\n".join(line.replace("**", "") for line in stamp)
    fig.suptitle(f"{title}\n{subtitle}", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""Compile time and memory traffic of lclm's train step against the plain step, both compiled
for a described GPU on this machine (no GPU attached).

    python -m bench.compile_speed [--config configs/llama1b.py] [--seq 8192] [--target h100:1]
                                  [--repeat 2] [--out FILE.md]

Programs, from the config's model at `--seq` tokens on one device: the plain step
(`bench.baseline`, with `--baseline` remat, by default `dots`, the fastest that fits at 8K on an
H100: bench/results/gpu-lease-h200) and lclm's step with `--remat` (by default `none`, what
`remat='auto'` picks there) with document masks (`data.document_mask=True`, the default) and
without. Each is built by `bench.train_step.compile_row`, the train part's own builder, and
compiled `--repeat` times in turn (the order rotates each round, after one compile of the plain
step that is not timed: it pays the one-time set-up of XLA:GPU and ptxas); the table gives each
program's median and its ratio to the plain step's median. Seconds are wall time on this
machine: tracing and lowering (Python, JAX), then XLA's compile. The persistent compilation
cache is off in this process, so every compile is a real one.

Traffic: the bytes one execution of the compiled program moves through device memory, by
`lclm.plan.traffic` (a walk of the optimized HLO: what each kernel reads and writes, while
bodies times their trip count). Conditionals and fused-kernel calls are counted in the same
text (`lclm.plan.aot`).

Targets (issue 77): lclm's step with document masks compiles in at most 1.2x the plain step's
time and moves at most 1.02x its bytes. Needs `pip install -e ".[gpu-aot]"`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import statistics
import sys

from bench import repo_path
from bench.report import Table, fmt, target_row, write_targets

HEADER = [
    "program",
    "kernel",
    "trace+lower s",
    "compile s (median)",
    "x plain",
    "rounds",
    "traffic GB",
    "x plain",
    "conditionals",
    "kernel calls",
]
COMPILE_TARGET, TRAFFIC_TARGET = 1.2, 1.02


@dataclasses.dataclass(frozen=True)
class CompileSpec:
    config: str = "configs/llama1b.py"
    seq: int = 8192
    target: str = "h100:1"
    remat: str = "none"
    baseline: str = "dots"
    repeat: int = 3

    def smallest(self) -> CompileSpec:
        return dataclasses.replace(self, repeat=1)

    def quick(self) -> CompileSpec:
        return self


def _programs(spec: CompileSpec) -> dict[str, tuple]:
    """name -> (config, the plain step's remat or None for lclm's step)."""
    from bench.max_context import ONE_DEVICE
    from bench.train_step import row_config

    def config(mask: bool):
        c = row_config(repo_path(spec.config), ONE_DEVICE, spec.seq, None, None)
        c.model.remat = spec.remat
        c.data.document_mask = mask
        return c

    return {
        f"plain step ({spec.baseline} remat)": (config(False), spec.baseline),
        f"lclm, document masks ({spec.remat} remat)": (config(True), None),
        f"lclm, no document masks ({spec.remat} remat)": (config(False), None),
    }


def measure(spec: CompileSpec) -> dict[str, dict]:
    """name -> {kernel, lower_s, compile_s (each round's), traffic, conditionals, kernels}."""
    import jax

    from bench.train_step import compile_row
    from lclm.plan import aot
    from lclm.plan.traffic import traffic

    jax.config.update("jax_enable_compilation_cache", False)
    devices = aot.target_devices(aot.target(spec.target))
    programs = _programs(spec)
    first = next(iter(programs.values()))
    compile_row(first[0], devices=devices, baseline=first[1])  # one-time set-up: not timed
    found: dict[str, dict] = {name: {"compile_s": [], "lower_s": []} for name in programs}
    names = list(programs)
    for r in range(spec.repeat):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            config, baseline = programs[name]
            record, compiled, _ = compile_row(config, devices=devices, baseline=baseline)
            entry = found[name]
            entry["compile_s"].append(record["compile_s"])
            entry["lower_s"].append(record["lower_s"])
            if "traffic" not in entry:
                text = compiled.as_text()
                moved = traffic(text)
                entry.update(
                    kernel=record["impl"],
                    traffic=moved.bytes,
                    unknown_loops=moved.unknown_loops,
                    conditionals=aot.conditionals(text),
                    kernels=aot.kernel_calls(text),
                )
            del compiled
    return found


def _rows(found: dict[str, dict]) -> list[tuple]:
    plain = next(iter(found.values()))
    base_s, base_bytes = statistics.median(plain["compile_s"]), plain["traffic"]
    rows = []
    for name, e in found.items():
        median = statistics.median(e["compile_s"])
        rows.append(
            (
                name,
                e["kernel"],
                fmt(statistics.median(e["lower_s"]), ".1f"),
                fmt(median, ".1f"),
                fmt(median / base_s, ".2f"),
                ", ".join(f"{s:.1f}" for s in e["compile_s"]),
                fmt(e["traffic"] / 1e9, ".1f"),
                fmt(e["traffic"] / base_bytes, ".3f"),
                e["conditionals"],
                e["kernels"],
            )
        )
    return rows


def _targets(found: dict[str, dict]) -> list[dict]:
    plain, masked = list(found.values())[:2]
    base_s, lclm_s = statistics.median(plain["compile_s"]), statistics.median(masked["compile_s"])
    return [
        target_row(
            "compile",
            "compile of the step with document masks (s)",
            f"{lclm_s:.1f}",
            f"{base_s:.1f} (plain step)",
            lclm_s / base_s,
            at_most=COMPILE_TARGET,
            unit="x",
        ),
        target_row(
            "compile",
            "bytes the compiled step moves (GB)",
            f"{masked['traffic'] / 1e9:.1f}",
            f"{plain['traffic'] / 1e9:.1f} (plain step)",
            masked["traffic"] / plain["traffic"],
            at_most=TRAFFIC_TARGET,
            unit="x",
        ),
    ]


def run(spec: CompileSpec, out_dir: str, toy: bool = False) -> str:
    """The suite's part: `compile_speed.md` and its targets in `out_dir`."""
    path = os.path.join(out_dir, "compile_speed.md")
    report(spec, path)
    return path


def report(spec: CompileSpec, path: str) -> dict[str, dict]:
    import jax

    found = measure(spec)
    unknown = sum(e["unknown_loops"] for e in found.values())
    notes = [
        f"device: host CPU compiling for {spec.target} (described, no GPU attached); "
        f"{os.cpu_count()} cores; jax {jax.__version__}; {datetime.date.today().isoformat()}",
        f"{os.path.relpath(repo_path(spec.config), repo_path('.'))} at {spec.seq:,} tokens, "
        f"batch 1, one device; {spec.repeat} timed compiles of each, in turn; 1-minute load "
        f"average at the end {os.getloadavg()[0]:.1f}",
        "traffic: lclm.plan.traffic's walk of the optimized HLO"
        + (f" ({unknown} loops of unknown trip count counted once)" if unknown else ""),
    ]
    table = Table(
        "Compile time and traffic of the train step vs the plain step", notes, HEADER, path
    )
    for row in _rows(found):
        table.add(row)
    write_targets(os.path.dirname(os.path.abspath(path)), "compile_speed", _targets(found))
    return found


def main(argv=None) -> int:
    defaults = CompileSpec()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=defaults.config)
    ap.add_argument("--seq", type=int, default=defaults.seq)
    ap.add_argument("--target", default=defaults.target)
    ap.add_argument("--remat", default=defaults.remat, help="lclm's step's model.remat")
    ap.add_argument("--baseline", default=defaults.baseline, help="the plain step's remat")
    ap.add_argument("--repeat", type=int, default=defaults.repeat)
    ap.add_argument("--out", default="compile_speed.md")
    args = ap.parse_args(argv)
    from lclm.cli import run_cli

    spec = CompileSpec(args.config, args.seq, args.target, args.remat, args.baseline, args.repeat)

    def measured() -> int:
        report(spec, args.out)
        return 0

    return run_cli(measured)


if __name__ == "__main__":
    sys.exit(main())

"""Where a train step's device time goes: a `jax.profiler` trace of lclm's step (or the
plain baseline's), summed per kernel and per kind of kernel.

    python -m bench.profile_step --config configs/llama1b.py --seq 32768 --out DIR \
        [--baseline none|dots|full] [--steps 2] [--config.model.remat=none ...]

Writes `DIR/profile-<kernel>-<remat>-<seq>.md` (device milliseconds per step by kind: the
attention kernel, matmuls, copies, XLA's other fusions; then the kernels that took the most)
and, where no kernel was found on a GPU stream, copies the raw Chrome trace there
(`trace-...json.gz`) to be read elsewhere.
Kinds are read from kernel names (`KINDS`), so a kernel named unlike any of them lands in
'other': the top-kernels table shows its name.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import shutil
import sys
import tempfile

# the first pattern a kernel's name matches gives its kind; cuDNN's attention kernels are
# named sdpa/fmha, tokamax's Mosaic ones after their Pallas function
KINDS = (
    ("attention", re.compile(r"sdpa|fmha|flash|attention|mosaic|_fa_", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|wgmma|triton_.*dot", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy", re.I)),
)


def kind_of(name: str) -> str:
    """A kernel's kind: that of the first `KINDS` pattern its name matches."""
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other (XLA fusions)"


def trace_events(trace_dir: str) -> tuple[list[dict], list[dict], str]:
    """(the kernels, every complete event, the trace's path) of the newest `*.trace.json.gz`
    under `trace_dir`. Events are dicts: name, ts and dur (microseconds), thread ('process /
    thread'); kernels are the complete events (`ph` X) on a GPU's "Stream #N" threads (its
    derived "XLA Ops"/"XLA Modules" lines repeat the same time under HLO names)."""
    paths = sorted(
        glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True),
        key=os.path.getmtime,
    )
    if not paths:
        raise FileNotFoundError(f"no *.trace.json.gz under {trace_dir}")
    with gzip.open(paths[-1], "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    processes, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[e["pid"], e["tid"]] = e["args"]["name"]
    complete, kernels = [], []
    for e in events:
        if e.get("ph") != "X":
            continue
        process = processes.get(e["pid"], str(e["pid"]))
        thread = threads.get((e["pid"], e["tid"]), str(e["tid"]))
        event = dict(
            name=e["name"], ts=e["ts"], dur=e.get("dur", 0), thread=f"{process} / {thread}"
        )
        complete.append(event)
        if "GPU" in process and thread.startswith("Stream"):
            kernels.append(event)
    return kernels, complete, paths[-1]


def covered(events: list[dict]) -> float:
    """Microseconds in which at least one of `events` runs (the union of their intervals)."""
    total, end = 0.0, float("-inf")
    for e in sorted(events, key=lambda e: e["ts"]):
        start, stop = e["ts"], e["ts"] + e["dur"]
        total += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return total


def summarise(events: list[dict], steps: int, wall_ms: float) -> str:
    """Markdown: device time per step by kind and the 25 kernels that took the longest."""
    by_kind: collections.Counter[str] = collections.Counter()
    by_name: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    for e in events:
        by_kind[kind_of(e["name"])] += e["dur"]
        by_name[e["name"]] += e["dur"]
        calls[e["name"]] += 1
    busy = sum(by_kind.values())
    span = (
        (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) if events else 0.0
    )
    lines = [
        f"{steps} traced steps; wall {wall_ms:.1f} ms per step (host clock, traced); "
        f"kernel time {busy / 1e3 / steps:.1f} ms per step (summed over streams); at "
        f"least one kernel running {covered(events) / 1e3 / steps:.1f} ms of a span of "
        f"{span / 1e3 / steps:.1f} ms per step (the difference: the device idle)",
        "",
        "| kind | ms per step | share of kernel time |",
        "| --- | --- | --- |",
    ]
    for kind, us in by_kind.most_common():
        lines.append(f"| {kind} | {us / 1e3 / steps:.1f} | {us / max(busy, 1):.1%} |")
    lines += [
        "",
        "| kernel | kind | calls per step | ms per step | share of kernel time |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, us in by_name.most_common(25):
        short = name if len(name) <= 90 else name[:87] + "..."
        lines.append(
            f"| `{short}` | {kind_of(name)} | {calls[name] / steps:g} | "
            f"{us / 1e3 / steps:.2f} | {us / max(busy, 1):.1%} |"
        )
    return "\n".join(lines) + "\n"


def profile(config, out_dir: str, *, steps: int, baseline: str | None, label: str = "model") -> str:
    """Compile, warm up once, trace `steps` steps; returns the report's path."""
    import jax

    from bench.train_step import _timed_steps, compile_row

    record, compiled, (_, _, state, batch) = compile_row(config, baseline=baseline)
    state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    name = f"{record['impl']}-{record['remat']}-{record['seq']}"
    with tempfile.TemporaryDirectory(prefix=f"trace-{name}-") as trace_dir:
        # create_perfetto_trace makes the profiler write the Chrome trace (*.trace.json.gz)
        # beside its xplane.pb: the only form read here without xprof
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            step_s, metrics = _timed_steps(compiled, state, batch, 0, steps)
        wall_ms = step_s * 1e3
        kernels, complete, path = trace_events(trace_dir)
        if not kernels:  # named unlike a GPU's streams: keep the raw trace to read elsewhere
            shutil.copy(path, os.path.join(out_dir, f"trace-{name}.json.gz"))
    # the device's threads only: host threads nest their events, so their sums mean nothing
    per_thread: collections.Counter[str] = collections.Counter()
    for e in complete:
        if "GPU" in e["thread"].split(" / ")[0]:
            per_thread[e["thread"]] += e["dur"]
    threads = "\n".join(
        ["", "| device trace thread | ms per step |", "| --- | --- |"]
        + [f"| {t} | {us / 1e3 / steps:.1f} |" for t, us in per_thread.most_common(12)]
    )
    text = (
        f"# Profile: {label}, {record['seq']} tokens, kernel {record['impl']}, remat "
        f"{record['remat']}, mesh {record['mesh']}\n\ndevice: "
        f"{jax.devices()[0].device_kind}; jax {jax.__version__}; loss "
        f"{float(metrics['loss']):.3f}\n\n" + summarise(kernels, steps, wall_ms) + threads + "\n"
    )
    report = os.path.join(out_dir, f"profile-{name}.md")
    with open(report, "w") as f:
        f.write(text)
    print(text, flush=True)
    return report


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m bench.profile_step",
        description=__doc__.split("\n")[0],
        epilog="config fields: --config.<key>=<value>, as for train.py",
    )
    ap.add_argument("--seq", type=int, default=0, help="sequence length (default: config's)")
    ap.add_argument(
        "--baseline",
        default="",
        help="profile bench.baseline's plain step with "
        "this layer remat (none, dots, full) instead of lclm's",
    )
    ap.add_argument("--steps", type=int, default=2, help="traced steps after one warm-up")
    ap.add_argument("--out", required=True, help="folder for the report and the trace")

    from lclm.cli import parse_cli, run_cli
    from lclm.parallel.devices import allow_gpu_host_memory

    def body():
        args, config = parse_cli(ap, argv, runs_stages=False)
        allow_gpu_host_memory()  # before JAX starts: an offload step's host memory
        if args.seq:
            config.data.seq_len = args.seq
        os.makedirs(args.out, exist_ok=True)
        profile(
            config,
            args.out,
            steps=args.steps,
            baseline=args.baseline or None,
            label=os.path.basename(args.config),
        )
        return 0

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())

"""Longest trainable sequence on one device: lclm's blockwise transformer vs dense baselines.

    python -m bench.max_context [--config configs/llama1b.py] [--variants lclm,vanilla]
        [--start 8192] [--cap 2097152] [--resolution 16384] [--quick] [--out DIR] \
        [--config.model.n_layers=8 ...]

Variants of the same LLaMA train step (full remat, AdamW, batch 1, one device):

- `lclm`: blockwise attention (the config's kernel), blockwise feed-forward and loss (BPT);
- `attention_only`: blockwise attention, feed-forward and loss unchunked (chunk = sequence),
  the "memory-efficient attention" baseline of the BPT paper;
- `vanilla`: dense attention (`lclm.ops.kernels.reference.dense_attention`: float32 `[heads, t, t]`
  scores and probabilities materialised), feed-forward and loss unchunked. lclm's model has
  no dense-attention setting, so for this variant the probe swaps the model's attention call
  (`lclm.models.decoder.context_parallel_attention`) while the step is traced; everything else
  is lclm's.

Each probe (one variant, one length) runs in a child process (an out-of-memory abort cannot
be caught reliably in-process) that builds the state, compiles and runs one training step
(`bench.train_step.measure`); the length fits if that step finished. Lengths double from
`--start` until a probe fails or `--cap`, then bisect down to `--resolution` tokens. On a CPU
nothing runs out of memory at toy sizes, so there a probe also fails when XLA's memory
estimate of the compiled step exceeds `--budget-mib` (the report says which limit applied).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from collections.abc import Callable
from typing import NamedTuple

from bench import repo_path
from bench.isolate import emit_record, run_child
from bench.report import Table, default_out_dir, fmt, stamp, try_plot

# config overrides are command-line arguments, as for train.py
ONE_DEVICE = (
    "--config.mesh.dp=1",
    "--config.mesh.fsdp=1",
    "--config.mesh.tp=1",
    "--config.mesh.sp=1",
)
# the longest sequence: only layer inputs are kept between forward and backward
FULL_REMAT = ("--config.model.remat=full",)


class Variant(NamedTuple):
    dense: bool  # dense_attention instead of the blockwise kernel
    chunked: bool  # the config's blockwise feed-forward and loss chunks
    what: str
    published: str  # Blockwise Parallel Transformer paper, Table 2, 1B on one A100 80GB


VARIANTS = {
    "lclm": Variant(False, True, "blockwise attention + blockwise FFN and loss (BPT)", "131K"),
    "attention_only": Variant(False, False, "blockwise attention; FFN and loss unchunked", "65K"),
    "vanilla": Variant(
        True, False, "dense attention (materialised); FFN and loss unchunked", "16K"
    ),
}
PUBLISHED_NOTE = (
    "Published: BPT paper (Liu & Abbeel 2023) Table 2, their 1B model "
    "on one A100 80GB: vanilla 16K, memory-efficient attention 65K, BPT 131K "
    "(a different model and device: for orientation only)."
)


@dataclasses.dataclass(frozen=True)
class MaxContextSpec:
    """The max-context part of a suite."""

    config: str = "configs/llama1b.py"
    overrides: tuple[str, ...] = ()  # `--config.a.b=V` arguments
    variants: tuple[str, ...] = ("lclm", "attention_only", "vanilla")
    impl: str = "auto"  # the blockwise variants' kernel; auto = the platform's fused one
    start: int = 8192
    cap: int = 2**21
    resolution: int = 16384  # a multiple of every chunk of the config
    budget_mib: int | None = None
    timeout: float = 1800.0  # per probe
    budget_s: float | None = None  # stop starting probes after this many seconds

    def smallest(self) -> MaxContextSpec:
        return dataclasses.replace(self, cap=self.start)

    def quick(self) -> MaxContextSpec:
        """Dense attention first (16K, then 32K if that fit: one or two probes), then lclm
        doubling 16K -> 128K (four probes, one compile each), within a 400 s budget (a probe
        started near its end gets a minute past it)."""
        return dataclasses.replace(
            self,
            variants=("vanilla", "lclm"),
            start=16384,
            cap=131072,
            resolution=16384,
            timeout=240.0,
            budget_s=400.0,
        )


def _dense_ring_attention(q, k, v, *, mesh, segment_ids=None, **_settings):
    """Stand-in for the model's ring call on one device: plain dense causal attention."""
    from lclm.ops.kernels.reference import dense_attention

    if mesh.shape["sp"] != 1:
        raise ValueError("the dense-attention baseline runs on one device (mesh.sp=1)")
    return dense_attention(q, k, v, causal=True, segment_ids=segment_ids).astype(q.dtype)


def dense_attention_patch():
    """Context manager: lclm's LLaMA calls dense attention instead of the ring while active."""
    from unittest import mock

    from lclm.models import decoder

    return mock.patch.object(decoder, "context_parallel_attention", _dense_ring_attention)


def probe(config_path: str, overrides, variant: str, seq: int, budget_mib: int | None) -> dict:
    """Child side: one training step of `variant` at `seq` tokens on one device."""
    from bench.train_step import measure, row_config

    v = VARIANTS[variant]
    config = row_config(config_path, [*FULL_REMAT, *overrides, *ONE_DEVICE], seq, None, None)
    if not v.chunked:
        config.model.update(ffn_chunk=seq, loss_chunk=seq)
    patch = dense_attention_patch() if v.dense else contextlib.nullcontext()
    budget = None if budget_mib is None else budget_mib * 2**20
    return dict(
        measure(config, steps=1, warmup=0, budget_bytes=budget, model_patch=patch), variant=variant
    )


def search(fits: Callable[[int], bool], start: int, cap: int, resolution: int):
    """(longest length that fits, shortest that does not): doubling from `start` up to `cap`,
    then bisection to `resolution` (every probed length is a multiple of it or `start`).
    Either may be None: nothing fits, or `cap` fits."""
    best, fail, seq = None, None, start
    while seq <= cap:
        if not fits(seq):
            fail = seq
            break
        best, seq = seq, seq * 2
    if best is None or fail is None:
        return best, fail
    while fail - best > resolution:
        mid = (best + fail) // 2 // resolution * resolution
        if mid <= best:
            break
        if fits(mid):
            best = mid
        else:
            fail = mid
    return best, fail


class _BudgetSpent(Exception):
    """The part's time budget ran out before a probe."""


def search_variant(spec: MaxContextSpec, variant: str, on_probe=None, budget=None) -> dict:
    """Probe one variant in child processes; returns the search result and every probe.
    `on_probe(variant, seq, record)` is called as each probe ends; past `budget` (a
    `bench.timing.Budget`) the search stops and keeps what it found."""
    from bench.timing import Budget

    budget = budget or Budget(None)
    probes = {}

    def fits(seq: int) -> bool:
        if budget.spent():
            raise _BudgetSpent
        argv = [
            "--probe",
            "--variant",
            variant,
            "--seq",
            str(seq),
            "--config",
            repo_path(spec.config),
        ]
        argv += ["--budget-mib", str(spec.budget_mib)] if spec.budget_mib else []
        argv += [*spec.overrides, f"--config.attention.impl={spec.impl}"]
        timeout = min(spec.timeout, budget.left() + BUDGET_GRACE_S)
        records, status = run_child("bench.max_context", argv, timeout)
        record = records[0] if records else {}
        if status == "ok":  # a clean exit carries its own verdict ('ok' or 'over budget')
            status = record.get("status", "no record")
        probes[seq] = dict(record, status=status)
        if on_probe is not None:
            on_probe(variant, seq, probes[seq])
        if status == "timeout" and budget.spent():
            raise _BudgetSpent  # cut by the budget: not a verdict on that length
        return status == "ok"

    try:
        best, fail = search(fits, spec.start, spec.cap, spec.resolution)
        stopped = None
    except _BudgetSpent:
        ran = [s for s, p in probes.items() if p["status"] == "ok"]
        best = max(ran, default=None)
        failed = [
            s
            for s, p in probes.items()
            if p["status"] not in ("ok", "timeout") and (best is None or s > best)
        ]
        fail = min(failed, default=None)
        stopped = budget.skipped()
    return dict(variant=variant, best=best, fail=fail, probes=probes, stopped=stopped)


BUDGET_GRACE_S = 60.0


def _tokens(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n // 1024}K" if n % 1024 == 0 else f"{n:,}"


def _row(result: dict, spec: MaxContextSpec) -> tuple:
    v = VARIANTS[result["variant"]]
    at_best = result["probes"].get(result["best"], {})
    failed = result["probes"].get(result["fail"], {})
    best = _tokens(result["best"]) + (" (cap)" if result["best"] == spec.cap else "")
    if result.get("stopped"):
        best += " (search stopped: time budget)"
    fail = "-" if result["fail"] is None else f"{_tokens(result['fail'])} ({failed['status']})"
    probes = ", ".join(f"{_tokens(s)} {p['status']}" for s, p in sorted(result["probes"].items()))
    return (
        result["variant"],
        v.what,
        best,
        fail,
        fmt(at_best.get("peak_gib"), ".3g"),
        fmt(at_best.get("xla_gib"), ".3g"),
        fmt(at_best.get("step_s"), ".2f"),
        v.published,
        probes,
    )


PROBE_HEADER = ["variant", "seq", "status", "peak GiB", "XLA est. GiB", "compile s", "step s"]
HEADER = [
    "variant",
    "what",
    "longest that ran",
    "first that did not",
    "peak GiB",
    "XLA est. GiB",
    "step s",
    "BPT paper (1B, A100)",
    "probes",
]


def run(spec: MaxContextSpec, out_dir: str, toy: bool = False) -> str:
    """Search every variant; write `max_context.md` (each probe the moment it ends, then the
    longest length per variant) and a bar chart. Returns the md path."""
    import jax

    from bench.attention import preferred_kernel
    from bench.plots import save_bars
    from bench.timing import Budget

    if spec.impl == "auto":
        spec = dataclasses.replace(spec, impl=preferred_kernel(jax.devices()[0].platform))
    limit = (
        f"a probe fits when its step runs and XLA's estimate is <= {spec.budget_mib} MiB"
        if spec.budget_mib
        else "a probe fits when its step runs without running out of "
        "device memory (GPU: 95% of memory usable)"
    )
    notes = stamp(toy) + [
        f"{spec.config} {' '.join(spec.overrides)} on one device, kernel {spec.impl} (the "
        "blockwise variants), batch 1, one training step "
        f"per probe in its own process; {limit}; doubling from {_tokens(spec.start)}, then "
        f"bisection to {_tokens(spec.resolution)}, capped at {_tokens(spec.cap)}.",
        PUBLISHED_NOTE,
    ]
    if spec.budget_s is not None:
        notes.append(f"Probes start only within a {spec.budget_s:g} s budget.")
    path = os.path.join(out_dir, "max_context.md")
    table = Table(
        "Max context: longest sequence that trains one step on one device",
        notes,
        PROBE_HEADER,
        path,
    )

    def probed(variant, seq, p):
        table.add(
            (
                variant,
                _tokens(seq),
                p["status"],
                fmt(p.get("peak_gib"), ".3g"),
                fmt(p.get("xla_gib"), ".3g"),
                fmt(p.get("compile_s")),
                fmt(p.get("step_s"), ".2f"),
            )
        )

    budget = Budget(spec.budget_s)
    results = [search_variant(spec, variant, probed, budget) for variant in spec.variants]
    table.section("Longest sequence per variant", HEADER)
    for r in results:
        table.add(_row(r, spec))
    bars = {r["variant"]: r["best"] or 0 for r in results}
    labels = {k: _tokens(b) + (" (cap)" if b == spec.cap else "") for k, b in bars.items()}
    table.image(
        try_plot(
            save_bars,
            os.path.join(out_dir, "max_context.png"),
            "Longest trainable sequence",
            stamp(toy),
            "tokens",
            bars,
            labels,
        )
    )
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.max_context",
        description=__doc__.split("\n")[0],
        epilog="config fields: --config.<key>=<value>, as for train.py",
    )
    default = MaxContextSpec()
    ap.add_argument("--variants", default=",".join(default.variants))
    ap.add_argument("--start", type=int, default=default.start)
    ap.add_argument("--cap", type=int, default=default.cap)
    ap.add_argument("--resolution", type=int, default=default.resolution)
    ap.add_argument("--impl", default=default.impl, help="kernel of the blockwise variants")
    ap.add_argument("--budget-mib", type=int, default=None)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="the quick search (MaxContextSpec.quick; the size options are ignored)",
    )
    ap.add_argument("--out", default=default_out_dir("max_context"))
    ap.add_argument("--probe", action="store_true", help="child side: one step, one record")
    ap.add_argument("--variant", default="lclm")
    ap.add_argument("--seq", type=int, default=0)
    from lclm.cli import parse_cli, run_cli
    from lclm.writes import check_output

    def body():
        # a bad config fails here, not in every probe (which measure the file's fields, not
        # a schedule's stages)
        args, _ = parse_cli(ap, argv, default.config, runs_stages=False)
        if args.probe:
            from lclm.parallel.devices import allow_gpu_host_memory

            allow_gpu_host_memory()  # before JAX starts: the offload probes' host memory
            emit_record(probe(args.config, args.overrides, args.variant, args.seq, args.budget_mib))
            return 0
        check_output("--out", args.out)  # before the search, not at its first row
        spec = MaxContextSpec(
            args.config,
            tuple(args.overrides),
            tuple(args.variants.split(",")),
            args.impl,
            args.start,
            args.cap,
            args.resolution,
            args.budget_mib,
        )
        if args.quick:
            spec = dataclasses.replace(
                MaxContextSpec().quick(),
                config=args.config,
                overrides=tuple(args.overrides),
                impl=args.impl,
            )
        run(spec, args.out)

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())

"""Training-step throughput: tokens/s, MFU and peak memory of one full train step.

    python -m bench.train_step --config configs/llama1b.py --seq 8192,32768 \
        [--impls blockwise,pallas_gpu] [--baseline] [--isolate] \
        --config.mesh.fsdp=1 --config.mesh.sp=1
    python -m bench.train_step --config configs/demo.py --seq 512 --layouts striped,contiguous \
        --config.model.n_layers=1

Synthetic tokens (one document per row), the real model, ring attention, optimizer and
shardings of the config (`--config.<key>=<value>` overrides its fields, as for train.py);
the attention kernel is `config.attention.impl` (`--impls` runs several). `--baseline` adds,
per length, the plain single-device step of `bench.baseline` (cuDNN attention on GPUs) on the
same model, and every row shows its tokens/s as a ratio to it. MFU counts causal
attention as half the square (see `lclm.train.metrics.flops_per_token`); on a CPU there is
no peak to divide by, and the table says so: CPU numbers are not a performance result.
`--isolate` runs every row in its own process, so an out-of-memory row is reported as OOM and
each row's peak memory is its own (a process's peak counter never goes down).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

from bench import int_list, repo_path
from bench.isolate import emit_record, run_child
from bench.report import emit_table, error_status, fmt, stamp

MESH_AXES = ("dp", "fsdp", "tp", "sp")


@dataclasses.dataclass(frozen=True)
class ModelRun:
    """One model of a suite: a config file (relative to the repository), lengths, and
    overrides as command-line arguments (`--config.model.n_layers=2`, as for train.py)."""
    config: str
    seqs: tuple[int, ...]
    overrides: tuple[str, ...] = ()
    note: str = ""  # why the overrides (shown under the table)


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    """The train-step part of a suite."""
    models: tuple[ModelRun, ...]
    # those usable run; 'auto' runs what the trainer would pick (the row names it)
    impls: tuple[str, ...] = ("blockwise", "pallas_gpu", "pallas_tpu", "tokamax_gpu")
    baseline: bool = True  # one `bench.baseline` row per (model, length); needs a 1-device mesh
    steps: int = 3
    warmup: int = 2
    isolate: bool = True
    timeout: float = 1800.0

    def smallest(self) -> "TrainSpec":
        first = self.models[0]
        return dataclasses.replace(self, models=(dataclasses.replace(first, seqs=first.seqs[:1]),),
                                   steps=1, warmup=0)


def row_config(config_path: str, overrides, seq: int, layout: str | None, impl: str | None):
    """The config of one row: the file, its overrides (`--config.a.b=V` arguments), then this
    row's length/layout/kernel."""
    from lclm.config import config_from_argv

    config = config_from_argv(["bench.train_step", "--config", config_path, *overrides],
                              config_path, runs_stages=False)  # one step of the file's fields
    config.data.seq_len = seq
    if layout:
        config.attention.layout = layout
    if impl:
        config.attention.impl = impl
    return config


def synthetic_batch(vocab_size: int, batch_size: int, seq: int, layout: str, sp: int, mesh):
    """Random tokens as one document per row, in the layout's order, on the mesh (or on the
    first device without one)."""
    import jax
    import numpy as np

    from lclm.data.loader import batch_sharding
    from lclm.ops.layout import batch_to_layout

    rng = np.random.default_rng(0)
    tok = rng.integers(3, vocab_size, (batch_size, seq + 1)).astype(np.int32)
    batch = dict(tokens=tok[:, :-1], targets=tok[:, 1:],
                 loss_mask=np.ones((batch_size, seq), np.float32),
                 positions=np.broadcast_to(np.arange(seq, dtype=np.int32), (batch_size, seq)),
                 segment_ids=np.ones((batch_size, seq), np.int32))
    batch = batch_to_layout(batch, layout, sp)
    where = jax.devices()[0] if mesh is None else batch_sharding(mesh)
    return {k: jax.device_put(np.ascontiguousarray(v), where) for k, v in batch.items()}


def _xla_bytes(compiled) -> int | None:
    """XLA's own estimate of the step's device memory (arguments + outputs + temporaries,
    less donated buffers), or None where the backend gives none."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return (stats.argument_size_in_bytes + stats.output_size_in_bytes
            + stats.temp_size_in_bytes - stats.alias_size_in_bytes)


BASELINE = "baseline"  # the kernel column's name for `bench.baseline`'s rows


def measure(config, *, steps: int, warmup: int, budget_bytes: int | None = None,
            model_patch=None, baseline: bool = False) -> dict:
    """Build the state, compile the step, run `warmup` untimed and `steps` timed steps.

    Returns a record: params, seq, impl, layout, mesh, compile_s, xla_gib, status and, when
    the step ran, step_s, tokens_s, mfu, peak_gib, loss. With `budget_bytes`, a step whose XLA
    memory estimate exceeds it is not run (status 'over budget': the only memory limit on a
    CPU). `model_patch` is a context manager entered while the step is traced
    (max_context's dense-attention baseline swaps the model's attention call with it).
    `baseline` measures `bench.baseline`'s plain step on the same model instead.
    """
    import contextlib

    import jax

    from lclm.train.loop import attention_kernel
    from lclm.train.metrics import flops_per_token, peak_flops

    model, sizes, state, batch, step = (_build_baseline if baseline else _build)(config)
    kernel = BASELINE if baseline else attention_kernel(config, model, sizes["sp"],
                                                        jax.devices()[0].platform)
    record = dict(params=model.param_count(), seq=config.data.seq_len,
                  impl=kernel, layout="-" if baseline else config.attention.layout,
                  mesh="x".join(str(sizes[a]) for a in MESH_AXES))
    t0 = time.perf_counter()
    with model_patch or contextlib.nullcontext():
        compiled = jax.jit(step, donate_argnums=0).lower(state, batch).compile()
    record["compile_s"] = time.perf_counter() - t0
    estimate = _xla_bytes(compiled)
    record["xla_gib"] = None if estimate is None else estimate / 2 ** 30
    if budget_bytes is not None and estimate is not None and estimate > budget_bytes:
        return dict(record, status="over budget")
    dt, metrics = _timed_steps(compiled, state, batch, warmup, steps)
    device = jax.devices()[0]
    peak = peak_flops(device.device_kind)
    tokens = config.data.batch_size * config.data.seq_len
    flops = flops_per_token(model, config.data.seq_len) * tokens
    peak_mem = (device.memory_stats() or {}).get("peak_bytes_in_use")
    return dict(record, status="ok", step_s=dt, tokens_s=tokens / dt,
                mfu=flops / dt / (peak * math.prod(sizes.values())) if peak else None,
                peak_gib=None if peak_mem is None else peak_mem / 2 ** 30,
                loss=float(metrics["loss"]))


def _build(config):
    """(model config, mesh sizes, fresh train state, synthetic batch, un-jitted step)."""
    import jax

    from lclm.config import validate
    from lclm.models.llama import AttentionConfig, LlamaConfig
    from lclm.parallel.mesh import make_mesh
    from lclm.train.loop import init_state
    from lclm.train.step import make_optimizer, make_train_step

    devices = jax.devices()
    sizes = validate(config, len(devices))
    mesh = make_mesh(**sizes, devices=devices)
    model = LlamaConfig.from_config(config.model)
    attention = AttentionConfig.from_config(config.attention)
    optimizer = make_optimizer(config.train)
    state = init_state(model, optimizer, mesh, config.seed)
    batch = synthetic_batch(model.vocab_size, config.data.batch_size, config.data.seq_len,
                            attention.layout, sizes["sp"], mesh)
    return model, sizes, state, batch, make_train_step(model, attention, config.train, mesh,
                                                       optimizer)


def _build_baseline(config):
    """`_build` for the plain single-device step (`bench.baseline`), original token order."""
    import math

    import jax

    from bench import baseline
    from lclm.config import ConfigError, validate
    from lclm.models.llama import LlamaConfig
    from lclm.train.step import make_optimizer

    sizes = validate(config, len(jax.devices()))
    if math.prod(sizes.values()) != 1:
        raise ConfigError(f"the baseline runs on one device, not the mesh {sizes}; "
                          "set --config.mesh.dp/fsdp/tp/sp=1")
    model = LlamaConfig.from_config(config.model)
    optimizer = make_optimizer(config.train)
    state = baseline.init_state(model, optimizer, config.seed)
    batch = synthetic_batch(model.vocab_size, config.data.batch_size, config.data.seq_len,
                            "contiguous", 1, None)
    return model, sizes, state, batch, baseline.make_step(model, optimizer)


def _timed_steps(compiled, state, batch, warmup: int, steps: int):
    """(seconds per step over `steps` >= 1 timed steps, the last step's metrics)."""
    import jax

    sync_each = jax.devices()[0].platform == "cpu"  # see sync_each_step in lclm.train.loop
    for _ in range(warmup):
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
    steps = max(steps, 1)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, metrics = compiled(state, batch)
        if sync_each:
            jax.block_until_ready(metrics)
    jax.block_until_ready(metrics)
    return (time.perf_counter() - t0) / steps, metrics


def measure_row(config_path: str, overrides, seq: int, layout: str | None, impl: str | None,
                *, steps: int, warmup: int) -> dict:
    """One row measured in this process; `impl` BASELINE measures `bench.baseline`'s step."""
    baseline = impl == BASELINE
    config = row_config(config_path, overrides, seq, layout, None if baseline else impl)
    return measure(config, steps=steps, warmup=warmup, baseline=baseline)


def run_row(run: ModelRun, seq: int, layout: str | None, impl: str | None, *, steps: int,
            warmup: int, isolate: bool, timeout: float) -> dict:
    """One row, in this process or (isolate) in a child; failures become a status."""
    base = dict(seq=seq, impl=impl or "", layout=layout or "", status="")
    if isolate:
        argv = ["--config", repo_path(run.config), "--seq", str(seq), "--steps", str(steps),
                "--warmup", str(warmup), "--record", *run.overrides]
        argv += ["--layouts", layout] if layout else []
        argv += ["--impls", impl] if impl else []
        records, status = run_child("bench.train_step", argv, timeout)
        return records[0] if records else dict(base, status=status)
    try:
        return measure_row(repo_path(run.config), run.overrides, seq, layout, impl, steps=steps,
                           warmup=warmup)
    except Exception as e:  # noqa: BLE001  (OOM or a kernel that cannot run: report it)
        return dict(base, status=error_status(e))


def collect(spec: TrainSpec, impls, layouts=(None,)) -> list[dict]:
    """Every (model, seq, kernel, layout) row of `spec`, each tagged with its model's name;
    with `spec.baseline`, a baseline row first for every (model, seq)."""
    kernels = [(BASELINE, None)] if spec.baseline else []  # the baseline has no layout
    kernels += [(impl, layout) for impl in impls for layout in layouts]
    rows = []
    for run in spec.models:
        for seq in run.seqs:
            for impl, layout in kernels:
                r = run_row(run, seq, layout, impl, steps=spec.steps, warmup=spec.warmup,
                            isolate=spec.isolate, timeout=spec.timeout)
                rows.append(dict(r, model=os.path.basename(run.config)))
    return rows


def _plot(records: list[dict], path: str, toy: bool) -> str:
    from bench.plots import Panel, save_lines

    speed = Panel("throughput", "sequence length (tokens)", "tokens/s")
    mfu = Panel("MFU (causal attention counted as half)", "sequence length (tokens)", "MFU %")
    memory = Panel("memory", "sequence length (tokens)", "GiB")
    for r in records:
        label = f"{r['model']} {r.get('impl', '')} {r.get('layout', '')}".strip()
        speed.add(label, r["seq"], r.get("tokens_s"))
        mfu.add(label, r["seq"], None if r.get("mfu") is None else 100 * r["mfu"])
        memory.add(f"{label} peak", r["seq"], r.get("peak_gib"))
        memory.add(f"{label} XLA estimate", r["seq"], r.get("xla_gib"), "x--")
    panels = [speed] + ([mfu] if mfu.series else []) + [memory]
    return save_lines(path, "Train step", stamp(toy), panels)


def report(records: list[dict], spec: TrainSpec, path: str = "", notes=(),
           toy: bool = False) -> str:
    """Print the table; with `path`, also write it there and its plot next to it (.png)."""
    baseline = {(r.get("model"), r["seq"]): r.get("tokens_s") for r in records
                if r.get("impl") == BASELINE and r.get("status") == "ok"}

    def ratio(r):
        base = baseline.get((r.get("model"), r["seq"]))
        return None if not base or r.get("tokens_s") is None else r["tokens_s"] / base

    rows = [(r.get("model", ""), fmt(r.get("params"), ",.1f", 1e-6), r["seq"],
             r.get("impl", ""), r.get("layout", ""), r.get("mesh", "-"),
             fmt(r.get("step_s"), ",.1f", 1e3), fmt(r.get("tokens_s"), ",.0f"),
             fmt(ratio(r), ".2f"), fmt(r.get("mfu"), ".1%"), fmt(r.get("peak_gib"), ".3g"),
             fmt(r.get("xla_gib"), ".3g"), fmt(r.get("compile_s")), fmt(r.get("loss"), ".3f"),
             r.get("status", "")) for r in records]
    lines = stamp(toy) + [
        "MFU counts causal attention as half the square (n/a without a known peak, e.g. on "
        f"CPU); {spec.steps} timed steps after {spec.warmup} warm-up steps; synthetic tokens; "
        "vs baseline = tokens/s over the 'baseline' row of the same model and length "
        "(bench.baseline: plain single-device step, jax.nn.dot_product_attention, cuDNN on "
        "GPUs); "
        "peak = the device's peak bytes in use (one process per row when isolated), XLA "
        "estimate = the compiled step's memory analysis.", *notes]
    images = [_plot(records, os.path.splitext(path)[0] + ".png", toy)] if path else []
    emit_table("Train step: tokens/s, MFU, memory", lines,
               ["model", "params (M)", "seq", "kernel", "layout", "mesh dp x fsdp x tp x sp",
                "step ms", "tokens/s", "vs baseline", "MFU", "peak GiB", "XLA est. GiB",
                "compile s", "loss",
                "status"], rows, path, images=images)
    return path


def run(spec: TrainSpec, out_dir: str, toy: bool = False) -> str:
    """The suite's train-step part: every usable kernel of `spec.impls`. Returns the md path."""
    import jax

    from bench.attention import usable_kernels

    usable, skipped = usable_kernels(jax.devices()[0].platform)
    impls = [i for i in spec.impls if i == "auto" or i in usable]
    records = collect(spec, impls)
    notes = [f"{run.config}: {run.note}" for run in spec.models if run.note]
    notes.append("Skipped kernels: " + ("; ".join(skipped) if skipped else "none") + ".")
    return report(records, spec, os.path.join(out_dir, "train_step.md"), notes, toy)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.train_step",
                                 description=__doc__.split("\n")[0],
                                 epilog="config fields: --config.<key>=<value>, as for train.py")
    ap.add_argument("--seq", default="", help="comma-separated sequence lengths")
    ap.add_argument("--layouts", default="", help="comma-separated layouts (default: config's)")
    ap.add_argument("--impls", default="", help="comma-separated kernels (default: config's)")
    ap.add_argument("--baseline", action="store_true",
                    help="also the plain single-device step (bench.baseline) per length")
    ap.add_argument("--steps", type=int, default=5, help="timed steps after the warm-up")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps after compiling")
    ap.add_argument("--isolate", action="store_true", help="one child process per row")
    ap.add_argument("--record", action="store_true",
                    help="print machine-readable records only (the child side of --isolate)")
    ap.add_argument("--out", default="", help="also write the table to this .md file (and a "
                    ".png plot next to it)")

    from lclm.config import mesh_device_count, parse_cli
    from lclm.errors import StartupError
    from lclm.parallel.devices import request_cpu_devices

    try:
        args, base = parse_cli(ap, argv, runs_stages=False)  # a schedule's stages do not run
        request_cpu_devices(mesh_device_count(base) or 1)
        seqs = int_list(args.seq) or (base.data.seq_len,)
        layouts = tuple(args.layouts.split(",")) if args.layouts else (None,)
        impls = tuple(args.impls.split(",")) if args.impls else (None,)
        spec = TrainSpec(models=(ModelRun(os.path.abspath(args.config), seqs,
                                          tuple(args.overrides)),),
                         steps=args.steps, warmup=args.warmup, isolate=args.isolate,
                         baseline=args.baseline)
        if args.record:
            for seq in seqs:
                for layout in layouts:
                    for impl in impls:
                        record = measure_row(args.config, args.overrides, seq, layout, impl,
                                             steps=args.steps, warmup=args.warmup)
                        emit_record(dict(record, model=os.path.basename(args.config)))
            return 0
        report(collect(spec, impls, layouts), spec, args.out)
        return 0
    except (StartupError, FileNotFoundError) as e:  # a bad --config FILE/--config.*: one line
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""Training-step throughput: tokens/s, MFU and peak memory of one full train step.

    python -m bench.train_step --config configs/llama1b.py --seq 8192,32768 \
        [--impls blockwise,pallas_gpu] [--baseline] [--isolate] [--quick] \
        --config.mesh.fsdp=1 --config.mesh.sp=1
    python -m bench.train_step --config configs/demo.py --seq 512 --layouts striped,contiguous \
        --config.model.n_layers=1

Synthetic tokens (one document per row), the real model, ring attention, optimizer and
shardings of the config (`--config.<key>=<value>` overrides its fields, as for train.py);
the attention kernel is `config.attention.impl` (`--impls` runs several). `--baseline` adds,
per length, the plain single-device step of `bench.baseline` (cuDNN attention on GPUs) on the
same model with no layer remat, with `dots` saved and with full remat; the fastest of those
that fits is the baseline, and every row shows its tokens/s as a ratio to it. MFU is lclm's:
6N + 6 L T D FLOPs per token, causal attention counted as half the square
(`lclm.train.metrics.flops_per_token`); on a CPU there is no peak to divide by, and the table
says so: CPU numbers are not a performance result. `--isolate` runs every row in its own
process (the baseline's three variants share one), so an out-of-memory row is reported as
OOM and each row's peak memory is its own (a process's peak counter never goes down).
Every row is written to the table (`--out`) and stdout the moment it is measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from typing import Any, cast

from bench import int_list, repo_path
from bench.isolate import emit_record, run_child
from bench.report import MFU_NOTE, Table, error_status, fmt, stamp, try_plot
from lclm.config import MESH_AXES
from lclm.ops.kernels import KERNELS


@dataclasses.dataclass(frozen=True)
class ModelRun:
    """One model of a suite: a config file (relative to the repository), lengths, and
    overrides as command-line arguments (`--config.model.n_layers=2`, as for train.py)."""

    config: str
    seqs: tuple[int, ...]
    overrides: tuple[str, ...] = ()
    note: str = ""  # why the overrides (shown under the table)

    def with_remat(self, remat: str | None) -> ModelRun:
        """This run with `model.remat` overridden (None: the config's own)."""
        if remat is None:
            return self
        return dataclasses.replace(
            self, overrides=(*self.overrides, f"--config.model.remat={remat}")
        )


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    """The train-step part of a suite."""

    models: tuple[ModelRun, ...]
    # those usable run (by default every registered kernel); 'auto' runs what the trainer
    # would pick (the row names it)
    impls: tuple[str, ...] = tuple(KERNELS)
    baseline: bool = True  # one `bench.baseline` row per (model, length); needs a 1-device mesh
    steps: int = 3
    warmup: int = 2
    isolate: bool = True
    timeout: float = 1800.0  # per child process (one row; the baseline's three remat variants)
    budget_s: float | None = None  # stop starting rows after this many seconds
    # lclm's rows per remat policy (None: the config's), as the baseline is timed per policy
    remats: tuple[str | None, ...] = (None,)

    def quick(self) -> TrainSpec:
        """The first model at 8K and 32K tokens, the kernel `auto` picks against the
        baseline: per length one child for the baseline's three remat variants (3 compiles)
        and one for lclm with the config's remat and one with none (1 compile each), 3 timed
        steps after 1 warm-up, within a 400 s budget (a child started near its end gets a
        minute past it)."""
        first = self.models[0]
        return dataclasses.replace(
            self,
            models=(dataclasses.replace(first, seqs=(8192, 32768)),),
            impls=("auto",),
            baseline=True,
            steps=3,
            warmup=1,
            isolate=True,
            timeout=300.0,
            budget_s=400.0,
            remats=(None, "none"),
        )

    def smallest(self) -> TrainSpec:
        first = self.models[0]
        return dataclasses.replace(
            self, models=(dataclasses.replace(first, seqs=first.seqs[:1]),), steps=1, warmup=0
        )


def row_config(config_path: str, overrides, seq: int, layout: str | None, impl: str | None):
    """The config of one row: the file, its overrides (`--config.a.b=V` arguments), then this
    row's length/layout/kernel."""
    from lclm.cli import config_from_argv

    config = config_from_argv(
        ["bench.train_step", "--config", config_path, *overrides], config_path, runs_stages=False
    )  # one step of the file's fields
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
    batch = dict(
        tokens=tok[:, :-1],
        targets=tok[:, 1:],
        loss_mask=np.ones((batch_size, seq), np.float32),
        positions=np.broadcast_to(np.arange(seq, dtype=np.int32), (batch_size, seq)),
        segment_ids=np.ones((batch_size, seq), np.int32),
    )
    batch = batch_to_layout(batch, layout, sp)
    where = jax.devices()[0] if mesh is None else batch_sharding(mesh)
    return {k: jax.device_put(np.ascontiguousarray(v), where) for k, v in batch.items()}


BASELINE = "baseline"  # the kernel column's name for `bench.baseline`'s rows


def measure(
    config,
    *,
    steps: int,
    warmup: int,
    budget_bytes: int | None = None,
    model_patch=None,
    baseline: str | None = None,
) -> dict:
    """Build the state, compile the step, run `warmup` untimed and `steps` timed steps.

    Returns a record: params, seq, impl, layout, remat, mesh, compile_s, xla_gib, status and,
    when the step ran, step_s, tokens_s, mfu, peak_gib, loss. With `budget_bytes`, a step whose
    XLA memory estimate exceeds it is not run (status 'over budget': the only memory limit on
    a CPU). `model_patch` is a context manager entered while the step is traced
    (max_context's dense-attention baseline swaps the model's attention call with it).
    `baseline` (a key of `bench.baseline.REMATS`) measures `bench.baseline`'s plain step with
    that layer remat on the same model instead; where the device reports its memory, a
    baseline step whose XLA estimate exceeds it is not run (status 'does not fit').
    """
    import jax

    from lclm.hardware import peak_flops
    from lclm.train.metrics import flops_per_token
    from lclm.train.remat_choice import compiled_bytes

    record, compiled, (model, sizes, state, batch) = compile_row(
        config, model_patch=model_patch, baseline=baseline
    )
    estimate = compiled_bytes(compiled)
    if budget_bytes is not None and estimate is not None and estimate > budget_bytes:
        return dict(record, status="over budget")
    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit") if baseline else None
    if limit and estimate is not None and estimate > limit:
        return dict(
            record,
            status=f"does not fit: XLA estimate {estimate / 2**30:.1f} GiB "
            f"> {limit / 2**30:.1f} GiB",
        )
    dt, metrics = _timed_steps(compiled, state, batch, warmup, steps)
    device = jax.devices()[0]
    peak = peak_flops(device.device_kind)
    tokens = config.data.batch_size * config.data.seq_len
    flops = flops_per_token(model, config.data.seq_len) * tokens
    peak_mem = (device.memory_stats() or {}).get("peak_bytes_in_use")
    return dict(
        record,
        status="ok",
        step_s=dt,
        tokens_s=tokens / dt,
        mfu=flops / dt / (peak * math.prod(sizes.values())) if peak else None,
        peak_gib=None if peak_mem is None else peak_mem / 2**30,
        loss=float(metrics["loss"]),
    )


def compile_row(config, *, devices=None, model_patch=None, baseline: str | None = None):
    """(the row's record: params, seq, impl, layout, remat, mesh, compile_s, xla_gib; the
    compiled step; (model config, mesh sizes, state, batch)) for `measure` (see there). On
    described `devices` (`lclm.plan.aot.target_devices`: `--compile-only`) the step is lowered for
    them with an abstract state and batch, and only compiled. `model.remat='auto'` is chosen
    as training chooses it (`lclm.train.remat_choice`): against the device's budget, and
    on described devices against none (its first candidate); the record's remat says what it
    chose, e.g. 'auto: none'."""
    import contextlib

    import jax

    from lclm.train.remat_choice import AUTO, choose, compiled_bytes, device_budget

    if not baseline and config.model.remat == AUTO:

        def compile_policy(policy: str):
            c = config.copy_and_resolve_references()
            c.model.remat = policy
            row = compile_row(c, devices=devices, model_patch=model_patch)
            return row, compiled_bytes(row[1])

        choice = choose(compile_policy, None if devices else device_budget(jax.devices()[0]))
        record, compiled, built = cast(tuple[dict, Any, Any], choice.compiled)
        return dict(record, remat=f"auto: {choice.policy}"), compiled, built

    from lclm.config import AttentionConfig
    from lclm.models.decoder import param_count
    from lclm.plan import aot
    from lclm.train.startup_checks import attention_kernel

    target = (devices or jax.devices())[0]
    if baseline:
        model, sizes, state, batch, step = _build_baseline(config, baseline, devices)
        kernel = BASELINE
    else:
        model, sizes, state, batch, step = _build(config, devices)
        # 'auto' resolved for the device the step is built for (a described GPU's generation)
        with aot.lowering_for(target) if devices else contextlib.nullcontext():
            kernel = attention_kernel(
                AttentionConfig.from_config(config.attention),
                config.data.seq_len,
                model,
                sizes["sp"],
                target.platform,
            )
    record = dict(
        params=param_count(model),
        seq=config.data.seq_len,
        impl=kernel,
        layout="-" if baseline else config.attention.layout,
        remat=baseline or config.model.remat,
        mesh="x".join(str(sizes[a]) for a in MESH_AXES),
    )
    t0 = time.perf_counter()
    with (
        model_patch or contextlib.nullcontext(),
        aot.lowering_for(target) if devices else contextlib.nullcontext(),
    ):
        lowered = jax.jit(step, donate_argnums=0).lower(state, batch)
    record["lower_s"] = time.perf_counter() - t0  # tracing and lowering, within compile_s
    compiled = lowered.compile()
    record["compile_s"] = time.perf_counter() - t0
    estimate = compiled_bytes(compiled)
    record["xla_gib"] = None if estimate is None else estimate / 2**30
    return record, compiled, (model, sizes, state, batch)


def _build(config, devices=None):
    """(model config, mesh sizes, fresh train state, synthetic batch, un-jitted step). On
    `devices` (described ones, `lclm.plan.aot.target_devices`) the state and batch are abstract:
    shapes and shardings to compile against, nothing allocated."""
    import jax

    from lclm.config import AttentionConfig, ModelConfig
    from lclm.data.loader import abstract_batch, batch_sharding
    from lclm.parallel.mesh import make_mesh
    from lclm.plan import aot
    from lclm.train.startup_checks import checked
    from lclm.train.step import make_optimizer, make_train_step
    from lclm.workdir.state import init_state

    described = devices is not None
    devices = devices or jax.devices()
    _, sections, sizes = checked(config, len(devices))
    mesh = make_mesh(**sizes, devices=devices[: math.prod(sizes.values())])
    model = ModelConfig.from_config(config.model)
    attention = AttentionConfig.from_config(config.attention)
    optimizer = make_optimizer(sections.train)
    d = config.data
    if described:
        state = aot.abstract_state(model, optimizer, mesh)
        batch = abstract_batch(d.batch_size, d.seq_len, batch_sharding(mesh))
    else:
        state = init_state(model, optimizer, mesh, config.seed)
        batch = synthetic_batch(
            model.vocab_size, d.batch_size, d.seq_len, attention.layout, sizes["sp"], mesh
        )
    return (
        model,
        sizes,
        state,
        batch,
        make_train_step(
            model,
            attention,
            sections.train,
            mesh,
            optimizer,
            document_mask=sections.data.document_mask,
        ),
    )


def _build_baseline(config, remat: str, devices=None):
    """`_build` for the plain single-device step (`bench.baseline`) with layer remat `remat`,
    original token order."""
    import jax

    from bench import baseline
    from lclm.config import ModelConfig
    from lclm.data.loader import abstract_batch
    from lclm.errors import ConfigError
    from lclm.train.startup_checks import checked
    from lclm.train.step import make_optimizer

    described = devices is not None
    devices = devices or jax.devices()
    _, sections, sizes = checked(config, len(devices))
    if math.prod(sizes.values()) != 1:
        raise ConfigError(
            f"the baseline runs on one device, not the mesh {sizes}; "
            "set --config.mesh.dp/fsdp/tp/sp=1"
        )
    model = ModelConfig.from_config(config.model)
    optimizer = make_optimizer(sections.train)
    d = config.data
    if described:
        where = jax.sharding.SingleDeviceSharding(devices[0])
        shapes = jax.eval_shape(lambda: baseline.init_state(model, optimizer, config.seed))
        state = jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=where), shapes
        )
        batch = abstract_batch(d.batch_size, d.seq_len, where)
    else:
        state = baseline.init_state(model, optimizer, config.seed)
        batch = synthetic_batch(model.vocab_size, d.batch_size, d.seq_len, "contiguous", 1, None)
    return model, sizes, state, batch, baseline.make_step(model, optimizer, remat)


def _timed_steps(compiled, state, batch, warmup: int, steps: int):
    """(seconds per step over `steps` >= 1 timed steps, the last step's metrics)."""
    import jax

    sync_each = jax.devices()[0].platform == "cpu"  # see _Loop.sync in lclm.train.loop
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


def row_remats(impl: str | None) -> tuple[str | None, ...]:
    """The records one row yields: the baseline's remat variants, or one (the config's)."""
    from bench.baseline import REMATS

    return tuple(REMATS) if impl == BASELINE else (None,)


def measure_rows(
    config_path: str,
    overrides,
    seq: int,
    layout: str | None,
    impl: str | None,
    *,
    steps: int,
    warmup: int,
):
    """The records of one row measured in this process, yielded as each is measured: one for
    an lclm kernel; for `impl` BASELINE, one per `bench.baseline.REMATS` variant, in order
    (a variant that fails, e.g. out of memory, is a status and the next one runs)."""
    if impl != BASELINE:
        config = row_config(config_path, overrides, seq, layout, impl)
        yield measure(config, steps=steps, warmup=warmup)
        return
    config = row_config(config_path, overrides, seq, None, None)
    for remat in row_remats(impl):
        try:
            yield measure(config, steps=steps, warmup=warmup, baseline=remat)
        except Exception as e:  # noqa: BLE001  (OOM: report it, try the next variant)
            yield dict(seq=seq, impl=BASELINE, layout="-", remat=remat, status=error_status(e))


def run_row(
    run: ModelRun,
    seq: int,
    layout: str | None,
    impl: str | None,
    *,
    steps: int,
    warmup: int,
    isolate: bool,
    timeout: float,
    on_record=None,
) -> list[dict]:
    """One row's records (the baseline's: one per remat variant), in this process or
    (isolate) in a child; failures become a status. `on_record(record)` is called as each
    record arrives, before the next one is measured."""
    on_record = on_record or (lambda r: None)
    model = os.path.basename(run.config)
    records = []

    def got(record):
        record = dict(record, model=model)
        records.append(record)
        on_record(record)

    expected = row_remats(impl)
    if isolate:
        argv = [
            "--config",
            repo_path(run.config),
            "--seq",
            str(seq),
            "--steps",
            str(steps),
            "--warmup",
            str(warmup),
            "--record",
            *run.overrides,
        ]
        argv += ["--layouts", layout] if layout else []
        argv += ["--impls", impl] if impl else []
        _, status = run_child("bench.train_step", argv, timeout, on_record=got)
    else:
        status = "ok"
        try:
            for record in measure_rows(
                repo_path(run.config), run.overrides, seq, layout, impl, steps=steps, warmup=warmup
            ):
                got(record)
        except Exception as e:  # noqa: BLE001  (OOM or a kernel that cannot run: report it)
            status = error_status(e)
    for remat in expected[len(records) :]:  # what the child did not get to
        got(
            dict(
                seq=seq,
                impl=impl or "",
                layout=layout or "",
                remat=remat or "",
                status=status if status != "ok" else "no record",
            )
        )
    return records


def baseline_choice(records: list[dict], model: str, seq: int) -> dict:
    """The row naming a model and length's baseline: the fastest remat variant that fits
    (`bench.baseline.fastest_that_fits`), or a 'no baseline' row."""
    from bench.baseline import REMATS, fastest_that_fits

    best = fastest_that_fits(records)
    if best is None:
        return dict(
            model=model,
            seq=seq,
            impl=BASELINE,
            layout="-",
            choice=True,
            remat=f"none of {'/'.join(REMATS)} ran",
            status="no baseline",
        )
    return dict(best, choice=True, remat=f"{best['remat']} (fastest that fits)")


def collect(spec: TrainSpec, impls, layouts=(None,), on_record=None) -> list[dict]:
    """Every (model, seq, kernel, layout) row of `spec`, each tagged with its model's name,
    in the order measured; `on_record(record)` is called as each arrives. With
    `spec.baseline`, first for every (model, seq) the baseline's remat variants and the row
    naming the fastest that fits (`choice`). Rows not started within `spec.budget_s` are
    'skipped'."""
    from bench.timing import Budget

    on_record = on_record or (lambda r: None)
    budget = Budget(spec.budget_s)
    # (kernel, layout, remat); the baseline has no layout and times its own remat variants
    kernels: list[tuple[str, str | None, str | None]] = (
        [(BASELINE, None, None)] if spec.baseline else []
    )
    kernels += [
        (impl, layout, remat) for impl in impls for layout in layouts for remat in spec.remats
    ]
    rows = []

    def add(record):
        rows.append(record)
        on_record(record)

    for run in spec.models:
        model = os.path.basename(run.config)
        for seq in run.seqs:
            for impl, layout, remat in kernels:
                if budget.spent():
                    for variant in row_remats(impl):
                        add(
                            dict(
                                model=model,
                                seq=seq,
                                impl=impl or "",
                                layout=layout or "",
                                remat=variant or remat or "",
                                status=budget.skipped(),
                            )
                        )
                    continue
                # a row started near the end of the budget gets at most a minute past it
                timeout = min(spec.timeout, budget.left() + BUDGET_GRACE_S)
                records = run_row(
                    run.with_remat(remat),
                    seq,
                    layout,
                    impl,
                    steps=spec.steps,
                    warmup=spec.warmup,
                    isolate=spec.isolate,
                    timeout=timeout,
                    on_record=add,
                )
                if impl == BASELINE:
                    add(baseline_choice(records, model, seq))
    return rows


BUDGET_GRACE_S = 60.0


def _plot(records: list[dict], path: str, toy: bool) -> str:
    from bench.plots import Panel, save_lines

    speed = Panel("throughput", "sequence length (tokens)", "tokens/s")
    mfu = Panel(
        "MFU (6N + 6LTD per token: causal attention counted as half)",
        "sequence length (tokens)",
        "MFU %",
    )
    memory = Panel("memory", "sequence length (tokens)", "GiB")
    for r in records:
        if r.get("choice"):  # a repeat of one of the baseline's variants
            continue
        remat = f" remat={r['remat']}" if r.get("impl") == BASELINE else ""
        label = f"{r['model']} {r.get('impl', '')} {r.get('layout', '')}{remat}".strip()
        speed.add(label, r["seq"], r.get("tokens_s"))
        mfu.add(label, r["seq"], None if r.get("mfu") is None else 100 * r["mfu"])
        memory.add(f"{label} peak", r["seq"], r.get("peak_gib"))
        memory.add(f"{label} XLA estimate", r["seq"], r.get("xla_gib"), "x--")
    panels = [speed] + ([mfu] if mfu.series else []) + [memory]
    return save_lines(path, "Train step", stamp(toy), panels)


HEADER = [
    "model",
    "params (M)",
    "seq",
    "kernel",
    "layout",
    "remat",
    "mesh dp x fsdp x tp x sp",
    "step ms",
    "tokens/s",
    "vs baseline",
    "MFU (6N + 6LTD per token)",
    "peak GiB",
    "XLA est. GiB",
    "compile s",
    "loss",
    "status",
]


class TrainReport:
    """The train-step table, written row by row (`add`), then its plot (`finish`)."""

    def __init__(self, spec: TrainSpec, path: str = "", notes=(), toy: bool = False):
        from bench.baseline import REMATS

        self.spec, self.path, self.toy = spec, path, toy
        self.records: list[dict] = []
        self.baseline: dict[tuple, float | None] = {}
        lines = stamp(toy) + [
            MFU_NOTE,
            f"{spec.steps} timed steps after {spec.warmup} warm-up steps; synthetic tokens; "
            "peak = the device's peak bytes in use (one process per row when isolated), XLA "
            "estimate = the compiled step's memory analysis.",
            "Baseline: bench.baseline, the plain single-device step (scanned layers, "
            "jax.nn.dot_product_attention: cuDNN on GPUs, chunked loss, AdamW) timed with "
            f"layer remat {', '.join(REMATS)} (dots = jax.checkpoint_policies.checkpoint_dots)"
            ", in that order in one process (memory grows along it, so each peak is its own"
            " when isolated); the row '<remat> (fastest that fits)' is the baseline, and "
            "vs baseline = tokens/s over its tokens/s at the same model and length.",
            *notes,
        ]
        if spec.budget_s is not None:
            lines.append(
                f"Rows start only within a {spec.budget_s:g} s budget (rows past it say so)."
            )
        self.table = Table("Train step: tokens/s, MFU, memory", lines, HEADER, path)

    def ratio(self, r: dict) -> float | None:
        base = self.baseline.get((r.get("model"), r["seq"]))
        if r.get("impl") == BASELINE and not r.get("choice"):
            return None  # a variant: the baseline is chosen after all of them
        return None if not base or r.get("tokens_s") is None else r["tokens_s"] / base

    def add(self, r: dict) -> None:
        if r.get("choice"):
            self.baseline[(r.get("model"), r["seq"])] = r.get("tokens_s")
        self.records.append(r)
        self.table.add(
            (
                r.get("model", ""),
                fmt(r.get("params"), ",.1f", 1e-6),
                r["seq"],
                r.get("impl", ""),
                r.get("layout", ""),
                r.get("remat", ""),
                r.get("mesh", "-"),
                fmt(r.get("step_s"), ",.1f", 1e3),
                fmt(r.get("tokens_s"), ",.0f"),
                fmt(self.ratio(r), ".2f"),
                fmt(r.get("mfu"), ".1%"),
                fmt(r.get("peak_gib"), ".3g"),
                fmt(r.get("xla_gib"), ".3g"),
                fmt(r.get("compile_s")),
                fmt(r.get("loss"), ".3f"),
                r.get("status", ""),
            )
        )

    def finish(self) -> str:
        """The plot (best effort) below the table. Returns the table's path."""
        if self.path:
            png = os.path.splitext(self.path)[0] + ".png"
            self.table.image(try_plot(_plot, self.records, png, self.toy))
        return self.path


def run(spec: TrainSpec, out_dir: str, toy: bool = False) -> str:
    """The suite's train-step part: every usable kernel of `spec.impls`. Returns the md path."""
    import jax

    from bench.attention import usable_kernels

    usable, skipped = usable_kernels(jax.devices()[0].platform)
    impls = [i for i in spec.impls if i == "auto" or i in usable]
    notes = [f"{run.config}: {run.note}" for run in spec.models if run.note]
    notes.append("Skipped kernels: " + ("; ".join(skipped) if skipped else "none") + ".")
    report = TrainReport(spec, os.path.join(out_dir, "train_step.md"), notes, toy)
    collect(spec, impls, on_record=report.add)
    return report.finish()


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m bench.train_step",
        description=__doc__.split("\n")[0],
        epilog="config fields: --config.<key>=<value>, as for train.py",
    )
    ap.add_argument("--seq", default="", help="comma-separated sequence lengths")
    ap.add_argument("--layouts", default="", help="comma-separated layouts (default: config's)")
    ap.add_argument("--impls", default="", help="comma-separated kernels (default: config's)")
    ap.add_argument(
        "--baseline",
        action="store_true",
        help="also the plain single-device step (bench.baseline) per length",
    )
    ap.add_argument("--steps", type=int, default=5, help="timed steps after the warm-up")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps after compiling")
    ap.add_argument("--isolate", action="store_true", help="one child process per row")
    ap.add_argument(
        "--record",
        action="store_true",
        help="print machine-readable records only (the child side of --isolate)",
    )
    ap.add_argument(
        "--out",
        default="",
        help="also write the table to this .md file (and a .png plot next to it)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="the quick size (TrainSpec.quick): 8K and 32K tokens, the kernel auto "
        "picks, --baseline --isolate, 3 steps after 1 warm-up, a 400 s budget",
    )

    from bench.isolate import launcher_process
    from lclm.cli import parse_cli, run_cli
    from lclm.config import mesh_device_count
    from lclm.parallel.devices import allow_gpu_host_memory, request_cpu_devices
    from lclm.writes import check_output

    def body():
        args, base = parse_cli(ap, argv, runs_stages=False)  # a schedule's stages do not run
        if args.out and not args.record:  # before the measuring, not at its first row
            check_output("--out", args.out, folder=False)
        request_cpu_devices(mesh_device_count(base) or 1)
        allow_gpu_host_memory()  # remat='offload' rows at long lengths need more than XLA's cap
        seqs = int_list(args.seq) or (base.data.seq_len,)
        layouts = tuple(args.layouts.split(",")) if args.layouts else (None,)
        impls = tuple(args.impls.split(",")) if args.impls else (None,)
        spec = TrainSpec(
            models=(ModelRun(os.path.abspath(args.config), seqs, tuple(args.overrides)),),
            steps=args.steps,
            warmup=args.warmup,
            isolate=args.isolate,
            baseline=args.baseline,
        )
        if args.quick and not args.record:
            spec, impls, layouts = spec.quick(), ("auto",), (None,)
        if spec.isolate and not args.record:
            launcher_process()  # children measure: this process must not reserve GPU memory
        if args.record:
            for seq in seqs:
                for layout in layouts:
                    for impl in impls:
                        for record in measure_rows(
                            args.config,
                            args.overrides,
                            seq,
                            layout,
                            impl,
                            steps=args.steps,
                            warmup=args.warmup,
                        ):
                            emit_record(dict(record, model=os.path.basename(args.config)))
            return 0
        report = TrainReport(spec, args.out)
        collect(spec, impls, layouts, on_record=report.add)
        report.finish()
        return 0

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())

"""`python -m bench --suite gpu-quick --compile-only [TARGET]`: every program a GPU suite's
parts would run, compiled for described GPUs (`lclm.plan.aot.target`, default `h100:1`) on this
machine, with no GPU attached.

The programs are the parts' own, built by their own functions at the suite's sizes:
`correctness` (each case's dense reference and each usable kernel's ring of blocks, positions
closed over as constants as the part does), `attention` (each method's forward and
forward+backward at each shape) and `train` (the baseline's three remat variants and lclm's
step per length, on abstract state and batch: nothing is allocated). Each is lowered with
`lclm.plan.aot.lowering_for` (the kernels see the described GPU, not this CPU) and compiled by
XLA:GPU (Triton and Mosaic GPU kernels to sm_90a through ptxas). A compile error found here
costs no GPU minutes. What cannot be checked without a GPU: timing, autotuning, cuDNN's
execution plans (built when a program first runs) and whether the memory fits at run time.

Each program is one row of `compile_only.md` (and stdout), written as it is compiled: seconds,
XLA's per-device GiB, fused-kernel calls, conditionals (host syncs on XLA:GPU), status. The
command exits 1 when any program failed to compile. Needs `pip install -e ".[gpu-aot]"`.
"""

from __future__ import annotations

import datetime
import itertools
import os
import time
from collections.abc import Callable, Iterator

from bench.report import Table, error_status, fmt

HEADER = ["part", "program", "compile s", "XLA GiB", "kernels", "conditionals", "status"]
PARTS = ("correctness", "attention", "train")  # the parts whose programs can be listed

# (part, program's name, () -> the compiled program)
Program = tuple[str, str, Callable]


def _abstract(shape, dtype, device):
    import jax

    return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.SingleDeviceSharding(device))


def _compile(fn, args, device):
    """`fn` (jitted) lowered for `device` with `args` (abstract), then compiled."""
    from lclm.plan import aot

    with aot.lowering_for(device):
        lowered = fn.lower(*args)
    return lowered.compile()


def correctness_programs(spec, device) -> Iterator[Program]:
    """The correctness part's programs: per head dim and case, the dense reference and every
    kernel it checks (the inputs are made here, at the part's small sizes, for their shapes
    and the positions the checks close over)."""
    from bench import correctness as part
    from lclm.ops.kernels import compiling_for, get_kernel

    with compiling_for(device):
        kernels, _ = part.checked_kernels("gpu", spec)
    for head_dim, case in itertools.product(spec.head_dims, part.CASES):
        q, k, v, do, *ids = part.case_inputs(case, spec.block, spec.heads, head_dim, spec.dtype)
        arrays = [_abstract(x.shape, x.dtype, device) for x in (q, k, v, do)]
        where = f"{case}, head dim {head_dim}"
        yield (
            "correctness",
            f"dense reference: {where}",
            lambda ids=ids, arrays=arrays: _compile(part.dense_reference(*ids), arrays, device),
        )
        for impl in kernels:
            ring = lambda impl=impl, ids=ids, case=case: part.ring_of_blocks(
                get_kernel(impl), len(part.CASES[case][3]), part.tiles(spec), *ids
            )
            yield (
                "correctness",
                f"{impl}: {where}",
                lambda ring=ring, arrays=arrays: _compile(ring(), arrays, device),
            )


def attention_programs(spec, device) -> Iterator[Program]:
    """The attention part's programs: every method's forward and forward+backward per shape."""
    from bench.attention import jitted_passes, methods
    from lclm.ops.kernels import compiling_for

    with compiling_for(device):
        found, _ = methods("gpu", spec)
    shapes = itertools.product(spec.masks, spec.head_dims, spec.heads, spec.blocks)
    for (mask, head_dim, heads, t), method in itertools.product(shapes, found):
        fwd, fwd_bwd = jitted_passes(method, mask == "causal")
        x = _abstract((1, t, heads, head_dim), spec.dtype, device)
        where = f"{mask}, {t:,} tokens, {heads} heads of {head_dim}"
        yield (
            "attention",
            f"{method.name} forward: {where}",
            lambda fwd=fwd, x=x: _compile(fwd, (x, x, x), device),
        )
        yield (
            "attention",
            f"{method.name} forward+backward: {where}",
            lambda fwd_bwd=fwd_bwd, x=x: _compile(fwd_bwd, (x, x, x, x), device),
        )


def train_programs(spec, devices) -> Iterator[Program]:
    """The train part's programs: per model and length the baseline's remat variants, then
    lclm's step with each kernel and remat policy of the spec."""
    from bench import repo_path
    from bench.baseline import REMATS
    from bench.train_step import compile_row, row_config

    for run, impl in itertools.product(spec.models, (None, *spec.impls)):
        if impl is None and not spec.baseline:
            continue
        for seq, variant in itertools.product(run.seqs, (None,) if impl is None else spec.remats):
            config = row_config(
                repo_path(run.config), run.with_remat(variant).overrides, seq, None, impl
            )
            name = f"{os.path.basename(run.config)}, {seq:,} tokens"
            for remat in REMATS if impl is None else (None,):
                label = (
                    f"baseline ({remat} remat)"
                    if impl is None
                    else f"lclm ({impl}{f', {variant} remat' if variant else ''})"
                )
                yield (
                    "train",
                    f"{label}: {name}",
                    lambda config=config, remat=remat: compile_row(
                        config, devices=devices, baseline=remat
                    )[1],
                )


def programs(suite, parts, devices) -> Iterator[Program]:
    for part in parts:
        spec = getattr(suite, part)
        if part == "correctness":
            yield from correctness_programs(spec, devices[0])
        elif part == "attention":
            yield from attention_programs(spec, devices[0])
        else:
            yield from train_programs(spec, devices)


def run(suite, parts, target_name: str, out_dir: str) -> int:
    """Compile every program of `parts`; write `compile_only.md` row by row. Returns the
    number of programs that failed."""
    import jax

    from lclm.plan import aot

    target = aot.target(target_name)
    devices = aot.target_devices(target)
    notes = [
        f"compiled on: this host's {jax.devices()[0].device_kind}; jax {jax.__version__}; "
        f"{datetime.date.today().isoformat()}",
        f"Compiled for {target_name} ({target.devices} x {devices[0].device_kind}, described: "
        "no GPU attached) by XLA:GPU on this machine: nothing here ran or was timed. XLA GiB: "
        "XLA's per-device arguments + outputs + temporaries less donated buffers; kernels: "
        "fused-kernel calls (Triton, Mosaic GPU, cuDNN attention); conditionals: host syncs "
        "on XLA:GPU.",
        f"Parts: {', '.join(parts)} at the suite's sizes.",
    ]
    table = Table(
        f"Compile-only: {', '.join(parts)} for {target_name}",
        notes,
        HEADER,
        os.path.join(out_dir, "compile_only.md"),
    )
    failed = 0
    for part, name, build in programs(suite, parts, devices):
        t0 = time.perf_counter()
        try:
            found = aot.analyse(build(), time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001  (the row says why; the others still compile)
            failed += 1
            table.add(
                (part, name, fmt(time.perf_counter() - t0, ".1f"), "-", "-", "-", error_status(e))
            )
            continue
        status = "ok" if not found.callbacks else f"{found.callbacks} host callbacks"
        table.add(
            (
                part,
                name,
                fmt(found.seconds, ".1f"),
                fmt(found.total / 2**30, ".2f"),
                found.kernels,
                found.conditionals,
                status,
            )
        )
    table.note(f"{len(table.rows)} programs, {failed} failed to compile.")
    return failed

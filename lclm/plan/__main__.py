"""Plan a run before spending a pod-day: per-device memory and the ring's overlap condition.

    python -m lclm.plan --config configs/llama7b_256k.py [--devices 32] [--device h100-nvlink]
        [--config.data.seq_len=524288 ...] [--measure]

Per device, before anything is compiled: parameter, gradient and optimizer-state bytes under
the mesh's sharding rules; activation bytes (per layer and in all) for the remat policy and
the blockwise chunks; the ring's working set (Ring Attention: about 6 x block x hidden); the total
against the device's memory; tokens per step; and the minimal per-device block for hiding
the ring's transfers on the chosen interconnect (Ring Attention, Table 2: c = FLOPS /
bandwidth).
`--measure` also compiles one real train step on the local devices and prints XLA's memory
analysis (and the measured peak after one step where the device reports it).

    python -m lclm.plan --config configs/llama7b_256k.py --compile v4-64

`--compile TARGET` compiles every stage's train step ahead of time, on this machine, for a TPU
slice (libtpu, no TPU) or for GPUs (`h100:4x8`: JAX's CUDA plugin, no GPU; lclm.plan.aot): compile
time, XLA's per-device memory against the chip's HBM (GPUs: against `aot.gpu_budget`, HBM
less what XLA does not count), the fused kernels in the program and the attention kernels
lowered into it (with the faster ones `attention.impl='auto'` passed over, and why), beside
the planner's estimate. Exit 0 when every stage compiles and fits, 3 when one does not (one
line per stage: what overflowed and what to change), 2 for a bad config or a missing
compiler.
"""

from __future__ import annotations

import argparse
import sys

from lclm import logs
from lclm.cli import parse_cli, run_cli
from lclm.config import MESH_AXES, mesh_device_count
from lclm.config.run_config import RunConfig, run_config
from lclm.config.stages import CHAINING, stage_changes, stage_configs
from lclm.data.balance import one_vs_many
from lclm.errors import ConfigError, StartupError
from lclm.extend.heldout import is_extension
from lclm.extend.plan import eval_programs, extension_lengths, parts, stage_runs, starting_length
from lclm.ops.context_parallel import STRATEGIES, layout_shards
from lclm.parallel.mesh import make_mesh
from lclm.plan import aot, strategies
from lclm.plan.memory import DEVICES, Plan, estimate, gib, report
from lclm.train.remat_choice import overflow


def _plans(config, args) -> tuple[list, list[Plan]]:
    """(the configs of the run, one per stage, and their plans); bad input is a StartupError."""
    count = args.devices or mesh_device_count(config)
    if count is None:
        raise ConfigError("the mesh has a -1 axis; pass --devices N (the devices of the run)")
    # a staged recipe is planned stage by stage; the longest stage decides the fit
    runs = stage_configs(config) or [config]
    return runs, [estimate(c, count, args.device) for c in runs]


_FIXES = {
    "HBM": "shard more (mesh.fsdp/sp), lower data.batch_size, or model.remat='offload'",
    "VMEM": "attention.impl='blockwise' (no Mosaic kernel), and report the TPU: "
    "pallas_tpu sizes its tiles per generation (TPU_TILES)",
}


def _compile_stages(config, args) -> int:
    """`--compile TARGET`: every stage compiled for a TPU slice or GPUs; exit 0 if all fit,
    else 3."""
    target = aot.target(args.compile)
    devices = aot.target_devices(target)
    device = target.planner_device if target.planner_device in DEVICES else None
    gpu = target.platform == "gpu"
    budget, how = aot.gpu_budget(target) if gpu else (target.hbm_bytes, "")

    runs = stage_configs(config) or [config]
    if gpu:
        print(
            f"{target.name}: {target.devices} x {devices[0].device_kind} ({target.nodes} "
            f"node(s) of {target.devices // target.nodes}), "
            f"{gib(target.hbm_bytes)} GiB HBM each; budget {how}"
        )
    else:
        print(
            f"{target.name}: {target.devices} devices ({target.topology}"
            f"{', ' + target.chip_config if target.chip_config else ''}), "
            f"{gib(target.hbm_bytes)} GiB HBM each"
        )
    kernels = "kernels" if gpu else "Mosaic kernels"
    of = "budget" if gpu else "HBM"
    print(
        f"| stage | seq_len | compile s | arguments GiB | temporaries GiB | outputs GiB | "
        f"total GiB | {of} used | {kernels} | planner GiB | host GiB (planner) | "
        "attention kernel |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    failed: list[str] = []
    passed_over: dict[str, list[int]] = {}  # what auto passed over, and why -> those stages
    chosen: list[str] = []  # model.remat='auto': each stage's choice, one line
    for i, c in enumerate(runs):
        try:
            r = aot.compile_step(c, devices, budget)
        except StartupError:
            raise
        except Exception as e:  # noqa: BLE001  (XLA reports overflows as compile errors)
            kind = overflow(e)
            if kind is None:
                raise
            failed.append(
                f"stage {i} (seq_len {c.data.seq_len:,}): {kind} overflow on "
                f"{target.name}; {_FIXES[kind]}"
            )
            print(
                f"| {i} | {c.data.seq_len:,} | - | - | - | - | {kind} overflow | - | - | "
                f"{gib(_planned(c, target, devices, device).total)} | - | - |",
                flush=True,
            )
            continue
        if r.remat_choice:
            chosen.append(f"stage {i}: {r.remat_choice}")
            c = c.copy_and_resolve_references()
            c.model.remat = r.remat  # the planner beside the policy compiled
        plan = _planned(c, target, devices, device)
        planned, host = plan.total, plan.host_activations
        used = r.total / budget
        if used > 1:
            failed.append(
                f"stage {i} (seq_len {c.data.seq_len:,}): {gib(r.total)} GiB of "
                f"{gib(budget)} GiB {'budget' if gpu else 'HBM'} on {target.name}; "
                f"{_FIXES['HBM']}"
            )
        host_cell = f"{gib(r.host)} ({gib(host)})" if r.host else f"- ({gib(host)})"
        print(
            f"| {i} | {c.data.seq_len:,} | {r.seconds:,.0f} | {gib(r.arguments)} | "
            f"{gib(r.temporaries)} | {gib(r.outputs)} | {gib(r.total)} | {100 * used:.0f}% | "
            f"{r.kernels} | {gib(planned)} | {host_cell} | "
            f"{', '.join(r.attention.kernels) or '-'} |",
            flush=True,
        )
        if r.attention.passed_over:
            passed_over.setdefault(_passed_over(r.attention.passed_over), []).append(i)
    for why, stages in passed_over.items():
        which = f"stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))}"
        print(f"{which}: attention.impl='auto' passed over {why}")
    for line in chosen:
        print(line)
    if is_extension(config):
        failed += _compile_evaluations(config, devices, budget, target.name, gpu)
    for line in failed:
        print(f"error: {line}", file=sys.stderr)
    return 3 if failed else 0


def _compile_evaluations(config, devices, budget: int, target: str, gpu: bool) -> list[str]:
    """The programs `python -m lclm.extend` evaluates with (lclm.extend.plan.eval_programs),
    compiled for the target and measured against the same budget; the lines that do not fit."""
    stages = stage_runs(config)
    first, last = stages[0], stages[-1]
    lengths = extension_lengths(first, stages, starting_length(first))
    programs = eval_programs(stages, lengths, parts(first, stages, lengths))
    mesh = make_mesh(
        **{a: getattr(last.mesh, a) for a in MESH_AXES},
        devices=devices[: mesh_device_count(config) or len(devices)],
    )
    of = "budget" if gpu else "HBM"
    print(f"\nthe evaluation programs of python -m lclm.extend ({len(programs)}):")
    print(
        f"| program | kind | rows x tokens | compile s | total GiB | {of} used | attention kernel |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    failed = []
    for p in programs:
        r = aot.compile_eval(p.kind, p.model, p.attention, mesh, p.rows, p.row, p.max_new)
        used = r.total / budget
        if used > 1:
            failed.append(
                f"{p.what} ({p.kind}, {p.rows} x {p.row:,} tokens): {gib(r.total)} "
                f"GiB of {gib(budget)} GiB {of} on {target}; lower "
                "extension.documents' rows or shard more (mesh.sp)"
            )
        kind = p.kind + (f", {p.max_new} new" if p.max_new else "")
        print(
            f"| {p.what} | {kind} | {p.rows} x {p.row:,} | {r.seconds:,.0f} | "
            f"{gib(r.total)} | {100 * used:.0f}% | "
            f"{', '.join(r.attention.kernels) or '-'} |",
            flush=True,
        )
    return failed


def _planned(config, target, devices, device: str | None) -> Plan:
    """The planner's estimate of one stage on `target` (its kernel the one the compile picks:
    both for the target's device)."""
    with aot.compiling_for(devices[0]):
        return estimate(config, target.devices, device)


def _passed_over(why: dict[str, str]) -> str:
    """'cudnn_gpu, tokamax_gpu (tokamax is not installed: ...)': kernels with the same reason
    together, in the order `auto` tried them."""
    names: dict[str, list[str]] = {}
    for name, reason in why.items():
        names.setdefault(reason, []).append(name)
    return "; ".join(f"{', '.join(n)} ({reason})" for reason, n in names.items())


def _links(device: str, per_node: int) -> tuple[float, float, float, int, str]:
    """(peak FLOP/s, GB/s in a node, GB/s between nodes, devices per node, description)."""
    flops, fast, _ = DEVICES[device]
    family = device.split("-")[0]
    if family == "tpu":  # one interconnect (ICI) for the whole slice: one "node"
        return flops, fast, fast, 1 << 30, f"{device}, one interconnect (ICI) {fast:g} GB/s"
    slow = DEVICES.get(f"{family}-ib", DEVICES[device])[1]
    return (
        flops,
        fast,
        slow,
        per_node,
        f"{device}, {per_node} per node: {fast:g} GB/s inside, {slow:g} GB/s between nodes",
    )


def _strategies(runs, plans, args) -> int:
    """`--strategies`: every stage's strategies, least exposed transfer time first."""
    if args.device is None:
        raise ConfigError("--strategies compares links: pass --device (e.g. h100-nvlink)")
    flops, fast, slow, per_node, links = _links(args.device, args.devices_per_node)
    for i, (c, plan) in enumerate(zip(runs, plans)):
        print(f"\n== stage {i}: seq_len {c.data.seq_len:,}, mesh {plan.mesh}; {links}")
        print(
            "| strategy | split | GB sent in a node | GB sent between nodes | exposed s | "
            "GiB per device | note |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- |")
        costs = strategies.compare(run_config(c), plan.mesh, flops, fast, slow, per_node)
        for cost in sorted(
            costs,
            key=lambda x: (
                bool(x.note.endswith("cannot run")),
                x.exposed_s,
                x.sent.get("between nodes", 0.0),
            ),
        ):
            inside, between = (cost.sent.get(k, 0.0) / 1e9 for k in ("in a node", "between nodes"))
            exposed = "hidden" if cost.exposed_s == 0 else f"{cost.exposed_s:.3f}"
            memory = (plan.total - plan.ring + cost.memory) / 2**30
            print(
                f"| {cost.strategy} | {cost.split} | {inside:,.1f} | {between:,.1f} | "
                f"{exposed} | {memory:,.2f} | {cost.note} |"
            )
    print(
        "\nper device and training step; exposed: seconds the attention waits for its "
        "transfers at peak FLOP/s (see lclm/plan/strategies.py)"
    )
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m lclm.plan",
        description=__doc__.split("\n")[0],
        epilog="config fields: --config.<key>=<value>, as for train.py",
    )
    ap.add_argument(
        "--devices",
        type=int,
        default=0,
        help="device count (default: the mesh's product, or the local devices)",
    )
    ap.add_argument("--device", choices=sorted(DEVICES), default=None)
    ap.add_argument(
        "--strategies",
        action="store_true",
        help=f"rank the context-parallel strategies ({', '.join(STRATEGIES)}) "
        "by the time their transfers leave exposed, with bytes sent per link "
        "and memory per device (needs --device)",
    )
    ap.add_argument(
        "--devices-per-node",
        type=int,
        default=8,
        help="GPUs per node for --strategies: inside a node --device's link, "
        "between nodes its -ib link (default 8; TPU slices: one ICI)",
    )
    ap.add_argument(
        "--measure",
        action="store_true",
        help="also compile (and run) one step on the local devices",
    )
    ap.add_argument(
        "--compile",
        metavar="TARGET",
        default="",
        help="compile every stage ahead of time for a TPU slice (needs libtpu, no "
        "TPU: v4-N and v5p-N count TensorCores, 2 per chip, one megacore "
        "device: v4-64 = 32 chips, topology v4:2x4x4; v5e-N and v6e-N count "
        "chips) or GPUs (needs lclm[gpu-aot], no GPU: h100:N, N GPUs on one "
        "node; h100:MxN, M nodes of N; h200:..., a100:...)",
    )
    logs.configure()
    return run_cli(lambda: _run(ap, argv))


def _balance_line(sections: RunConfig) -> str:
    """How unequal rows of this stage's length can be in attention work (lclm.data.balance)."""
    seq, a = sections.data.seq_len, sections.attention
    if not sections.data.document_mask:
        return "attention work: no document masks, every row the same"
    shards = layout_shards(a, sections.mesh.sp)
    rows, within = one_vs_many(seq, a.layout, shards)
    return (
        f"attention work: a row of one {seq:,}-token document costs {rows:.1f}x a row of "
        f"1,024-token documents on its busiest of {shards} sp device(s) ({a.layout}; "
        f"{within:.2f}x the mean device, which no row order changes); data.balance="
        f"{sections.data.balance} {'evens' if sections.data.balance else 'leaves'} rows "
        "over devices and micro-batches"
    )


def _run(ap: argparse.ArgumentParser, argv) -> int:
    args, config = parse_cli(ap, argv)
    if args.compile:
        return _compile_stages(config, args)
    runs, plans = _plans(config, args)
    if args.strategies:
        return _strategies(runs, plans, args)
    for i, (c, plan) in enumerate(zip(runs, plans)):
        if len(runs) > 1:
            print(
                f"\n== stage {i}: seq_len {c.data.seq_len:,}, rope_theta {c.model.rope_theta:g}, "
                f"{c.train.steps} steps of {c.data.batch_size} sequences"
            )
        print(report(plan, args.device))
        print(_balance_line(run_config(c)))
        if plan.device_memory and plan.total > plan.device_memory and plan.remat != "offload":
            offload = c.copy_and_resolve_references()
            offload.model.remat = "offload"
            count = args.devices or mesh_device_count(offload)
            # not None: _plans required --devices for a mesh with a -1 axis; stages set sp >= 1
            assert count is not None
            alt = estimate(offload, count, args.device)
            assert alt.device_memory is not None  # the same device as `plan`'s
            print(
                f"does not fit; with model.remat='offload': {alt.total / 2**30:,.2f} GiB on "
                f"the device ({100 * alt.total / alt.device_memory:.0f}%), "
                f"{alt.host_activations / 2**30:,.2f} GiB in host memory"
            )
    if args.measure:  # the same step the benchmark times, at the last (longest) stage
        import runpy

        # the benchmark measures the fields it is given, not the stages: the last stage's
        # fields that shape its step
        last = stage_changes(config)[-1] if len(runs) > 1 else {}
        stage = [f"--config.{key}={value}" for key, value in last.items() if key not in CHAINING]
        sys.argv = [
            "bench.train_step",
            "--config",
            args.config,
            "--steps",
            "1",
            *args.overrides,
            *stage,
        ]
        runpy.run_module("bench.train_step", run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Striped vs zigzag vs contiguous ring attention, simulated on one device with the real kernel.

    python -m bench.striped_sim [--ns 2,4,8,16] [--blocks 4096,8192,16384,32768] [--quick] \
        [--out DIR]

N devices, per-device block c: in round r device j keeps its queries and holds the K/V block
that started on device (j - r) % N. For each layout, round and device the kernel
(`get_kernel(impl).forward` then `.backward`, as the ring calls them) runs on that block pair
with the original positions of `lclm.ops.layout.original_positions`, i.e. the real masks and
the kernel's own tile skipping. A ring round lasts as long as its slowest device, so the
simulated ring time is the sum over rounds of the per-round maximum over devices.
Communication is not modelled (assumed hidden behind compute, which holds for blocks above
the overlap threshold c of docs/scaling.md).

Identical block pairs share one timing: a pair's work follows from its mask, and the mask
depends only on the pair's class (`mask_class`): striped 'causal' (source k <= j: x >= y) or
'strict' (k > j: x > y); contiguous 'full' (k < j), 'causal' (k == j) or 'hidden' (k > j);
zigzag 'causal' (k == j), 'key half' (k < j: every query sees the first half of the keys) or
'query half' (k > j: the second half of the queries sees every key).
A class is the same mask in every layout and for every N (tested), so one timing per (class,
tile size, block) serves all of them (zigzag's ring keeps tiles inside half a block, so its
pairs are timed with those tiles), and the bound below uses the very 'causal' time the
striped and contiguous rings use.

Next to the simulated speedup contiguous/striped: the bound (C + (N-1) F) / (N C) from the
same kernel's causal (C) and full (F) block times, the same bound from cuDNN's times (GPU),
the ratio of busiest-device tile counts (`lclm.ops.context_parallel.ring.tile_schedule`), and the
Striped Attention paper's published figures for the 1B model on a 1 x N mesh.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys

from bench import int_list
from bench.report import Table, default_out_dir, fmt, stamp, try_plot
from lclm.cli import run_cli
from lclm.writes import check_output

LAYOUTS = ("contiguous", "striped", "zigzag")

# Brandon et al. 2023, "Striped Attention", Table 5 and Appendix A.1: 1B model,
# mesh 1 x N (no model parallelism), 8 x A100 80GB, per-device block size ->
# (theoretical maximum speedup, measured end-to-end training speedup over ring attention).
# Published figures, end-to-end (not attention alone), tiles of 2048 x 4096.
PAPER_1B = {
    (2, 4096): (1.22, 0.94),
    (2, 8192): (1.31, 1.02),
    (2, 16384): (1.38, 1.10),
    (2, 24576): (1.41, 1.14),
    (2, 32768): (1.43, 1.19),
    (2, 49152): (1.45, 1.22),
    (2, 65536): (1.46, 1.25),
    (4, 4096): (1.46, 0.92),
    (4, 8192): (1.57, 1.07),
    (4, 16384): (1.65, 1.23),
    (4, 24576): (1.68, 1.31),
    (4, 32768): (1.70, 1.35),
    (4, 49152): (1.71, 1.39),
    (8, 4096): (1.67, 0.93),
    (8, 8192): (1.76, 1.11),
    (8, 16384): (1.81, 1.29),
    (8, 24576): (1.83, 1.37),
}
PAPER_CITATION = (
    "Paper: Striped Attention (Brandon et al. 2023), Table 5 / "
    "Appendix A.1, published figures: 1B model, mesh 1 x N, 8 x A100 80GB, "
    "end-to-end training speedup (TMS = their theoretical maximum, counting "
    "non-attention FLOPs), tiles 2048 x 4096."
)


@dataclasses.dataclass(frozen=True)
class StripedSpec:
    """Sizes of one simulation run."""

    ns: tuple[int, ...] = (2, 4, 8, 16)
    blocks: tuple[int, ...] = (4096, 8192, 16384, 32768)
    heads: int = 16
    head_dim: int = 128
    dtype: str = "bfloat16"
    q_chunk: int = 1024
    kv_chunk: int = 1024
    warmup: int = 1
    iters: int = 3
    # tile_schedule evaluates the skip predicate tile by tile in Python: above this many
    # (device, round, tile) evaluations the tile ratio is left out rather than waited for
    tile_limit: int = 2**14
    budget_s: float | None = None  # stop starting blocks after this many seconds

    def smallest(self) -> StripedSpec:
        return dataclasses.replace(self, ns=self.ns[:1], blocks=self.blocks[:1], warmup=0, iters=1)

    def quick(self) -> StripedSpec:
        """N = 2, 4, 8 at 8K-token blocks: per kernel one compile (zigzag's 4K half blocks
        keep the 1K tiles) and 8 timed block-pair classes; cuDNN's two block times once;
        within a 400 s budget."""
        return dataclasses.replace(self, ns=(2, 4, 8), blocks=(8192,), budget_s=400.0)


def mask_class(layout: str, n: int, device: int, source: int) -> str:
    """The mask of device `device`'s queries against the K/V block of device `source`."""
    if layout == "striped":
        return "causal" if source <= device else "strict"
    if layout == "contiguous":
        return "full" if source < device else "causal" if source == device else "hidden"
    if layout == "zigzag":
        return "key half" if source < device else "causal" if source == device else "query half"
    raise ValueError(f"unknown layout {layout!r}")


def pair_pass(impl: str, q_chunk: int, kv_chunk: int):
    """Jitted forward + backward of one block pair, as one ring round runs them.

    Positions are arguments (not constants), so one compilation serves every mask.
    """
    import jax

    from lclm.ops.kernels import get_kernel

    kernel = get_kernel(impl)
    tiles = dict(causal=True, q_chunk=q_chunk, kv_chunk=kv_chunk)

    def step(q, k, v, do, q_pos, k_pos):
        o, lse = kernel.forward(q, k, v, q_pos, k_pos, None, None, **tiles)
        return kernel.backward(
            q, k, v, o.astype(q.dtype), lse, do, q_pos, k_pos, None, None, **tiles
        )

    return jax.jit(step)


def class_times(impl: str, block: int, spec: StripedSpec) -> dict[tuple, float]:
    """Mask class -> seconds of forward+backward, timed on the first pair of each class."""
    import jax.numpy as jnp

    from bench.attention import qkv
    from bench.timing import median_seconds
    from lclm.ops.layout import original_positions

    q, k, v, do = qkv(1, block, spec.heads, spec.head_dim, spec.dtype)
    times: dict[tuple, float] = {}
    passes: dict[tuple, int] = {}
    for layout in LAYOUTS:
        for n in spec.ns:
            tiles = layout_tiles(layout, n, block, spec)
            fn = passes.setdefault(tiles, pair_pass(impl, *tiles))
            for _, device, source in block_pairs(n):
                key = time_key(layout, n, device, source, block, spec)
                if key not in times:
                    q_pos = jnp.asarray(original_positions(layout, n, device, block))
                    k_pos = jnp.asarray(original_positions(layout, n, source, block))
                    times[key], _ = median_seconds(
                        fn, q, k, v, do, q_pos, k_pos, warmup=spec.warmup, iters=spec.iters
                    )
    return times


def layout_tiles(layout: str, n: int, block: int, spec: StripedSpec) -> tuple[int, int]:
    """The (q, kv) tiles a ring of this layout runs at this block (`tile_run`)."""
    from lclm.ops.context_parallel.rounds import tile_run

    run = tile_run(layout, n, n * block)
    return min(spec.q_chunk, run), min(spec.kv_chunk, run)


def time_key(layout: str, n: int, device: int, source: int, block: int, spec: StripedSpec):
    """Which timing a block pair uses: its mask class at its layout's tiles."""
    return (mask_class(layout, n, device, source), *layout_tiles(layout, n, block, spec))


def block_pairs(n: int) -> list[tuple[int, int, int]]:
    """(round, device, source) of every block pair a ring of n devices computes: in round r
    device j holds the K/V block that started on device (j - r) % n."""
    return [(r, j, (j - r) % n) for r in range(n) for j in range(n)]


def round_times(layout: str, n: int, times: dict, key=None) -> list[float]:
    """Per-round time of the ring: the slowest device of each round. `times` is keyed by
    `key(device, source)` (default: the pair's mask class)."""
    key = key or (lambda device, source: mask_class(layout, n, device, source))
    per_round = [0.0] * n
    for r, device, source in block_pairs(n):
        per_round[r] = max(per_round[r], times[key(device, source)])
    return per_round


def ring_bound(causal_s: float, full_s: float, n: int) -> float:
    """Contiguous/striped speedup if striped rounds cost one causal block each and a
    contiguous ring costs a causal round then N-1 full rounds (its busiest device)."""
    return (causal_s + (n - 1) * full_s) / (n * causal_s)


@functools.cache  # the same for every kernel
def tile_ratio(n: int, block: int, spec: StripedSpec) -> float | None:
    """Busiest-device tile count summed over rounds, contiguous / striped (None: too costly)."""
    import jax

    from lclm.ops.context_parallel.ring import tile_schedule

    tiles = (block // spec.q_chunk) * (block // spec.kv_chunk)
    if n * n * tiles > spec.tile_limit:
        return None
    busiest = {}
    with jax.default_device(_host_device()):  # tiny scalar predicates: no accelerator launches
        for layout in LAYOUTS:
            counts = tile_schedule(layout, n, n * block, spec.q_chunk, spec.kv_chunk)
            busiest[layout] = counts.max(axis=1).sum()
    return float(busiest["contiguous"] / busiest["striped"])


def _host_device():
    """The host CPU device, or the default device where JAX_PLATFORMS left the CPU out."""
    import jax

    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        return jax.devices()[0]


@functools.cache  # the same for every kernel
def cudnn_times(block: int, spec: StripedSpec) -> tuple[float, float] | None:
    """cuDNN's forward+backward seconds at one block, (causal, full); None off GPU."""
    import jax

    from bench.attention import AttentionSpec, cudnn_method, measure

    if jax.devices()[0].platform != "gpu":
        return None
    aspec = AttentionSpec(
        head_dims=(spec.head_dim,), dtype=spec.dtype, warmup=spec.warmup, iters=spec.iters
    )
    try:
        return tuple(
            measure(cudnn_method(), block, spec.heads, causal, aspec)["fwd_bwd_s"]
            for causal in (True, False)
        )
    except Exception:  # noqa: BLE001  (no cuDNN attention for this shape: the column is '-')
        return None


def simulate_block(impl: str, block: int, spec: StripedSpec) -> list[dict]:
    """One result per N at one block: simulated ring times, speedup and its bounds."""
    results = []
    times = class_times(impl, block, spec)
    cudnn = cudnn_times(block, spec)
    for n in spec.ns:
        rounds = {
            layout: round_times(
                layout, n, times, lambda d, s, lay=layout, n=n: time_key(lay, n, d, s, block, spec)
            )
            for layout in LAYOUTS
        }
        tiles = layout_tiles("striped", n, block, spec)
        contiguous, striped = sum(rounds["contiguous"]), sum(rounds["striped"])
        zigzag = sum(rounds["zigzag"])
        paper = PAPER_1B.get((n, block), (None, None))
        results.append(
            dict(
                impl=impl,
                n=n,
                block=block,
                rounds=rounds,
                contiguous_s=contiguous,
                striped_s=striped,
                zigzag_s=zigzag,
                speedup=contiguous / striped,
                zigzag_speedup=contiguous / zigzag,
                kernel_bound=ring_bound(times[("causal", *tiles)], times[("full", *tiles)], n),
                cudnn_bound=None if cudnn is None else ring_bound(*cudnn, n),
                tile_ratio=tile_ratio(n, block, spec),
                paper_tms=paper[0],
                paper_speedup=paper[1],
                status="ok",
            )
        )
    return results


def simulate(impl: str, spec: StripedSpec) -> list[dict]:
    """One result per (N, block): simulated ring times, speedup and its bounds."""
    return [r for block in spec.blocks for r in simulate_block(impl, block, spec)]


def _plot(results: list[dict], out_dir: str, toy: bool) -> str:
    from bench.plots import Panel, save_lines

    results = [r for r in results if r["status"] == "ok"]
    if not results:
        raise ValueError("no simulated ring to plot")
    speed = Panel("contiguous / striped (zigzag) time", "simulated devices N", "speedup")
    blocks = sorted({r["block"] for r in results})
    for r in results:
        color = f"C{blocks.index(r['block'])}"
        c = f"c={r['block']:,}"
        speed.add(f"{r['impl']} simulated, {c}", r["n"], r["speedup"], f"o-{color}")
        speed.add(f"{r['impl']} zigzag simulated, {c}", r["n"], r["zigzag_speedup"], f"s-.{color}")
        speed.add(f"{r['impl']} kernel bound, {c}", r["n"], r["kernel_bound"], f"--{color}")
        speed.add(f"cuDNN bound, {c}", r["n"], r["cudnn_bound"], f":{color}")
        speed.add(f"paper measured (1B, A100), {c}", r["n"], r["paper_speedup"], f"x{color}")
    last = max(results, key=lambda r: (r["n"], r["block"]))
    rounds = Panel(
        f"busiest device per round, {last['impl']}, N={last['n']}, c={last['block']:,}",
        "round",
        "ms",
        logx=False,
    )
    for layout, times in last["rounds"].items():
        for i, t in enumerate(times):
            rounds.add(layout, i, t * 1e3, "o-")
    return save_lines(
        os.path.join(out_dir, "striped_sim.png"),
        "Striped and zigzag vs contiguous ring, simulated on one device",
        stamp(toy),
        [speed, rounds],
    )


HEADER = [
    "kernel",
    "N",
    "block c",
    "tile ratio",
    "contiguous ms",
    "striped ms",
    "zigzag ms",
    "speedup striped",
    "speedup zigzag",
    "kernel bound",
    "striped / bound",
    "cuDNN bound",
    "paper TMS",
    "paper measured",
    "status",
]


def row(r: dict) -> tuple:
    ms = lambda key: fmt(r.get(key), ",.2f", 1e3)
    bound = r.get("kernel_bound")
    return (
        r["impl"],
        r["n"],
        f"{r['block']:,}",
        fmt(r.get("tile_ratio"), ".2f"),
        ms("contiguous_s"),
        ms("striped_s"),
        ms("zigzag_s"),
        fmt(r.get("speedup"), ".2f"),
        fmt(r.get("zigzag_speedup"), ".2f"),
        fmt(bound, ".2f"),
        fmt(None if bound is None else r["speedup"] / bound, ".2f"),
        fmt(r.get("cudnn_bound"), ".2f"),
        fmt(r.get("paper_tms"), ".2f"),
        fmt(r.get("paper_speedup"), ".2f"),
        r["status"],
    )


def run(spec: StripedSpec, out_dir: str, toy: bool = False) -> str:
    """Simulate every usable kernel; write `striped_sim.md` (the rows of each block as soon as
    they are simulated) and its plot. Returns the md path."""
    import jax

    from bench.attention import usable_kernels
    from bench.report import error_status
    from bench.timing import Budget

    kernels, skipped = usable_kernels(jax.devices()[0].platform)
    notes = stamp(toy) + [
        f"Per device: batch 1, {spec.heads} heads, head dim {spec.head_dim}, {spec.dtype}, "
        f"tiles {spec.q_chunk} x {spec.kv_chunk}; each block pair's kernel forward+backward is "
        f"the median of {spec.iters} runs; ring time = sum over rounds of the slowest device "
        "(communication assumed hidden). Speedups are contiguous time / layout time.",
        "Bounds: (C + (N-1) F) / (N C) with C, F the causal and full block times of the same "
        "kernel, or of cuDNN (GPU only). Tile ratio: busiest-device tiles summed over rounds, "
        "contiguous / striped (tile_schedule; '-' where too costly to enumerate).",
        PAPER_CITATION,
        "Skipped kernels: " + ("; ".join(skipped) if skipped else "none") + ".",
    ]
    if spec.budget_s is not None:
        notes.append(
            f"Blocks start only within a {spec.budget_s:g} s budget (rows past it say so)."
        )
    path = os.path.join(out_dir, "striped_sim.md")
    table = Table(
        "Striped, zigzag and contiguous ring attention (one-device simulation)", notes, HEADER, path
    )
    budget = Budget(spec.budget_s)
    results = []
    for impl in kernels:
        for block in spec.blocks:
            if budget.spent():
                done = [dict(impl=impl, n=n, block=block, status=budget.skipped()) for n in spec.ns]
            else:
                try:
                    done = simulate_block(impl, block, spec)
                except Exception as e:  # noqa: BLE001  (OOM, a kernel that cannot run here)
                    done = [
                        dict(impl=impl, n=n, block=block, status=error_status(e)) for n in spec.ns
                    ]
            for r in done:
                table.add(row(r))
            results += done
    table.image(try_plot(_plot, results, out_dir, toy))
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default = StripedSpec()
    ap.add_argument("--ns", default=",".join(map(str, default.ns)))
    ap.add_argument("--blocks", default=",".join(map(str, default.blocks)))
    ap.add_argument("--heads", type=int, default=default.heads)
    ap.add_argument("--chunk", type=int, default=default.q_chunk, help="q and kv tile size")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="the quick size (StripedSpec.quick; the size options are ignored)",
    )
    ap.add_argument("--out", default=default_out_dir("striped_sim"))
    args = ap.parse_args(argv)
    spec = dataclasses.replace(
        default,
        ns=int_list(args.ns),
        blocks=int_list(args.blocks),
        heads=args.heads,
        q_chunk=args.chunk,
        kv_chunk=args.chunk,
    )

    def body():
        check_output("--out", args.out)  # before the measuring, not at its first row
        run(default.quick() if args.quick else spec, args.out)

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())

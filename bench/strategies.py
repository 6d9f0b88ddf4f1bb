"""Context-parallel strategies on simulated CPU devices: exactness and what each one sends.

    python -m bench.strategies [--out DIR] [--quick]

The committed table, bench/results/strategies_cpu.md, is the `strategies.md` of a full run
(447 s wall, 685 CPU-seconds on 2 cores).

For every strategy (ring, all_gather, ulysses, usp) x layout x packed documents on/off x
GQA (2 query heads per K/V head) / MQA (one K/V head, which Ulysses replicates) x mesh
(sp 2, 4, 8; tp and fsdp beside sp; usp with Ulysses groups of 2 and 4): the largest relative
error max |strategy - reference| / max |reference| of o, dq, dk and dv against dense float32
attention (lclm.ops.kernels.reference) on the same float32 inputs, through the blockwise
kernel. Then, per strategy at sp=4 (usp: 2 x ring 2), the collectives XLA keeps in the
compiled gradient program of bfloat16 attention and the bytes of their results on each
device (as the compiled program states its shapes), and each strategy's compute balance
(`balance`). Simulated devices run on the host: exactness and program structure, not
speed.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from bench.report import Table, default_out_dir, stamp
from lclm.cli import run_cli
from lclm.ops.context_parallel import STRATEGIES
from lclm.writes import check_output

LAYOUTS = ("striped", "zigzag", "contiguous")  # lclm.config.schema.LAYOUTS in the columns' order
# (label, mesh sizes, usp's Ulysses degree)
MESHES = (
    ("sp=2", dict(sp=2), 2),
    ("sp=4", dict(sp=4), 2),
    ("sp=8", dict(sp=8), 4),
    ("tp=2 x sp=4", dict(tp=2, sp=4), 2),
    ("fsdp=2 x sp=4", dict(fsdp=2, sp=4), 4),
)
QUICK_MESHES = MESHES[1:2]
HEADS = (("GQA 8/4", 8, 4), ("MQA 8/1", 8, 1))


def _errors(strategy, layout, mesh_kw, ulysses, heads, kv_heads, segments, seed):
    """max relative error of (o, dq, dk, dv) of one case."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from lclm.config import AttentionConfig
    from lclm.ops.context_parallel import context_parallel_attention, strategy_of
    from lclm.ops.kernels.reference import dense_attention
    from lclm.ops.layout import from_layout, to_layout
    from lclm.parallel import make_mesh

    rng = np.random.default_rng(seed)
    b, t, d = 2, 64, 16
    q, do = (rng.standard_normal((b, t, heads, d), np.float32) for _ in range(2))
    k, v = (rng.standard_normal((b, t, kv_heads, d), np.float32) for _ in range(2))
    seg = np.cumsum(rng.random((b, t)) < 0.08, axis=1).astype(np.int32) if segments else None
    want_o, vjp = jax.vjp(lambda q, k, v: dense_attention(q, k, v, segment_ids=seg), q, k, v)
    want = (want_o, *vjp(jnp.asarray(do)))

    mesh = make_mesh(**mesh_kw)
    chosen = strategy_of(AttentionConfig(strategy=strategy, ulysses=ulysses))
    n = chosen.layout_shards(mesh.shape["sp"])
    lay = lambda x: None if x is None else to_layout(jnp.asarray(x), layout, n)
    attend = jax.jit(
        lambda q, k, v: context_parallel_attention(
            q,
            k,
            v,
            mesh=mesh,
            strategy=chosen,
            layout=layout,
            segment_ids=lay(seg),
            q_chunk=8,
            kv_chunk=8,
            impl="blockwise",
        )
    )
    got_o, vjp = jax.vjp(attend, lay(q), lay(k), lay(v))
    got = (got_o, *vjp(lay(do)))
    return [
        float(jnp.max(jnp.abs(from_layout(g, layout, n) - w)) / jnp.max(jnp.abs(w)))
        for g, w in zip(got, want)
    ]


COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "reduce-scatter")


def gradient_program(strategy: str, ulysses: int = 1):
    """The lowered (`jax.stages.Lowered`) gradient program of one bfloat16 attention call at
    sp=4, blockwise kernel: q [2, 64, 4, 16], k/v [2, 64, 2, 16], segment ids."""
    import jax
    import jax.numpy as jnp

    from lclm.config import AttentionConfig
    from lclm.ops.context_parallel import context_parallel_attention, strategy_of
    from lclm.parallel import make_mesh

    mesh = make_mesh(sp=4)
    chosen = strategy_of(AttentionConfig(strategy=strategy, ulysses=ulysses))
    q, k = jnp.ones((2, 64, 4, 16), jnp.bfloat16), jnp.ones((2, 64, 2, 16), jnp.bfloat16)
    seg = jnp.ones((2, 64), jnp.int32)

    def loss(q, k, v, seg):
        o = context_parallel_attention(
            q,
            k,
            v,
            mesh=mesh,
            strategy=chosen,
            segment_ids=seg,
            q_chunk=8,
            kv_chunk=8,
            impl="blockwise",
        )
        return o.astype(jnp.float32).sum()

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, k, seg)


def collectives(hlo: str) -> tuple[dict[str, int], dict[str, int]]:
    """({collective: count}, {collective: bytes of its results per device}) of compiled HLO
    text, for each of `COLLECTIVES` (0 where absent); an async pair counts once."""
    sizes = {"bf16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1}
    counts = dict.fromkeys(COLLECTIVES, 0)
    sent = dict.fromkeys(COLLECTIVES, 0)
    # one instruction per line: `%name = type[dims]{layout} op(...)`; tuples list each part
    for line in hlo.splitlines():
        m = re.search(rf"=\s*(.*?)\s({'|'.join(COLLECTIVES)})(?:-start)?\(", line)
        if not m:
            continue
        op = m.group(2)
        counts[op] += 1
        for dtype, dims in re.findall(r"(bf16|f32|s32|u32|pred)\[([\d,]*)\]", m.group(1)):
            size = sizes[dtype]
            for dim in filter(None, dims.split(",")):
                size *= int(dim)
            sent[op] += size
    return counts, sent


def balance(
    strategy: str, layout: str, n: int, ulysses: int, seq_len: int, tile: int, heads: int
) -> float:
    """Causal attention's work on the busiest device, summed over the strategy's rounds (a
    round lasts as long as its slowest device), in tile-heads (`tile_schedule`: the kernels'
    own skip predicate, tiles of `tile` x `tile`), as a share of the ideal: the whole causal
    triangle's tiles x heads / n. ring and all_gather run the same rounds; ulysses runs the
    whole sequence on heads / n heads per device (one round); usp runs a ring of n / ulysses on
    heads / ulysses heads."""
    from lclm.config import AttentionConfig
    from lclm.ops.context_parallel import layout_shards
    from lclm.ops.context_parallel.ring import tile_schedule

    ideal = tile_schedule("contiguous", 1, seq_len, tile, tile)[0, 0] * heads / n
    # a ring of `ring` members, each sp / ring devices splitting its heads by all-to-alls
    ring = layout_shards(AttentionConfig(strategy=strategy, ulysses=ulysses), n)
    per_device = heads * ring / n
    counts = tile_schedule(layout if ring > 1 else "contiguous", ring, seq_len, tile, tile)
    return float(ideal / (counts.max(axis=1).sum() * per_device))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out", default=None, help="output folder (default: a new one under bench_results/)"
    )
    ap.add_argument("--quick", action="store_true", help="one mesh (sp=4) only")
    args = ap.parse_args(argv)
    return run_cli(lambda: _run(args))


def _run(args) -> int:
    out = args.out or default_out_dir("strategies")
    check_output("--out", out)  # before the measuring, not at its first row
    from lclm.parallel.devices import request_cpu_devices

    request_cpu_devices(8)

    table = Table(
        "Context-parallel strategies against dense float32 attention",
        [
            *stamp(toy=True),
            "",
            "Largest relative error over the layouts "
            f"{', '.join(LAYOUTS)}, documents packed and not, "
            f"{' and '.join(h[0] for h in HEADS)} (query/K-V heads); blockwise kernel, "
            "64 tokens, head dim 16, chunks 8. usp's Ulysses degree in brackets.",
        ],
        ["strategy", "mesh", "cases", "o", "dq", "dk", "dv"],
        os.path.join(out, "strategies.md"),
    )
    worst = 0.0
    for strategy in STRATEGIES:
        for label, mesh_kw, ulysses in QUICK_MESHES if args.quick else MESHES:
            u = ulysses if "ulysses" in STRATEGIES[strategy].options else 1
            errors, cases = [0.0] * 4, 0
            for layout in LAYOUTS:
                for segments in (False, True):
                    for _, heads, kv_heads in HEADS:
                        split = mesh_kw.get("tp", 1) * {"ulysses": mesh_kw["sp"], "usp": u}.get(
                            strategy, 1
                        )
                        if heads % split:
                            continue
                        e = _errors(
                            strategy, layout, mesh_kw, u, heads, kv_heads, segments, seed=cases
                        )
                        errors = [max(a, b) for a, b in zip(errors, e)]
                        cases += 1
            worst = max(worst, *errors)
            name = f"{label} ({u})" if strategy == "usp" else label
            table.add([strategy, name, cases, *(f"{e:.1e}" for e in errors)])

    table.section(
        "Collectives in the compiled gradient (sp=4; usp: ulysses 2 x ring 2)",
        ["strategy", "collectives (count)", "bytes of their results per device"],
    )
    for strategy in STRATEGIES:
        program = gradient_program(strategy, 2 if strategy == "usp" else 1)
        counts, sent = collectives(program.compile().as_text())
        table.add(
            [
                strategy,
                ", ".join(f"{op} {c}" for op, c in sorted(counts.items()) if c),
                ", ".join(f"{op} {b:,}" for op, b in sorted(sent.items()) if counts[op]),
            ]
        )
    seq_len, tile, heads = 65536, 512, 32
    table.section(
        "Compute balance: the busiest device's attention work vs the ideal",
        ["strategy", *(f"{layout}, n={n}" for n in (4, 8) for layout in LAYOUTS)],
        [
            f"Causal attention over {seq_len:,} tokens, {heads} heads, tiles of {tile} "
            f"x {tile}, n devices (usp: groups of 2 and the ring of n/2): 1.00 = "
            "perfectly balanced with no partly-masked tile; tile counts only, no "
            "communication."
        ],
    )
    for strategy in STRATEGIES:
        table.add(
            [
                strategy,
                *(
                    f"{balance(strategy, layout, n, 2, seq_len, tile, heads):.2f}"
                    for n in (4, 8)
                    for layout in LAYOUTS
                ),
            ]
        )
    table.note(f"largest error of all: {worst:.1e}")
    return 0 if worst < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())

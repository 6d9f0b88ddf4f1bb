"""Kernel correctness on this device: every usable lclm kernel against a float32 dense reference.

    python -m bench.correctness [--quick] [--out DIR]

The first thing to run on a new accelerator: a kernel that is fast but wrong there (a Triton
or Mosaic lowering that differs from CPU interpret mode, a fused op that ignores the
statistics it is given) must be caught before any timing. Each case is one device's part of
a ring: its queries against the K/V blocks of some ring rounds, with the real positions of a
layout. Every block goes through the kernel's own `forward`; the partial results are merged
by log-sum-exp as the ring merges them; every block's `backward` then gets the *global*
output and lse (so an op that recomputed its own block's softmax instead would fail the
multi-round cases). Rounds: `causal` (diagonal), `strict` (striped, later device), `full`
(contiguous, earlier device), zigzag's `key half` and `query half`, a hidden round, packed
documents (segment ids of original positions), GQA (4 query heads per K/V head), and a whole
ring of 4 (striped, segments, GQA).

Each at head dims 64 and 128, bfloat16 inputs (as trained). The reference is dense softmax
attention in float32 on the same (bf16-rounded) inputs over all the case's keys with the
positions-and-segments mask; errors are max |kernel - reference| / max |reference| per output
(o, dq, dk, dv).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any

from bench.report import Table, default_out_dir, error_status, fmt, stamp
from lclm.cli import run_cli
from lclm.writes import check_output

# name -> (layout, ring size n, this device, the devices whose K/V blocks it sees, segments,
# GQA)
CASES = {
    "causal": ("contiguous", 1, 0, (0,), False, False),
    "strict": ("striped", 2, 0, (1,), False, False),
    "full": ("contiguous", 2, 1, (0,), False, False),
    "key half": ("zigzag", 2, 1, (0,), False, False),
    "query half": ("zigzag", 2, 0, (1,), False, False),
    "causal + hidden": ("contiguous", 2, 0, (0, 1), False, False),
    "segments": ("contiguous", 1, 0, (0,), True, False),
    "causal + strict, segments": ("striped", 2, 0, (0, 1), True, False),
    "gqa": ("contiguous", 1, 0, (0,), False, True),
    "ring of 4": ("striped", 4, 2, (2, 1, 0, 3), True, True),
}
# Kernels with a whole-sequence attention (`Kernel.whole`: one device, no ring; cudnn_gpu's
# cuDNN call) are also checked through `local_attention`, two rows of causal self-attention:
# case -> documents in the first row (0: no segment ids; the second row is one document).
# 48 is past cudnn_gpu's packed bound (32): those rows take the ring
WHOLE_CASES = {
    "whole": 0,
    "whole, 1 document": 1,
    "whole, 4 documents": 4,
    "whole, 48 documents": 48,
}
# bf16 inputs, float32 accumulation: errors of the size of bf16 rounding of p and ds
TOLERANCE = 2e-2


@dataclasses.dataclass(frozen=True)
class CorrectnessSpec:
    """Sizes of the correctness checks (small: seconds per kernel)."""

    block: int = 512
    heads: int = 8
    head_dims: tuple[int, ...] = (64, 128)
    q_chunk: int = 128
    kv_chunk: int = 128
    dtype: str = "bfloat16"
    impls: tuple[str, ...] | None = None  # kernels to check (None: every usable one)
    budget_s: float | None = None  # stop starting checks after this many seconds

    def smallest(self) -> CorrectnessSpec:
        return dataclasses.replace(
            self, block=128, heads=4, head_dims=self.head_dims[:1], q_chunk=64, kv_chunk=64
        )

    def quick(self) -> CorrectnessSpec:
        """The first part on a lent GPU: every usable kernel (the one `auto` picks first,
        blockwise last), every case, head dims 64 and 128, within 400 s of checks."""
        return dataclasses.replace(self, budget_s=400.0)


def case_inputs(case: str, t: int, heads: int, head_dim: int, dtype: str):
    """(q, k, v, do, q_pos, k_pos, q_seg, k_seg) of one case; k/v/k_pos/k_seg hold every
    block the case's device sees, one after another (`t` keys each). Positions and segment
    ids are host (numpy) arrays: the checks close over them as constants, as the ring tells a
    kernel the block pair's class where it is known."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from lclm.ops.layout import original_positions

    layout, n, device, sources, segments, gqa = CASES[case]
    kv_heads = heads // 4 if gqa else heads
    keys = jax.random.split(jax.random.key(list(CASES).index(case)), 4)
    shape = lambda h, blocks: (1, t * blocks, h, head_dim)
    q, do = (jax.random.normal(key, shape(heads, 1), jnp.dtype(dtype)) for key in keys[:2])
    k, v = (
        jax.random.normal(key, shape(kv_heads, len(sources)), jnp.dtype(dtype)) for key in keys[2:]
    )
    q_pos = np.asarray(original_positions(layout, n, device, t), np.int32)
    k_pos = np.concatenate([original_positions(layout, n, s, t) for s in sources]).astype(np.int32)
    seg = lambda pos: None
    if segments:  # documents of uneven lengths over the original positions of the whole row
        bounds = np.array([n * t // 5, n * t // 2, n * t * 3 // 4])
        seg = lambda pos: np.searchsorted(bounds, pos, side="right")[None].astype(np.int32)
    return q, k, v, do, q_pos, k_pos, seg(q_pos), seg(k_pos)


def dense_reference(q_pos, k_pos, q_seg, k_seg):
    """`(q, k, v, do) -> (o, dq, dk, dv)` in float32, jitted: `lclm.ops.kernels.reference.
    dense_attention` with the case's positions and segment ids on both sides (constants)."""
    import jax
    import jax.numpy as jnp

    from lclm.ops.kernels.reference import dense_attention

    @jax.jit
    def reference(q, k, v, do):
        def attend(q, k, v):
            return dense_attention(
                q, k, v, positions=q_pos, segment_ids=q_seg, k_positions=k_pos, k_segment_ids=k_seg
            )

        o, vjp = jax.vjp(attend, *(x.astype(jnp.float32) for x in (q, k, v)))
        return (o, *vjp(do.astype(jnp.float32)))

    return reference


def ring_of_blocks(kernel, blocks: int, tiles: dict, q_pos, k_pos, q_seg=None, k_seg=None):
    """`(q, k, v, do) -> (o, dq, dk, dv)` float32, jitted: the kernel over `blocks` equal K/V
    blocks as ring rounds (log-sum-exp merge; backward from the global o and lse).

    The positions and segment ids (host arrays, split here on the host) are closed over as
    constants, not passed as jit arguments: a range-based kernel then sees each block pair's
    class while tracing and lowers one fused call per round (and none for a hidden round)
    instead of a `lax.switch` over every class, as lclm's ring does where it knows the class.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    from lclm.ops.context_parallel.rounds import merge_partials

    # device arrays made here, outside the trace: concrete values inside it (kernels index
    # them with traced loop counters, which numpy arrays would refuse)
    const = lambda x: None if x is None else jnp.asarray(x)
    q_pos, q_seg = const(q_pos), const(q_seg)
    segs = (
        [None] * blocks
        if k_seg is None
        else [const(s) for s in np.split(np.asarray(k_seg), blocks, axis=1)]
    )
    positions = [const(p) for p in np.split(np.asarray(k_pos), blocks)]

    def run(q, k, v, do):
        rounds = list(
            zip(jnp.split(k, blocks, axis=1), jnp.split(v, blocks, axis=1), positions, segs)
        )
        o = jnp.zeros(q.shape, jnp.float32)
        lse = jnp.full(q.shape[:3], -jnp.inf, jnp.float32)
        for kb, vb, pb, sb in rounds:
            o, lse = merge_partials(
                o, lse, *kernel.forward(q, kb, vb, q_pos, pb, q_seg, sb, **tiles)
            )
        o_in = o.astype(q.dtype)
        grads = [
            kernel.backward(q, kb, vb, o_in, lse, do, q_pos, pb, q_seg, sb, **tiles)
            for kb, vb, pb, sb in rounds
        ]
        dq = sum(g[0] for g in grads)
        return (
            o,
            dq,
            jnp.concatenate([g[1] for g in grads], axis=1),
            jnp.concatenate([g[2] for g in grads], axis=1),
        )

    return jax.jit(run)


def check(impl: str, case: str, head_dim: int, spec: CorrectnessSpec, cache=None) -> dict:
    """Relative errors of one kernel on one case. `cache` (a dict) keeps each case's inputs
    and reference between kernels."""
    from lclm.ops.kernels import get_kernel

    key = (case, head_dim)
    if cache is None or key not in cache:
        args = case_inputs(case, spec.block, spec.heads, head_dim, spec.dtype)
        entry = (args, dense_reference(*args[4:])(*args[:4]))
        if cache is not None:
            cache[key] = entry
    else:
        entry = cache[key]
    args, want = entry
    q, k, v, do, *ids = args
    got = ring_of_blocks(get_kernel(impl), len(CASES[case][3]), tiles(spec), *ids)(q, k, v, do)
    return _errors(got, want)


def check_whole(impl: str, case: str, head_dim: int, spec: CorrectnessSpec) -> dict:
    """Relative errors of `local_attention` through kernel `impl` (its `Kernel.whole` where
    it has one) against dense float32 attention: one `WHOLE_CASES` case, 2 rows of
    `spec.block` tokens, GQA (4 query heads per K/V head)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from lclm.ops import local_attention

    t, docs = spec.block, WHOLE_CASES[case]
    keys = jax.random.split(jax.random.key(head_dim + docs), 4)
    shape = lambda h: (2, t, h, head_dim)
    q, do = (jax.random.normal(key, shape(spec.heads), jnp.dtype(spec.dtype)) for key in keys[:2])
    k, v = (
        jax.random.normal(key, shape(spec.heads // 4), jnp.dtype(spec.dtype)) for key in keys[2:]
    )
    seg = (
        None
        if not docs
        else jnp.asarray(np.stack([np.arange(t) * docs // t, np.full(t, 7)]), jnp.int32)
    )

    # the segment ids are a jit argument, as in training: a kernel that picks its call from
    # them on the device (cudnn_gpu's switch) runs it with a runtime index, every branch built
    @jax.jit
    def attended(q, k, v, seg):
        o, vjp = jax.vjp(
            lambda q, k, v: local_attention(q, k, v, segment_ids=seg, impl=impl, **tiles(spec)),
            q,
            k,
            v,
        )
        return (o, *vjp(do))

    positions = np.arange(t)
    want = dense_reference(positions, positions, seg, seg)(q, k, v, do)
    return _errors(attended(q, k, v, seg), want)


def _errors(got, want) -> dict:
    """max |got - want| / max |want| of (o, dq, dk, dv), the worst, and the status."""
    import numpy as np

    errors = {}
    for name, g, w in zip(("o", "dq", "dk", "dv"), got, want):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        errors[name] = float(np.max(np.abs(g - w)) / (np.max(np.abs(w)) + 1e-12))
    worst = max(errors.values())
    ok = np.isfinite(worst) and worst < TOLERANCE
    return dict(errors, worst=worst, status="ok" if ok else "WRONG")


def tiles(spec: CorrectnessSpec) -> dict:
    """The kernels' arguments besides the arrays: causal, the spec's tiles."""
    return dict(causal=True, q_chunk=spec.q_chunk, kv_chunk=spec.kv_chunk)


def kernel_order(kernels: list[str], preferred: str | None) -> list[str]:
    """The kernel `auto` picks first, the other fused kernels next, blockwise (pure JAX, the
    one checked everywhere else) last: what a budget cuts short is the least informative."""
    rank = lambda k: (k != preferred, k == "blockwise")
    return sorted(kernels, key=rank)


def checked_kernels(platform: str, spec: CorrectnessSpec) -> tuple[list[str], list[str]]:
    """(the kernels the part checks on `platform`, in `kernel_order`; 'name: why' of those it
    cannot)."""
    from bench.attention import preferred_kernel, usable_kernels

    kernels, skipped = usable_kernels(platform)
    kernels = [k for k in kernels if spec.impls is None or k in spec.impls]
    return kernel_order(kernels, preferred_kernel(platform)), skipped


HEADER = ["kernel", "case", "head dim", "o", "dq", "dk", "dv", "seconds", "status"]


def run(spec: CorrectnessSpec, out_dir: str, toy: bool = False, on_row=None) -> str:
    """Check every usable kernel; write `correctness.md` row by row. Returns its path.

    `on_row(result)` is called after each row is written. Raises RuntimeError (after the
    table is complete) when a kernel is wrong or could not run."""
    import time

    import jax

    from bench.timing import Budget
    from lclm.ops.kernels import get_kernel

    kernels, skipped = checked_kernels(jax.devices()[0].platform, spec)
    budget = Budget(spec.budget_s)
    notes = stamp(toy) + [
        f"One device's queries ({spec.block} tokens, {spec.heads} query heads, {spec.dtype} "
        f"inputs, tiles {spec.q_chunk} x {spec.kv_chunk}) against the K/V blocks of some ring "
        "rounds: the kernel's forward and backward (merged as the ring merges them, backward "
        "from the global o and lse) against dense float32 attention with the same mask; "
        f"error = max |kernel - reference| / max |reference|; 'ok' below {TOLERANCE:g}. "
        "Positions are constants of each jitted check (one fused call per round); seconds = "
        "compile + run of the check.",
        "Skipped kernels: " + ("; ".join(skipped) if skipped else "none") + ".",
    ]
    if spec.budget_s is not None:
        notes.append(
            f"Checks start only within a {spec.budget_s:g} s budget (rows past it say so)."
        )
    path = os.path.join(out_dir, "correctness.md")
    table = Table("Kernel correctness against a float32 dense reference", notes, HEADER, path)
    cache: dict = {}
    bad: list[dict] = []
    for impl in kernels:
        whole = WHOLE_CASES if get_kernel(impl).whole is not None else {}
        # a kernel whose block-pair passes are another checked kernel's (cudnn_gpu's are
        # tokamax_gpu's) is checked only where it differs
        shared = any(
            get_kernel(other).forward is get_kernel(impl).forward
            for other in kernels
            if other != impl
        )
        for head_dim in spec.head_dims:
            for case in (*({} if shared and whole else CASES), *whole):
                t0 = time.perf_counter()
                if budget.spent():
                    r: dict[str, Any] = dict(status=budget.skipped())
                else:
                    try:
                        r = (
                            check_whole(impl, case, head_dim, spec)
                            if case in whole
                            else check(impl, case, head_dim, spec, cache)
                        )
                    except Exception as e:  # noqa: BLE001  (a kernel that cannot run here)
                        r = dict(status=error_status(e))
                r = dict(
                    r, impl=impl, case=case, head_dim=head_dim, seconds=time.perf_counter() - t0
                )
                if not r["status"].startswith(("ok", "skipped")):
                    bad.append(r)
                table.add(
                    (
                        impl,
                        case,
                        head_dim,
                        *(fmt(r.get(n), ".1e") for n in ("o", "dq", "dk", "dv")),
                        fmt(r["seconds"], ".1f"),
                        r["status"],
                    )
                )
                if on_row is not None:
                    on_row(r)
    if bad:
        raise RuntimeError(f"kernel correctness failed ({len(bad)} rows): see {path}")
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=default_out_dir("correctness"))
    ap.add_argument("--quick", action="store_true", help="the quick size (a 400 s budget)")
    args = ap.parse_args(argv)

    def body():
        check_output("--out", args.out)  # before the measuring, not at its first row
        os.makedirs(args.out, exist_ok=True)
        try:
            run(CorrectnessSpec().quick() if args.quick else CorrectnessSpec(), args.out)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())

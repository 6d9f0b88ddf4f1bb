"""Kernel correctness on this device: every usable lclm kernel against a float32 dense reference.

    python -m bench.correctness [--out DIR]

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

from bench.report import default_out_dir, emit_table, error_status, fmt, stamp

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

    def smallest(self) -> "CorrectnessSpec":
        return dataclasses.replace(self, block=128, heads=4, head_dims=self.head_dims[:1],
                                   q_chunk=64, kv_chunk=64)


def case_inputs(case: str, t: int, heads: int, head_dim: int, dtype: str):
    """(q, k, v, do, q_pos, k_pos, q_seg, k_seg) of one case; k/v/k_pos/k_seg hold every
    block the case's device sees, one after another (`t` keys each)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from lclm.ops.layout import original_positions

    layout, n, device, sources, segments, gqa = CASES[case]
    kv_heads = heads // 4 if gqa else heads
    keys = jax.random.split(jax.random.key(list(CASES).index(case)), 4)
    shape = lambda h, blocks: (1, t * blocks, h, head_dim)
    q, do = (jax.random.normal(key, shape(heads, 1), jnp.dtype(dtype)) for key in keys[:2])
    k, v = (jax.random.normal(key, shape(kv_heads, len(sources)), jnp.dtype(dtype))
            for key in keys[2:])
    q_pos = original_positions(layout, n, device, t)
    k_pos = np.concatenate([original_positions(layout, n, s, t) for s in sources])
    seg = lambda pos: None
    if segments:  # documents of uneven lengths over the original positions of the whole row
        bounds = np.array([n * t // 5, n * t // 2, n * t * 3 // 4])
        seg = lambda pos: jnp.asarray(np.searchsorted(bounds, pos, side="right")[None],
                                      jnp.int32)
    return (q, k, v, do, jnp.asarray(q_pos, jnp.int32), jnp.asarray(k_pos, jnp.int32),
            seg(q_pos), seg(k_pos))


def dense_reference(q, k, v, do, q_pos, k_pos, q_seg, k_seg):
    """(o, dq, dk, dv) in float32 of `lclm.ops.attention.dense_attention` with the case's
    positions and segment ids on both sides."""
    import jax
    import jax.numpy as jnp

    from lclm.ops.attention import dense_attention

    def attend(q, k, v):
        return dense_attention(q, k, v, positions=q_pos, segment_ids=q_seg, k_positions=k_pos,
                               k_segment_ids=k_seg)

    o, vjp = jax.vjp(attend, *(x.astype(jnp.float32) for x in (q, k, v)))
    return (o, *vjp(do.astype(jnp.float32)))


def ring_of_blocks(kernel, blocks: int, tiles: dict):
    """`(q, k, v, do, q_pos, k_pos, q_seg, k_seg) -> (o, dq, dk, dv)` float32: the kernel over
    `blocks` equal K/V blocks as ring rounds (log-sum-exp merge; backward from the global
    o and lse), jitted."""
    import jax
    import jax.numpy as jnp

    from lclm.ops.ring_attention import merge_partials

    def run(q, k, v, do, q_pos, k_pos, q_seg, k_seg):
        segs = [None] * blocks if k_seg is None else jnp.split(k_seg, blocks, axis=1)
        rounds = list(zip(jnp.split(k, blocks, axis=1), jnp.split(v, blocks, axis=1),
                          jnp.split(k_pos, blocks), segs))
        o = jnp.zeros(q.shape, jnp.float32)
        lse = jnp.full(q.shape[:3], -jnp.inf, jnp.float32)
        for kb, vb, pb, sb in rounds:
            o, lse = merge_partials(o, lse, *kernel.forward(q, kb, vb, q_pos, pb, q_seg, sb,
                                                            **tiles))
        o_in = o.astype(q.dtype)
        grads = [kernel.backward(q, kb, vb, o_in, lse, do, q_pos, pb, q_seg, sb, **tiles)
                 for kb, vb, pb, sb in rounds]
        dq = sum(g[0] for g in grads)
        return (o, dq, jnp.concatenate([g[1] for g in grads], axis=1),
                jnp.concatenate([g[2] for g in grads], axis=1))
    return jax.jit(run)


def check(impl: str, case: str, head_dim: int, spec: CorrectnessSpec) -> dict:
    """Relative errors of one kernel on one case."""
    import numpy as np

    from lclm.ops.attention import get_kernel

    args = case_inputs(case, spec.block, spec.heads, head_dim, spec.dtype)
    tiles = dict(causal=True, q_chunk=spec.q_chunk, kv_chunk=spec.kv_chunk)
    got = ring_of_blocks(get_kernel(impl), len(CASES[case][3]), tiles)(*args)
    want = dense_reference(*args)
    errors = {}
    for name, g, w in zip(("o", "dq", "dk", "dv"), got, want):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        errors[name] = float(np.max(np.abs(g - w)) / (np.max(np.abs(w)) + 1e-12))
    worst = max(errors.values())
    ok = np.isfinite(worst) and worst < TOLERANCE
    return dict(errors, worst=worst, status="ok" if ok else "WRONG")


def run(spec: CorrectnessSpec, out_dir: str, toy: bool = False) -> str:
    """Check every usable kernel; write `correctness.md`. Returns its path."""
    import jax

    from bench.attention import usable_kernels

    kernels, skipped = usable_kernels(jax.devices()[0].platform)
    results = []
    for impl in kernels:
        for head_dim in spec.head_dims:
            for case in CASES:
                try:
                    r = check(impl, case, head_dim, spec)
                except Exception as e:  # noqa: BLE001  (a kernel that cannot run here)
                    r = dict(status=error_status(e))
                results.append(dict(r, impl=impl, case=case, head_dim=head_dim))
    rows = [(r["impl"], r["case"], r["head_dim"], *(fmt(r.get(n), ".1e") for n in
                                                     ("o", "dq", "dk", "dv")), r["status"])
            for r in results]
    notes = stamp(toy) + [
        f"One block pair of {spec.block} x {spec.block} tokens, {spec.heads} query heads, "
        f"{spec.dtype} inputs, tiles {spec.q_chunk} x {spec.kv_chunk}: the kernel's forward "
        "and backward against dense float32 attention with the same mask; error = max "
        f"|kernel - reference| / max |reference|; 'ok' below {TOLERANCE:g}.",
        "Skipped kernels: " + ("; ".join(skipped) if skipped else "none") + "."]
    path = os.path.join(out_dir, "correctness.md")
    emit_table("Kernel correctness against a float32 dense reference", notes,
               ["kernel", "case", "head dim", "o", "dq", "dk", "dv", "status"], rows, path)
    if any(r["status"] != "ok" for r in results):
        raise RuntimeError(f"kernel correctness failed: see {path}")
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=default_out_dir("correctness"))
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    try:
        run(CorrectnessSpec(), args.out)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

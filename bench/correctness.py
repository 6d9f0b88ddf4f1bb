"""Kernel correctness on this device: every usable lclm kernel against a float32 dense reference.

    python -m bench.correctness [--out DIR]

The first thing to run on a new accelerator: a kernel that is fast but wrong there (a Triton
or Mosaic lowering that differs from CPU interpret mode) must be caught before any timing.
For each kernel and case, one block pair goes through the kernel's own `forward` and
`backward` (the backward fed the pair's own o and lse, which are then the global ones) with
the positions of a real ring round:

- `causal`: the diagonal round (positions equal on both sides);
- `strict`: a striped round from a later device (key position = query position + 1 at the
  same local index: the query at local index x sees keys y < x only);
- `full`: a contiguous round from an earlier device (every key before every query);
- `segments`: causal with packed documents (segment ids);
- `gqa`: causal with 4 query heads per K/V head.

Each at head dims 64 and 128, in bfloat16 inputs (as trained). The reference is dense softmax
attention in float32 on the same (bf16-rounded) inputs with the same mask; errors are the
maximum absolute error over the maximum reference magnitude, per output (o, dq, dk, dv).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from bench.report import default_out_dir, emit_table, error_status, fmt, stamp

CASES = ("causal", "strict", "full", "segments", "gqa")
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
    """(q, k, v, do, q_pos, k_pos, q_seg, k_seg) of one case; q/k/v/do `[1, t, h, d]`."""
    import jax
    import jax.numpy as jnp

    kv_heads = heads // 4 if case == "gqa" else heads
    keys = jax.random.split(jax.random.key(CASES.index(case)), 4)
    shape = lambda h: (1, t, h, head_dim)
    q, do = (jax.random.normal(k, shape(heads), jnp.dtype(dtype)) for k in keys[:2])
    k, v = (jax.random.normal(k, shape(kv_heads), jnp.dtype(dtype)) for k in keys[2:])
    q_pos = jnp.arange(t, dtype=jnp.int32)
    k_pos = {"strict": q_pos + 1, "full": q_pos - t}.get(case, q_pos)
    seg = None
    if case == "segments":  # three documents of uneven lengths
        seg = jnp.searchsorted(jnp.array([t // 5, t // 2]), q_pos, side="right")[None]
        seg = seg.astype(jnp.int32)
    return q, k, v, do, q_pos, k_pos, seg, seg


def dense_reference(q, k, v, do, q_pos, k_pos, q_seg, k_seg):
    """(o, dq, dk, dv) in float32 of masked softmax attention (rows with nothing visible: 0)."""
    import jax
    import jax.numpy as jnp

    mask = (q_pos[:, None] >= k_pos[None, :])[None]
    if q_seg is not None:
        mask = mask & (q_seg[:, :, None] == k_seg[:, None, :])

    def attend(q, k, v):
        rep = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
        s = jnp.where(mask[:, None], s, -jnp.inf)
        p = jnp.where(mask[:, None], jax.nn.softmax(s, axis=-1), 0.0)
        return jnp.einsum("bhqk,bkhd->bqhd", jnp.nan_to_num(p), v)

    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    o, vjp = jax.vjp(attend, *f32)
    return (o, *vjp(do.astype(jnp.float32)))


def check(impl: str, case: str, head_dim: int, spec: CorrectnessSpec) -> dict:
    """Relative errors of one kernel on one case."""
    import jax
    import numpy as np

    from lclm.ops.attention import get_kernel

    kernel = get_kernel(impl)
    args = case_inputs(case, spec.block, spec.heads, head_dim, spec.dtype)
    q, k, v, do, q_pos, k_pos, q_seg, k_seg = args
    tiles = dict(causal=True, q_chunk=spec.q_chunk, kv_chunk=spec.kv_chunk)

    @jax.jit
    def both(q, k, v, do, q_pos, k_pos, q_seg, k_seg):
        o, lse = kernel.forward(q, k, v, q_pos, k_pos, q_seg, k_seg, **tiles)
        grads = kernel.backward(q, k, v, o.astype(q.dtype), lse, do, q_pos, k_pos, q_seg,
                                k_seg, **tiles)
        return (o, *grads)

    got = both(*args)
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

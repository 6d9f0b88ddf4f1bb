"""Attention on one device: forward and forward+backward TFLOP/s of every usable kernel.

    python -m bench.attention [--blocks 4096,8192,16384,32768] [--heads 16,32] \
        [--head-dims 128,64] [--quick] [--out DIR]

Methods, each jitted once per shape and timed with `bench.timing.median_seconds`:

- every lclm kernel (`lclm.ops.kernels.KERNELS`) that imports and suits the backend
  (`pallas_gpu` on GPU, `pallas_tpu` on TPU, `blockwise` everywhere), called through
  `lclm.ops.local_attention` (the ring with one member, custom VJP included);
- `jax.nn.dot_product_attention(implementation='cudnn')` on GPU (fused, not ring-capable);
- the official `ringattention` package's JAX ring when it is installed, in a one-device
  `shard_map` (skipped otherwise).

Inputs: batch 1, `[t, heads, head_dim]` q/k/v in bf16, causal and full masks. FLOPs: forward
4*b*h*t*t*d (full), causal counted as half; forward+backward = 3.5 x forward (as in the
project's anchors), so causal and full TFLOP/s are directly comparable.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

from bench import int_list
from bench.report import Table, default_out_dir, error_status, fmt, stamp, try_plot
from lclm.cli import run_cli
from lclm.writes import check_output

FWD_BWD_FACTOR = 3.5


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Sizes of one attention benchmark run."""

    blocks: tuple[int, ...] = (4096, 8192, 16384, 32768)
    heads: tuple[int, ...] = (16, 32)
    head_dims: tuple[int, ...] = (128,)
    dtype: str = "bfloat16"
    impls: tuple[str, ...] | None = None  # lclm kernels to time (None: every usable one)
    q_chunk: int = 1024  # lclm kernels' and the official package's tile sizes
    kv_chunk: int = 1024
    warmup: int = 2
    iters: int = 5
    masks: tuple[str, ...] = ("causal", "full")
    budget_s: float | None = None  # stop starting measurements after this many seconds

    def smallest(self) -> AttentionSpec:
        return dataclasses.replace(
            self,
            blocks=self.blocks[:1],
            heads=self.heads[:1],
            head_dims=self.head_dims[:1],
            masks=self.masks[:1],
            warmup=0,
            iters=1,
        )

    def quick(self) -> AttentionSpec:
        """Causal blocks of 8K and 32K tokens, 16 heads of 128 and of 64: tokamax_gpu and
        pallas_gpu against cuDNN (24 compiles: 2 x 2 shapes x 3 methods x fwd, fwd+bwd),
        within a 400 s budget."""
        return dataclasses.replace(
            self,
            blocks=(8192, 32768),
            heads=(16,),
            head_dims=(128, 64),
            masks=("causal",),
            impls=("tokamax_gpu", "pallas_gpu"),
            warmup=1,
            iters=3,
            budget_s=400.0,
        )


class Method(NamedTuple):
    """An attention implementation: `fn(q, k, v, causal) -> o` (differentiable)."""

    name: str
    fn: Callable


def attention_flops(batch: int, heads: int, t: int, head_dim: int, causal: bool) -> float:
    """Forward FLOPs of square attention: 4*b*h*t*t*d, causal counted as half."""
    return 4.0 * batch * heads * t * t * head_dim * (0.5 if causal else 1.0)


def _kernel_platform(name: str) -> str | None:
    """The platform a kernel is written for ('pallas_gpu' -> 'gpu'); None = every platform."""
    return name.rsplit("_", 1)[1] if name.endswith(("_gpu", "_tpu")) else None


# the shapes the suites time (LLaMA head dims, 1K tiles, long blocks): for the kernels' limits
_SUITE_SHAPES: dict[str, Any] = dict(
    head_dim=128, q_chunk=1024, kv_chunk=1024, block=32768, dtype="bfloat16"
)


def usable_kernels(platform: str) -> tuple[list[str], list[str]]:
    """(names of lclm kernels that suit `platform` and import, 'name: why' for the others)."""
    from lclm.ops.kernels import KERNELS, get_kernel, platform_family

    usable, skipped = [], []
    for name in KERNELS:
        target = _kernel_platform(name)
        if target not in (None, platform):
            skipped.append(f"{name}: written for {target}, not {platform}")
            continue
        try:
            kernel = get_kernel(name)
        except Exception as e:  # noqa: BLE001  (a missing or half-written kernel module)
            skipped.append(f"{name}: {type(e).__name__}: {str(e)[:100]}")
            continue
        why = kernel.limits(platform=platform_family(platform), **_SUITE_SHAPES)
        if why is not None:  # e.g. tokamax not installed, or not a Hopper GPU
            skipped.append(f"{name}: {why}")
            continue
        usable.append(name)
    return usable, skipped


def preferred_kernel(platform: str) -> str:
    """The kernel `attention.impl='auto'` picks here for the suites' shapes."""
    from lclm.ops.kernels import choose_kernel

    return choose_kernel("auto", platform=platform, **_SUITE_SHAPES)


def lclm_method(impl: str, q_chunk: int, kv_chunk: int) -> Method:
    """An lclm kernel through `local_attention` (one device, original token order)."""
    from lclm.ops import local_attention

    def fn(q, k, v, causal):
        return local_attention(
            q, k, v, causal=causal, impl=impl, q_chunk=q_chunk, kv_chunk=kv_chunk
        )

    return Method(f"lclm {impl}", fn)


def cudnn_method() -> Method:
    """cuDNN's fused flash attention through `jax.nn.dot_product_attention`."""
    import jax

    def fn(q, k, v, causal):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")

    return Method(CUDNN, fn)


def _official_ring_module():
    """The official package's pure-JAX ring module, loaded from its file.

    The package's `__init__` calls `jax.lib.xla_bridge`, which newer JAX removed; loading the
    module file directly avoids it and is the code the package runs on GPU anyway (0.1.2 maps
    its GPU entry point to this JAX ring). Raises ImportError when it is not installed.
    """
    spec = importlib.util.find_spec("ringattention")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the ringattention package is not installed")
    for filename in ("ringattention_jax.py", "ringattention_base.py"):  # 0.1.2, older
        path = os.path.join(spec.submodule_search_locations[0], filename)
        if os.path.isfile(path):
            loader = importlib.util.spec_from_file_location("_official_ringattention", path)
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
            return module
    raise ImportError("ringattention: no ringattention_jax.py in the installed package")


def official_ring_method(q_chunk: int, kv_chunk: int) -> Method:
    """`ringattention.ring_attention` (float32 logits, its default recipe) on a one-device ring."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    module = _official_ring_module()
    mesh = Mesh(np.array(jax.devices()[:1]), ("sp",))

    def fn(q, k, v, causal):
        kwargs = dict(
            causal_block_size=1 if causal else None,
            query_chunk_size=q_chunk,
            key_chunk_size=kv_chunk,
            deterministic=True,
            dropout_rng=None,
            attn_pdrop=0.0,
            dtype=jnp.float32,
            policy=jax.checkpoint_policies.nothing_saveable,
            precision=None,
            prevent_cse=True,
        )
        # positional: its custom VJP declares axis name, float32 logits and kwargs by position
        ring = lambda q, k, v: module.ring_attention(q, k, v, None, None, None, "sp", True, kwargs)
        return jax.shard_map(ring, mesh=mesh, in_specs=(P(),) * 3, out_specs=P(), check_vma=False)(
            q, k, v
        )

    return Method("ringattention (official)", fn)


def methods(platform: str, spec: AttentionSpec) -> tuple[list[Method], list[str]]:
    """Every method that runs here (cuDNN first), and 'name: why' for the ones skipped."""
    kernels, skipped = usable_kernels(platform)
    found = [cudnn_method()] if platform == "gpu" else []  # first: the reference of each shape
    if platform != "gpu":
        skipped.append("cuDNN: GPU only")
    found += [
        lclm_method(name, spec.q_chunk, spec.kv_chunk)
        for name in kernels
        if spec.impls is None or name in spec.impls
    ]
    try:
        found.append(official_ring_method(spec.q_chunk, spec.kv_chunk))
    except Exception as e:  # noqa: BLE001  (optional package; any import failure skips it)
        skipped.append(f"ringattention (official): {type(e).__name__}: {str(e)[:100]}")
    return found, skipped


def jitted_passes(method: Method, causal: bool):
    """(forward, forward+backward) of `method`, each jitted once.

    The backward takes the output cotangent as an argument so XLA cannot fold it away.
    """
    import jax

    attend = functools.partial(method.fn, causal=causal)

    def fwd_bwd(q, k, v, do):
        _, vjp = jax.vjp(attend, q, k, v)
        return vjp(do)

    return jax.jit(attend), jax.jit(fwd_bwd)


def qkv(batch: int, t: int, heads: int, head_dim: int, dtype: str):
    """Random q, k, v and an output cotangent do, each `[batch, t, heads, head_dim]`."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(0), 4)
    return [jax.random.normal(key, (batch, t, heads, head_dim), jnp.dtype(dtype)) for key in keys]


def measure(
    method: Method,
    t: int,
    heads: int,
    causal: bool,
    spec: AttentionSpec,
    head_dim: int | None = None,
) -> dict:
    """Forward and forward+backward seconds and TFLOP/s of one method at one shape
    (head dim: the spec's first unless given)."""
    from bench.timing import median_seconds

    head_dim = head_dim or spec.head_dims[0]
    q, k, v, do = qkv(1, t, heads, head_dim, spec.dtype)
    fwd, fwd_bwd = jitted_passes(method, causal)
    flops = attention_flops(1, heads, t, head_dim, causal)
    timing = dict(warmup=spec.warmup, iters=spec.iters)
    fwd_s, _ = median_seconds(fwd, q, k, v, **timing)
    fb_s, _ = median_seconds(fwd_bwd, q, k, v, do, **timing)
    return dict(
        fwd_s=fwd_s,
        fwd_bwd_s=fb_s,
        fwd_tflops=flops / fwd_s / 1e12,
        fwd_bwd_tflops=FWD_BWD_FACTOR * flops / fb_s / 1e12,
    )


def measure_all(found: list[Method], spec: AttentionSpec, on_result=None) -> list[dict]:
    """Every method, mask, head dim, head count and block; a failure (out of memory, a mask
    a kernel does not support) becomes that result's status and the run goes on; past the
    spec's budget the remaining results are marked skipped. `on_result(result)` is called as
    each one is measured."""
    import itertools

    from bench.timing import Budget

    budget = Budget(spec.budget_s)
    results = []
    shapes = itertools.product(spec.masks, spec.head_dims, spec.heads, spec.blocks)
    for (mask, head_dim, heads, t), method in itertools.product(shapes, found):
        if budget.spent():
            r = dict(status=budget.skipped())
        else:
            try:
                r = dict(measure(method, t, heads, mask == "causal", spec, head_dim), status="ok")
            except Exception as e:  # noqa: BLE001
                r = dict(status=error_status(e))
        r = dict(r, method=method.name, heads=heads, t=t, head_dim=head_dim, mask=mask)
        results.append(r)
        if on_result is not None:
            on_result(r)
    return results


CUDNN = "cuDNN (jax.nn)"


def versus(results: list[dict], reference: str = CUDNN) -> list[float | None]:
    """Each result's forward+backward TFLOP/s over `reference`'s at the same shape and mask."""
    key = lambda r: (r["mask"], r["head_dim"], r["heads"], r["t"])
    ref = {key(r): r.get("fwd_bwd_tflops") for r in results if r["method"] == reference}
    return [
        None
        if not ref.get(key(r)) or r.get("fwd_bwd_tflops") is None
        else r["fwd_bwd_tflops"] / ref[key(r)]
        for r in results
    ]


def _plot(results: list[dict], out_dir: str, toy: bool) -> str:
    from bench.plots import Panel, save_lines

    panels: dict[tuple, Panel] = {}
    for r in results:
        for key, label in (("fwd_tflops", "forward"), ("fwd_bwd_tflops", "forward+backward")):
            panel = panels.setdefault(
                (r["heads"], r["head_dim"], key),
                Panel(
                    f"{label}, h={r['heads']}, d={r['head_dim']}",
                    "block length t (tokens)",
                    "TFLOP/s",
                ),
            )
            panel.add(
                f"{r['method']} {r['mask']}",
                r["t"],
                r.get(key),
                "o-" if r["mask"] == "causal" else "s--",
            )
    return save_lines(
        os.path.join(out_dir, "attention.png"),
        "Attention kernels, one device",
        stamp(toy),
        list(panels.values()),
    )


HEADER = [
    "method",
    "mask",
    "head dim",
    "heads",
    "block t",
    "fwd ms",
    "fwd TFLOP/s (4bht²d; causal = half)",
    "fwd+bwd ms",
    "fwd+bwd TFLOP/s (3.5 x fwd FLOPs)",
    "fwd+bwd vs cuDNN",
    "status",
]


def row(r: dict, ratio) -> tuple:
    return (
        r["method"],
        r["mask"],
        r["head_dim"],
        r["heads"],
        r["t"],
        fmt(r.get("fwd_s"), ",.2f", 1e3),
        fmt(r.get("fwd_tflops"), ".3g"),
        fmt(r.get("fwd_bwd_s"), ",.2f", 1e3),
        fmt(r.get("fwd_bwd_tflops"), ".3g"),
        fmt(ratio, ".2f"),
        r["status"],
    )


def run(spec: AttentionSpec, out_dir: str, toy: bool = False) -> str:
    """Measure every method at every size; write `attention.md` row by row, then its plot.
    Returns the md path."""
    import jax

    found, skipped = methods(jax.devices()[0].platform, spec)
    notes = stamp(toy) + [
        f"Batch 1, {spec.dtype}, K/V heads = heads; lclm tiles "
        f"{spec.q_chunk} x {spec.kv_chunk}; median of {spec.iters} runs after "
        f"{spec.warmup} warm-up runs, each jitted once and synchronised with block_until_ready."
        " TFLOP/s count causal attention as half the square.",
        "Skipped: " + ("; ".join(skipped) if skipped else "none") + ".",
    ]
    if spec.budget_s is not None:
        notes.append(
            f"Measurements start only within a {spec.budget_s:g} s budget (rows past it say so)."
        )
    path = os.path.join(out_dir, "attention.md")
    table = Table("Attention kernels on one device: TFLOP/s", notes, HEADER, path)
    done = []

    def write(r):  # the shape's cuDNN row, measured first, is already in `done`
        done.append(r)
        table.add(row(r, versus(done)[-1]))

    results = measure_all(found, spec, on_result=write)
    table.image(try_plot(_plot, results, out_dir, toy))
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default = AttentionSpec()
    ap.add_argument("--blocks", default=",".join(map(str, default.blocks)))
    ap.add_argument("--heads", default=",".join(map(str, default.heads)))
    ap.add_argument("--head-dims", default=",".join(map(str, default.head_dims)))
    ap.add_argument("--chunk", type=int, default=default.q_chunk, help="q and kv tile size")
    ap.add_argument("--iters", type=int, default=default.iters)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="the quick size (AttentionSpec.quick; the size options are ignored)",
    )
    ap.add_argument("--out", default=default_out_dir("attention"))
    args = ap.parse_args(argv)
    spec = dataclasses.replace(
        default,
        blocks=int_list(args.blocks),
        heads=int_list(args.heads),
        head_dims=int_list(args.head_dims),
        q_chunk=args.chunk,
        kv_chunk=args.chunk,
        iters=args.iters,
    )

    def body():
        check_output("--out", args.out)  # before the measuring, not at its first row
        run(default.quick() if args.quick else spec, args.out)

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())

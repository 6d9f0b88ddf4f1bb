"""tokamax's Mosaic GPU attention backward: its own heuristic tile config against every config
of its autotuning set and against cuDNN's backward, one causal block (needs a Hopper GPU and
tokamax).

    python -m bench.tokamax_configs --out DIR/tokamax_configs.md [--seq 32768]

Rows go to the file (replaced at the start) and stdout as they are measured: head dim 64 with
LLaMA-3.2-1B's heads (32 queries, 8 keys/values), then head dim 128 with 16 and 16. The
heuristic row is lclm's own call (`lclm.ops.kernels.tokamax_gpu.attend_vjp`: causal, no key
range, residuals from tokamax's forward), the others the same op with a config set; cuDNN's
backward is its forward+backward less its forward
(`jax.nn.dot_product_attention(implementation='cudnn')`). TFLOP/s count the causal forward's
half of 4 T^2 H D, times 2.5 for the backward. lclm uses the heuristic config; this is the
check that none of tokamax's others beats it.
"""

from __future__ import annotations

import argparse
import os
import sys

from bench.timing import median_seconds
from lclm.cli import run_cli

SHAPES = ((64, 32, 8), (128, 16, 16))  # head dim, query heads, key/value heads


def _median_s(f, *args) -> float:
    """Median seconds of 5 calls after the compiling one."""
    return median_seconds(f, *args, warmup=0, iters=5)[0]


def run(out: str, seq: int) -> None:
    import jax
    import jax.numpy as jnp
    from tokamax._src.ops.attention import pallas_mosaic_gpu_vjp_kernel_sm90 as sm90
    from tokamax._src.ops.attention.pallas_mosaic_gpu import (
        Mask,
        PallasMosaicGpuFlashAttention,
    )
    from tokamax._src.ops.attention.pallas_mosaic_gpu_vjp import (
        PallasMosaicGpuFlashAttentionVjp,
    )

    from lclm.ops.kernels import tokamax_gpu

    open(out, "w").close()

    def row(text: str) -> None:
        print(text, flush=True)
        with open(out, "a") as f:
            f.write(text + "\n")

    row(
        f"# tokamax {seq}-token causal backward: tile configs vs cuDNN\n\ndevice: "
        f"{jax.devices()[0].device_kind}; jax {jax.__version__}\n\n"
        "| head dim | q/kv heads | config | backward ms | TF/s (2.5 x causal forward) |\n"
        "| --- | --- | --- | --- | --- |"
    )
    for hd, hq, hkv in SHAPES:
        keys = jax.random.split(jax.random.key(0), 4)
        q, do = (jax.random.normal(key, (1, seq, hq, hd), jnp.bfloat16) for key in keys[:2])
        k, v = (jax.random.normal(key, (1, seq, hkv, hd), jnp.bfloat16) for key in keys[2:])
        flops = 2.5 * 0.5 * 4 * seq * seq * hq * hd
        forward, mask = PallasMosaicGpuFlashAttention(), Mask(is_causal=True)
        o, (m, l) = jax.jit(
            lambda q, k, v, forward=forward, mask=mask: forward(
                q, k, v, mask=mask, return_residuals=True
            )
        )(q, k, v)
        lse = m + jnp.log(l)
        kwargs = dict(forward.bind(q, k, v, mask=mask, return_residuals=True).kwargs)
        kwargs.pop("return_residuals")

        def cudnn(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

        both = jax.jit(lambda q, k, v, do: jax.vjp(cudnn, q, k, v)[1](do))
        t = _median_s(both, q, k, v, do) - _median_s(jax.jit(cudnn), q, k, v)
        row(
            f"| {hd} | {hq}/{hkv} | cuDNN (forward+backward less forward) | {t * 1e3:.2f} | "
            f"{flops / t / 1e12:.0f} |"
        )
        lclms = jax.jit(
            lambda lse, o, do, q, k, v: tokamax_gpu.attend_vjp(
                q, k, v, o, lse.transpose(0, 2, 1), do, True, None, None
            )
        )  # lse [b, t, h] there
        for config in [None, *sorted(sm90.get_autotuning_configs(None), key=repr)]:
            vjp = PallasMosaicGpuFlashAttentionVjp(config=config)
            name = (
                "heuristic (lclm's call)"
                if config is None
                else (
                    f"q {config.block_q_dkv}, kv {config.block_kv_dkv}, stages "
                    f"{config.num_stages}, warpgroups {config.compute_wgs}"
                )
            )
            try:
                f = (
                    lclms
                    if config is None
                    else jax.jit(
                        lambda lse, o, do, q, k, v, vjp=vjp, kwargs=kwargs: vjp(
                            (lse, jnp.ones_like(lse)), o, do, q, k, v, **kwargs
                        )
                    )
                )
                t = _median_s(f, lse, o, do, q, k, v)
                cells = f"{t * 1e3:.2f} | {flops / t / 1e12:.0f}"
            except Exception as e:  # noqa: BLE001  (e.g. a tile config over shared memory: its row says so)
                cells = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]} | -"
            row(f"| {hd} | {hq}/{hkv} | {name} | {cells} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.tokamax_configs", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--out", required=True, help="the .md file rows are appended to")
    args = ap.parse_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    return run_cli(lambda: run(args.out, args.seq))


if __name__ == "__main__":
    sys.exit(main())

"""Training-step throughput: tokens/s, MFU and peak memory of one full train step.

    python -m bench.train_step --config configs/llama1b.py --seq 8192,32768
    python -m bench.train_step --config configs/demo.py --seq 512 --layouts striped,contiguous

Synthetic tokens (one document per row), the real model, ring attention, optimizer and
shardings of the config. MFU counts causal attention as half the square (see
`lclm.train.metrics.flops_per_token`); on a CPU there is no peak to divide by, and the table
says so: CPU numbers are not a performance result.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

from bench.report import emit_table


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--seq", default="", help="comma-separated sequence lengths")
    ap.add_argument("--layouts", default="", help="comma-separated layouts (default: config's)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps after 2 warm-up steps")
    ap.add_argument("--set", nargs="*", default=[], help="config overrides a.b=value")
    ap.add_argument("--out", default="", help="also write the table to this file")
    args = ap.parse_args(argv)

    from lclm.config import load_config, mesh_device_count, parse_overrides
    from lclm.parallel.devices import request_cpu_devices

    base = load_config(args.config, parse_overrides(args.set))
    request_cpu_devices(mesh_device_count(base) or 1)

    import jax
    import numpy as np

    from lclm.config import validate
    from lclm.data.loader import batch_sharding
    from lclm.models.llama import AttentionConfig, LlamaConfig
    from lclm.ops.layout import batch_to_layout
    from lclm.parallel.mesh import make_mesh
    from lclm.train.loop import init_state
    from lclm.train.metrics import flops_per_token, peak_flops
    from lclm.train.step import make_optimizer, make_train_step

    devices = jax.devices()
    kind = devices[0].device_kind
    peak = peak_flops(kind)
    seqs = [int(s) for s in args.seq.split(",")] if args.seq else [base.data.seq_len]
    layouts = args.layouts.split(",") if args.layouts else [base.attention.layout]
    rows = []
    for seq in seqs:
        for layout in layouts:
            config = load_config(args.config, parse_overrides(args.set))
            config.data.seq_len = seq
            config.attention.layout = layout
            sizes = validate(config, len(devices))
            mesh = make_mesh(**sizes, devices=devices)
            model = LlamaConfig.from_config(config.model)
            attention = AttentionConfig.from_config(config.attention)
            optimizer = make_optimizer(config.train)
            state = init_state(model, optimizer, mesh, config.seed)
            b = config.data.batch_size
            rng = np.random.default_rng(0)
            tok = rng.integers(3, model.vocab_size, (b, seq + 1)).astype(np.int32)
            batch = dict(tokens=tok[:, :-1], targets=tok[:, 1:],
                         loss_mask=np.ones((b, seq), np.float32),
                         positions=np.broadcast_to(np.arange(seq, dtype=np.int32), (b, seq)),
                         segment_ids=np.ones((b, seq), np.int32))
            batch = batch_to_layout(batch, layout, sizes["sp"])
            batch = {k: jax.device_put(np.ascontiguousarray(v), batch_sharding(mesh))
                     for k, v in batch.items()}
            step = jax.jit(make_train_step(model, attention, config.train, mesh, optimizer),
                           donate_argnums=0)
            t0 = time.perf_counter()
            state, m = step(state, batch)
            jax.block_until_ready(m)
            compile_s = time.perf_counter() - t0
            state, m = step(state, batch)
            jax.block_until_ready(m)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                state, m = step(state, batch)
                if devices[0].platform == "cpu":  # see sync_each_step in lclm.train.loop
                    jax.block_until_ready(m)
            jax.block_until_ready(m)
            dt = (time.perf_counter() - t0) / args.steps
            tokens = b * seq
            flops = flops_per_token(model, seq) * tokens
            stats = devices[0].memory_stats() or {}
            peak_mem = stats.get("peak_bytes_in_use")
            rows.append((seq, layout, f"{sizes}", f"{dt * 1e3:,.1f}", f"{tokens / dt:,.0f}",
                         f"{100 * flops / dt / (peak * len(devices)):.1f}%" if peak else "n/a",
                         f"{peak_mem / 2**30:.1f}" if peak_mem else "n/a",
                         f"{compile_s:.1f}", f"{float(m['loss']):.3f}"))
            del state, step, batch

    emit_table(
        f"Train step: {os.path.basename(args.config)} "
        f"({LlamaConfig.from_config(base.model).param_count() / 1e6:,.1f}M params)",
        [f"device: {len(devices)} x {kind} ({devices[0].platform}); jax {jax.__version__}; "
         f"{datetime.date.today().isoformat()}" + ("" if peak else "; CPU: NOT a performance result"),
         f"MFU counts causal attention as half the square; {args.steps} timed steps after "
         "2 warm-up steps; synthetic tokens."],
        ["seq", "layout", "mesh", "step ms", "tokens/s", "MFU", "peak GiB", "compile s", "loss"],
        rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

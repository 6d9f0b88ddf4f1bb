"""Checkpoint save time: the blocking part (training resumes after it) vs the whole save.

    python -m bench.checkpoint_save [--models demo,llama3_1b] [--dir DIR] [--keep]

Saves a train state sharded fsdp=8 over simulated CPU devices, through lclm's Orbax
`Checkpoints`, to the given directory's disk: the demo's full state (params + AdamW moments +
step), and for presets (e.g. the 1B shape) float32 parameters + step only, since on a CPU the
"device" arrays, their host copy and the writer's buffers all live in this machine's 24 GB
(the full 1B state is 15 GB). The checkpoints (8.6 GB for the 1B shape) are deleted once
measured unless `--keep`; `--dir` picks the disk (default: a new directory under the system's
temporary directory).
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import sys
import tempfile
import time

from bench import ROOT
from bench.report import emit_table
from lclm.cli import run_cli
from lclm.files import check_output


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="demo,llama3_1b")
    ap.add_argument("--dir", default="", help="where to save (default: a new temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints written")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    return run_cli(lambda: _run(args))


def _run(args) -> int:
    # before the saves, not after them (the table is written last)
    if args.dir:
        check_output("--dir", args.dir)
    if args.out:
        check_output("--out", args.out, folder=False)
    from lclm.parallel.devices import request_cpu_devices
    request_cpu_devices(8)
    import jax

    from lclm.checkpoint import Checkpoints
    from lclm.config import LlamaConfig, apply_preset, load_config
    from lclm.config.secrets import public_config
    from lclm.models.llama import param_count
    from lclm.parallel.mesh import make_mesh
    from lclm.train.state import init_state
    from lclm.train.step import make_optimizer

    mesh = make_mesh(fsdp=8)
    directory = args.dir or tempfile.mkdtemp(prefix="lclm_ckpt_bench_")
    rows = []
    for name in args.models.split(","):
        config = load_config(os.path.join(ROOT, "configs", "demo.py"))
        params_only = name != "demo"
        if params_only:
            apply_preset(config, name)
        model = LlamaConfig.from_config(config.model)
        state = init_state(model, make_optimizer(config.train), mesh, seed=0)
        if params_only:
            state = state._replace(opt_state={})
        jax.block_until_ready(state)
        nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
        workdir = os.path.join(directory, name)
        shutil.rmtree(workdir, ignore_errors=True)
        ckpt = Checkpoints(workdir, every=1, keep=2)
        try:
            for step in (1, 2):  # the first save also pays one-time set-up; report the second
                t0 = time.perf_counter()
                ckpt.save(step, state, {"batches": step}, public_config(config))
                blocking = time.perf_counter() - t0
                ckpt.manager.wait_until_finished()
                total = time.perf_counter() - t0
        finally:
            ckpt.close()
            if not args.keep:
                shutil.rmtree(workdir, ignore_errors=True)
        rows.append((name, f"{param_count(model) / 1e6:,.1f}M",
                     "params" if params_only else "params + AdamW",
                     f"{nbytes / 1e9:.2f}", f"{blocking:.2f}", f"{total:.2f}",
                     f"{nbytes / 1e9 / total:.2f}"))
        del state
    emit_table(
        "Checkpoint save time (Orbax async, fsdp=8 simulated CPU devices)",
        [f"disk: {directory}; jax {jax.__version__}; {os.cpu_count()} cores; "
         f"{datetime.date.today().isoformat()}; second save of the run shown"],
        ["model", "params", "saved", "state GB", "blocking s", "total s", "GB/s"], rows,
        args.out)
    if not args.keep and not args.dir:
        shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

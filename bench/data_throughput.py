"""Data pipeline throughput on this machine: tokens/s of the loader's producer (one thread,
i.e. one core) for on-the-fly tokenize+pack+stripe and for streaming a pre-tokenised corpus.

    python -m bench.data_throughput [--seq 8192] [--batches 40] [--gcs]

`--gcs` also streams the pre-tokenised corpus from a bucket on a local GCS server
(bench.gcs_server: an emulator on this machine, so the row measures the ranged requests'
client path and round trips, not a real bucket's latency).

Uses the bundled demo corpus (text) and conversations (ShareGPT), the real `HostBatches`
(sources, mixture, packer, host striping for sp=4, global arrays on 8 simulated devices).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time

from bench import ROOT
from bench.gcs_server import GcsServer
from bench.report import emit_table
from lclm import storage
from lclm.cli import run_cli
from lclm.config.run_config import run_config
from lclm.writes import check_output


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--gcs", action="store_true",
                    help="also read the pre-tokenised corpus from a bucket on a local GCS server")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    return run_cli(lambda: _run(args))


def _run(args) -> int:
    if args.out:  # before the measuring, not after it (the table is written last)
        check_output("--out", args.out, folder=False)
    # started before JAX's threads exist (the server process is forked)
    server = GcsServer() if args.gcs else None
    try:
        return _measure_and_report(args, server)
    finally:
        if server is not None:
            server.stop()


def _measure_and_report(args, server: GcsServer | None) -> int:
    from lclm.parallel.devices import request_cpu_devices
    request_cpu_devices(8)
    import jax

    from lclm.data.tokenizer import Tokenizer
    from lclm.parallel.mesh import make_mesh

    demo = os.path.join(ROOT, "data", "demo")
    tokenizer_path = os.path.join(demo, "tokenizer.model")
    tok = Tokenizer(tokenizer_path)
    mesh = make_mesh(fsdp=2, sp=4)
    # the prepared copies live only as long as the measurement (nothing left in /tmp)
    if server is not None:
        os.environ.update(server.env)
    with tempfile.TemporaryDirectory() as tmp:
        bucket = server.bucket() if server is not None else None
        rows, prepare_s = _measure(args, demo, tokenizer_path, tok, mesh, tmp, bucket)
    emit_table(
        "Data pipeline throughput (producer thread = 1 core)",
        [f"device: host CPU ({os.cpu_count()} cores); jax {jax.__version__}; "
         f"{datetime.date.today().isoformat()}; rows of {args.seq} tokens, batch {args.batch}, "
         f"striped for sp=4; pre-tokenising both demo sources took {prepare_s:.2f} s; "
         f"1-minute load average at the end {os.getloadavg()[0]:.1f} (CPU seconds close to the "
         "wall seconds: the loop had a core to itself)"],
        ["path", "tokens", "seconds", "CPU seconds", "tokens/s per core"], rows, args.out)
    return 0


def _measure(args, demo, tokenizer_path, tok, mesh, tmp, bucket):
    """(table rows, seconds to pre-tokenise locally) of each case, prepared copies under
    `tmp` (and uploaded to `bucket`, a gs:// URL, where one is given)."""
    from lclm.config import load_config
    from lclm.data.loader import HostBatches
    from lclm.data.prepare import prepare

    t0 = time.perf_counter()
    prepare("text", os.path.join(demo, "corpus.jsonl"), tokenizer_path, os.path.join(tmp, "text"))
    prepare("sharegpt", os.path.join(demo, "sharegpt.jsonl"), tokenizer_path,
            os.path.join(tmp, "chat"))
    prepare_s = time.perf_counter() - t0
    cases = {
        "tokenize+pack+stripe (text 0.8 + sharegpt 0.2)":
            f"{demo}/corpus.jsonl@0.8,sharegpt:{demo}/sharegpt.jsonl@0.2",
        "pre-tokenised memmap (same mixture)":
            f"tokenized:{tmp}/text@0.8,tokenized:{tmp}/chat@0.2",
    }
    if bucket is not None:
        for name in ("text", "chat"):
            storage.upload(os.path.join(tmp, name), f"{bucket}/{name}")
        cases["pre-tokenised, ranged reads from a local GCS server (same mixture)"] = (
            f"tokenized:{bucket}/text@0.8,tokenized:{bucket}/chat@0.2")
    rows = []
    for name, path in cases.items():
        config = load_config(os.path.join(ROOT, "configs", "demo.py"))
        config.data.update(path=path, seq_len=args.seq, batch_size=args.batch)
        # no prefetch thread: time the producer's own work synchronously (= one core)
        loader = HostBatches(run_config(config), mesh, tok, prefetch=0)
        loader.next_host_batch()  # warm-up: file reading / opening happened in the constructor
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(args.batches):
            loader.next_host_batch()
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        tokens = args.batches * args.batch * args.seq
        rows.append((name, f"{tokens:,}", f"{dt:.2f}", f"{cpu:.2f}", f"{tokens / dt:,.0f}"))
    return rows, prepare_s


if __name__ == "__main__":
    sys.exit(main())

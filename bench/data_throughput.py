"""Data pipeline throughput on this machine: the loader (`HostBatches`: sources, mixture,
packer, host striping for sp=4, global arrays on 8 simulated devices) tokenising on the fly
and streaming a pre-tokenised copy of the same sources, beside the tokenizer alone on the
very texts the loader encoded, in the same run.

    python -m bench.data_throughput [--seq 8192] [--batches 40] [--cores N] [--code] [--gcs]

Default: the bundled demo corpus (text) and conversations (ShareGPT) with the demo
tokenizer. `--code`: configs/smollm2_64k.py's mixture, `code:STDLIB@0.75?min_tokens=16k,
code:STDLIB@0.25?max_tokens=8k`, with `--tokenizer` (default: the real model's,
checkpoints/smollm2-135m). `--cores N` runs the whole process on N of its cores (its CPU
affinity, which the loader's reading threads and the tokenizer's own threads follow).

Columns: wall and CPU seconds (all threads) of `--batches` batches built one after another
with nothing else to do (the loader's throughput), tokens per second of each, the loader's
tokens per CPU-second over the tokenizer's alone on the texts the loader encoded (recorded as
it encodes them: whole documents and pieces, including those of documents a length option
then left out; then each encoded again one a call, on one core: so the loader's wall rate
with N cores approaches that fraction of N x the tokenizer's rate where the work spreads
over the cores; a row also gives the tokenizer alone on random documents of the source,
whose mix of short and long files differs from what the length options draw), and the
longest that a training loop waited for a batch when it takes `--batches` of them one step
apart, a step being the time that `--host-rate` tokens/s (default 272K: 8 H100s at 34K
tokens/s each) takes for a batch (the loader's background thread and reading ahead as in
training). `--gcs` also streams the pre-tokenised
copy from a bucket on a local GCS server (bench.gcs_server: an emulator on this machine, so
the row measures the ranged requests' client path and round trips, not a real bucket's).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import os
import sys
import sysconfig
import tempfile
import threading
import time

from bench import ROOT
from bench.gcs_server import GcsServer
from bench.report import emit_table, target_row, write_targets
from lclm import storage
from lclm.cli import run_cli
from lclm.config.run_config import run_config
from lclm.writes import check_output

# 8 H100s at 34K tokens/s each (issue 77): what one host's loader must feed
HOST_RATE = 272_000


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--cores", type=int, default=0, help="run on this many cores (0: all)")
    ap.add_argument(
        "--code",
        action="store_true",
        help="the 64K config's code:STDLIB mixture instead of the demo's",
    )
    ap.add_argument(
        "--tokenizer",
        default=os.path.join(ROOT, "checkpoints", "smollm2-135m"),
        help="with --code: the tokenizer (default: the real model's)",
    )
    ap.add_argument(
        "--host-rate",
        type=float,
        default=HOST_RATE,
        help="tokens/s the training loop takes (sets the step of the wait column)",
    )
    ap.add_argument(
        "--gcs",
        action="store_true",
        help="also read the pre-tokenised corpus from a bucket on a local GCS server",
    )
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    return run_cli(lambda: _run(args))


@dataclasses.dataclass(frozen=True)
class LoaderSpec:
    """The suite's loader part: configs/smollm2_64k.py's code mixture with SmolLM2's
    tokenizer, `batches` batches of `batch` rows at each length of `rows` ((seq, batches))."""

    rows: tuple[tuple[int, int], ...] = ((8192, 40), (65536, 8))
    batch: int = 8
    host_rate: float = HOST_RATE

    def smallest(self) -> LoaderSpec:
        return dataclasses.replace(self, rows=((8192, 10),))

    def quick(self) -> LoaderSpec:
        return self


# issue 77: the loader at 0.85 of the tokenizer alone (per CPU-second), no wait over a tenth of
# a step, pre-tokenised data at twice a host's need on one core
LOADER_TARGET, WAIT_TARGET, PREPARED_TARGET = 0.85, 0.1, 2.0


def run(spec: LoaderSpec, out_dir: str, toy: bool = False) -> str:
    """The suite's part: `data_throughput.md` (a table per row length) and its targets."""
    path = os.path.join(out_dir, "data_throughput.md")
    texts, targets = [], []
    for seq, batches in spec.rows:
        args = argparse.Namespace(
            seq=seq,
            batch=spec.batch,
            batches=batches,
            cores=0,
            code=True,
            tokenizer=os.path.join(ROOT, "checkpoints", "smollm2-135m"),
            host_rate=spec.host_rate,
            gcs=False,
            out="",
        )
        figures: dict[str, dict] = {}
        texts.append(_measure_and_report(args, None, figures))
        targets += _targets(seq, figures, spec.host_rate)
    with open(path, "w") as f:
        f.write("\n\n".join(texts) + "\n")
    write_targets(out_dir, "data_throughput", targets)
    return path


def _targets(seq: int, figures: dict[str, dict], host_rate: float) -> list[dict]:
    loader, prepared = figures["loader"], figures["prepared"]
    k = f"{seq // 1024}K rows"
    per_cpu = loader["tokens"] / loader["cpu"]
    ratio = per_cpu / loader["alone"]
    wait = loader["wait"] / loader["step"]
    rate = prepared["tokens"] / prepared["cpu"]
    return [
        target_row(
            "loader",
            f"tokens per CPU-second, tokenising, {k}",
            f"{per_cpu:,.0f}",
            f"{loader['alone']:,.0f} (tokenizer alone)",
            ratio,
            at_least=LOADER_TARGET,
        ),
        target_row(
            "loader",
            f"longest wait for a batch, {k} (s)",
            f"{loader['wait']:.3f}",
            f"{loader['step']:.3f} (a step at {host_rate:,.0f} tokens/s)",
            wait,
            at_most=WAIT_TARGET,
        ),
        target_row(
            "loader",
            f"tokens per CPU-second, pre-tokenised, {k}",
            f"{rate:,.0f}",
            f"{host_rate:,.0f} (a host of 8 H100s)",
            rate / host_rate,
            at_least=PREPARED_TARGET,
        ),
    ]


def _run(args) -> int:
    if args.out:  # before the measuring, not after it (the table is written last)
        check_output("--out", args.out, folder=False)
    if args.cores:  # before any thread exists: every later one inherits it
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: args.cores])
    # started before JAX's threads exist (the server process is forked)
    server = GcsServer() if args.gcs else None
    try:
        _measure_and_report(args, server, {})
        return 0
    finally:
        if server is not None:
            server.stop()


def _sources(args) -> tuple[str, str, list[tuple[str, str]]]:
    """(tokenizer path, mixture on the fly, [(kind, path) to pre-tokenise, into <tmp>/<i>])."""
    if args.code:
        stdlib = sysconfig.get_paths()["stdlib"]
        return (
            args.tokenizer,
            f"code:{stdlib}@0.75?min_tokens=16k,code:{stdlib}@0.25?max_tokens=8k",
            [("code", stdlib)],
        )
    demo = os.path.join(ROOT, "data", "demo")
    return (
        os.path.join(demo, "tokenizer.model"),
        f"{demo}/corpus.jsonl@0.8,sharegpt:{demo}/sharegpt.jsonl@0.2",
        [("text", f"{demo}/corpus.jsonl"), ("sharegpt", f"{demo}/sharegpt.jsonl")],
    )


def _short(mixture: str) -> str:
    """`mixture` with the stdlib's and the demo folder's paths named, not spelled out."""
    demo = os.path.join(ROOT, "data", "demo")
    return mixture.replace(sysconfig.get_paths()["stdlib"], "STDLIB").replace(demo, "demo")


def _prepared_mixture(args, root: str) -> str:
    """The on-the-fly mixture's entries read from the pre-tokenised copies under `root`."""
    if args.code:
        return f"tokenized:{root}/0@0.75?min_tokens=16k,tokenized:{root}/0@0.25?max_tokens=8k"
    return f"tokenized:{root}/0@0.8,tokenized:{root}/1@0.2"


def _measure_and_report(args, server: GcsServer | None, figures: dict[str, dict]) -> str:
    """The table's text (also printed, and written to `args.out` where given); `figures`
    gets the numbers of the loader ("loader") and of the pre-tokenised copy ("prepared")."""
    from lclm.parallel.devices import request_cpu_devices

    request_cpu_devices(8)
    import jax

    from lclm.data.ahead import cores
    from lclm.parallel.mesh import make_mesh

    mesh = make_mesh(fsdp=2, sp=4)
    if server is not None:
        os.environ.update(server.env)
    # the prepared copies live only as long as the measurement (nothing left in /tmp)
    with tempfile.TemporaryDirectory() as tmp:
        bucket = server.bucket() if server is not None else None
        rows, prepare_s, what = _measure(args, mesh, tmp, bucket, figures)
    step = args.batch * args.seq / args.host_rate
    load = os.getloadavg()[0]
    return emit_table(
        f"Data pipeline throughput, rows of {args.seq:,} tokens",
        [
            f"device: host CPU, {cores()} of {os.cpu_count()} cores given; jax {jax.__version__}; "
            f"{datetime.date.today().isoformat()}; {what}; rows of {args.seq} tokens, batch "
            f"{args.batch}, striped for sp=4; pre-tokenising took {prepare_s:.1f} s; a step of "
            f"{step:.3f} s ({args.host_rate:,.0f} tokens/s) for the wait column; 1-minute load "
            f"average at the end {load:.1f}"
            + (
                " (above the cores given: other work shared them, and wall rates are lower "
                "than the machine alone would give)"
                if load > cores()
                else ""
            )
        ],
        [
            "path",
            "tokens",
            "seconds",
            "CPU seconds",
            "tokens/s",
            "tokens per CPU-s",
            "per CPU-s vs tokenizer alone",
            "longest wait (s)",
        ],
        rows,
        args.out,
    )


def _tokenizer_alone(tok, docs_texts: list[str]) -> tuple[int, float, float]:
    """(tokens, wall s, CPU s) of the tokenizer alone on `docs_texts`, one text a call."""
    t0, c0 = time.perf_counter(), time.process_time()
    tokens = sum(len(ids) for text in docs_texts for ids in tok.encode_batch([text]))
    return tokens, time.perf_counter() - t0, time.process_time() - c0


def _alone_row(name: str, tokens: int, wall: float, cpu: float) -> tuple:
    return (
        name,
        f"{tokens:,}",
        f"{wall:.2f}",
        f"{cpu:.2f}",
        f"{tokens / wall:,.0f}",
        f"{tokens / cpu:,.0f}",
        "",
        "",
    )


def _texts(kind: str, path: str, chars: int) -> list[str]:
    """About `chars` characters of a source's documents' texts, in a shuffled order."""
    import numpy as np

    from lclm.data.code import CodeRecords
    from lclm.data.records import Records, read_records, text_problem
    from lclm.data.stats import SourceStats

    records: CodeRecords | Records
    if kind == "code":
        records = CodeRecords(path, False, SourceStats())
    else:
        records = read_records(
            path, "text", lambda r: text_problem(r, "text"), ("text",), SourceStats()
        )
    texts, total = [], 0
    for i in np.random.default_rng(0).permutation(len(records)):
        record = records[int(i)]
        if record is not None and total < chars:
            texts.append(record["text"])
            total += len(record["text"])
    return texts


class _Counted:
    """Counts the ids a tokenizer gives (on any thread), whole documents or pieces of them:
    what the loader tokenised, beside what its rows hold. `_Counted(tok)` counts `tok`'s
    calls from then on."""

    def __init__(self, tok):
        self.tokens, self._lock = 0, threading.Lock()
        self.texts: list[str] = []  # what was encoded, whole texts or pieces, in call order
        for name in ("encode", "encode_batch"):  # neither calls the other
            setattr(tok, name, self._counting(getattr(tok, name)))

    def restart(self) -> None:
        with self._lock:
            self.tokens, self.texts = 0, []

    def _counting(self, encode):
        def counted(text):
            ids = encode(text)
            n = sum(map(len, ids)) if isinstance(text, list) else len(ids)
            with self._lock:
                self.tokens += n
                self.texts += text if isinstance(text, list) else [text]
            return ids

        return counted


def _loader_rows(args, config, mesh, tok, name: str, tokenising: bool) -> tuple[list[tuple], dict]:
    """(the table rows of one mixture: with `tokenising`, the tokenizer alone on the very
    texts the loader encoded; the loader's throughput, then the waits of a training loop;
    its figures)."""
    import numpy as np

    from lclm.data.loader import HostBatches

    counting = copy.copy(tok)  # its encode calls counted, not those of the other cases' loaders
    counted = _Counted(counting)
    loader = HostBatches(run_config(config), mesh, counting, prefetch=0)
    try:
        loader.next_host_batch()  # warm-up: file reading / opening happened in the constructor
        counted.restart()  # (reads under way now count: about as many at the end)
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(args.batches):
            loader.next_host_batch()
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        read, texts = counted.tokens, counted.texts
    finally:
        loader.close()
    rows, alone = [], 0.0
    if tokenising:  # the reference: the same texts (the same mix of long and short files)
        same, wall_same, cpu_same = _tokenizer_alone(tok, texts)
        alone = same / cpu_same
        rows.append(
            _alone_row(
                f"tokenizer alone (the {len(texts):,} texts the loader encoded)",
                same,
                wall_same,
                cpu_same,
            )
        )
    step = args.batch * args.seq / args.host_rate
    loader = HostBatches(run_config(config), mesh, counting, prefetch=2)
    waits = []
    try:
        next(loader)  # the first batch comes before the first step's compile: not a wait
        for _ in range(args.batches):
            time.sleep(step)
            t = time.perf_counter()
            next(loader)
            waits.append(time.perf_counter() - t)
    finally:
        loader.close()
    tokens = args.batches * args.batch * args.seq
    ratio = (
        f"{tokens / cpu / alone:.2f} ({read / cpu / alone:.2f} of the {read:,} tokens tokenised)"
        if alone
        else ""
    )
    figures = dict(
        tokens=tokens, wall=dt, cpu=cpu, read=read, alone=alone, wait=max(waits), step=step
    )
    return rows + [
        (
            name,
            f"{tokens:,}",
            f"{dt:.2f}",
            f"{cpu:.2f}",
            f"{tokens / dt:,.0f}",
            f"{tokens / cpu:,.0f}",
            ratio,
            f"{max(waits):.3f} (median {np.median(waits):.3f})",
        )
    ], figures


def _measure(args, mesh, tmp, bucket, figures: dict[str, dict]):
    """(table rows, seconds to pre-tokenise locally, what was read) of each case, prepared
    copies under `tmp` (and uploaded to `bucket`, a gs:// URL, where one is given); `figures`
    gets the numbers of the first two cases ("loader", "prepared")."""
    from lclm.config import load_config
    from lclm.data.prepare import prepare
    from lclm.data.tokenizer import Tokenizer

    tokenizer_path, mixture, to_prepare = _sources(args)
    tok = Tokenizer(tokenizer_path)
    texts = _texts(*to_prepare[0], chars=3 << 20 if args.code else 1 << 20)
    rows = [
        _alone_row(
            f"tokenizer alone ({len(texts)} random {to_prepare[0][0]} documents, one a call)",
            *_tokenizer_alone(tok, texts),
        )
    ]
    t0 = time.perf_counter()
    for i, (kind, path) in enumerate(to_prepare):
        prepare(kind, path, tokenizer_path, os.path.join(tmp, str(i)))
    prepare_s = time.perf_counter() - t0
    cases = {
        f"tokenize+pack+stripe ({_short(mixture)})": mixture,
        "pre-tokenised memmap (same mixture)": _prepared_mixture(args, tmp),
    }
    if bucket is not None:
        for i in range(len(to_prepare)):
            storage.upload(os.path.join(tmp, str(i)), f"{bucket}/{i}")
        cases["pre-tokenised, ranged reads from a local GCS server (same mixture)"] = (
            _prepared_mixture(args, bucket)
        )
    for case, (name, path) in zip(("loader", "prepared", "bucket"), cases.items()):
        config = load_config(os.path.join(ROOT, "configs", "demo.py"))
        config.data.update(
            path=path, seq_len=args.seq, batch_size=args.batch, tokenizer=tokenizer_path
        )
        config.model.vocab_size = max(config.model.vocab_size, tok.vocab_size)
        found, figures[case] = _loader_rows(args, config, mesh, tok, name, case == "loader")
        rows += found
    what = (
        f"tokenizer {os.path.relpath(tokenizer_path, ROOT)}; the tokenizer alone on "
        f"{len(texts)} documents of the first source"
    )
    return rows, prepare_s, what


if __name__ == "__main__":
    sys.exit(main())

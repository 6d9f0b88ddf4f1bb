"""Balanced batches (data.balance): attention work per device before and after balancing, on a
real length mix, for several meshes, row lengths and layouts. Host arithmetic only (no device
is used, nothing is timed): the work is the exact count of `lclm.data.balance`.

    python -m bench.balance [--seqs 65536,32768] [--meshes 8x1,4x2,2x4] [--layouts
        striped,contiguous] [--rows 4] [--accums 1,2] [--steps 16] [--out FILE]

The mix: the Python standard library on this machine (`sysconfig.get_paths()['stdlib']`),
each package directory one document (its .py files concatenated in path order, each headed by
its path), each top-level module a document of its own; third-party site-packages left out.
Lengths are token counts of data/demo/tokenizer.model. As the loader does, each of a step's
rows is its own slot reading every batch-th document of a shuffled order (a new shuffle each
epoch), packed by `lclm.data.packing.Packer`.

A mesh `BxS` is B batch shards (dp x fsdp) of S sequence shards (sp); a step holds `--rows`
rows per batch shard, in `accum` micro-batches. The imbalance of a step is its attention time
over the ideal, `lclm.data.balance.imbalance`: micro-batches run one after another, each as
slow as its busiest device. Per configuration the table gives it over all steps together
(sum of the steps' busiest-device work / sum of their mean work) in the loader's order
(`before`) and balanced (`after`), and the same for a whole LLaMA-2-7B-shaped step (the
attention pairs plus the per-token linear work, which is the same on every device).
"""

from __future__ import annotations

import argparse
import datetime
import glob
import os
import platform
import sys
import sysconfig

import numpy as np

from bench import ROOT, int_list
from bench.report import Table
from lclm.cli import run_cli
from lclm.data.balance import attention_work, balance_permutation, bin_loads
from lclm.data.packing import Packer
from lclm.data.tokenizer import Tokenizer
from lclm.writes import check_output

TOKENIZER = os.path.join(ROOT, "data", "demo", "tokenizer.model")
# LLaMA-2-7B: a (query, key) pair costs 4 d FLOPs (QK^T and PV), a token 2 (4 d^2 + 3 d f) in
# the projections and FFN, per layer, forward (the backward multiplies both by about 2)
DIM, FFN = 4096, 11008
PAIR_PER_TOKEN = 4 * DIM / (2 * (4 * DIM**2 + 3 * DIM * FFN))


def stdlib_documents() -> list[tuple[str, str]]:
    """(name, text) of every document of the mix, in name order."""
    root = sysconfig.get_paths()["stdlib"]

    def read(path: str) -> str:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f"# {os.path.relpath(path, root)}\n{f.read()}"

    docs = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if name in ("site-packages", "dist-packages"):  # installed packages, not the library
            continue
        if os.path.isdir(path):
            files = sorted(glob.glob(os.path.join(path, "**", "*.py"), recursive=True))
            if files:
                docs.append((name, "".join(read(f) for f in files)))
        elif name.endswith(".py"):
            docs.append((name, read(path)))
    return docs


def step_segments(lengths: np.ndarray, seq: int, batch: int, steps: int, seed: int = 0):
    """`steps` arrays `[batch, seq]` of segment ids: row r of every step from slot r's packer,
    which reads documents r, r + batch, ... of each epoch's shuffle."""

    def slot(r: int):
        packer, epoch = Packer(seq), 0
        while True:
            order = np.random.default_rng([seed, epoch]).permutation(len(lengths))
            for doc in order[r::batch]:
                packer.add(np.zeros(lengths[doc], np.int32), np.ones(lengths[doc], np.int8))
                while (row := packer.pop_row()) is not None:
                    yield row["segment_ids"]
            epoch += 1

    slots = [slot(r) for r in range(batch)]
    return [np.stack([next(s) for s in slots]) for _ in range(steps)]


def _ratio(loads: list[np.ndarray]) -> float:
    """Sum over steps of the busiest device per micro-batch over the sum of the mean."""
    return sum(float(x.max(axis=1).sum()) for x in loads) / sum(
        float(x.mean(axis=1).sum()) for x in loads
    )


def measure(steps: list[np.ndarray], layout: str, shards: int, sp: int, accum: int):
    """(attention before, after, 7B step before, after) over `steps` (rows in loader order)."""
    seq = steps[0].shape[1]
    loads: dict[str, list[np.ndarray]] = {
        k: [] for k in ("before", "after", "7b before", "7b after")
    }
    for segments in steps:
        work = attention_work(segments, layout, sp)
        order = balance_permutation(work, shards, accum)
        for name, w in (("before", work), ("after", work[order])):
            pairs = bin_loads(w, shards, accum).reshape(accum, -1).astype(np.float64)
            loads[name].append(pairs)
            # every device holds rows / (shards x accum) rows of seq / sp tokens per micro-batch
            tokens = steps[0].shape[0] // (shards * accum) * seq / sp
            loads[f"7b {name}"].append(pairs * PAIR_PER_TOKEN + tokens)
    return tuple(_ratio(loads[k]) for k in ("before", "after", "7b before", "7b after"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int_list, default=(65536, 32768))
    ap.add_argument(
        "--meshes", default="8x1,4x2,2x4", help="batch shards x sp size, comma-separated"
    )
    ap.add_argument("--layouts", default="striped,contiguous")
    ap.add_argument("--rows", type=int, default=4, help="rows per batch shard per step")
    ap.add_argument("--accums", type=int_list, default=(1, 2), help="micro-batches per step")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--out", default="", help="also write the report here (markdown)")
    args = ap.parse_args(argv)
    return run_cli(lambda: _run(args, argv if argv is not None else sys.argv[1:]))


def _run(args, argv) -> int:
    if args.out:
        check_output("--out", args.out, folder=False)
    meshes = [tuple(int(x) for x in m.split("x")) for m in args.meshes.split(",")]
    layout_names = args.layouts.split(",")
    names, texts = zip(*stdlib_documents())
    lengths = np.array([len(t) for t in Tokenizer(TOKENIZER).encode_batch(list(texts))])
    notes = [
        f"`python -m bench.balance {' '.join(argv)}`".replace("  ", " "),
        "",
        *_mix_notes(names, lengths, args.seqs),
        "",
        f"Host arithmetic (no device, nothing timed); Python {platform.python_version()}, "
        f"{datetime.date.today().isoformat()}.",
        "",
        f"{args.steps} steps per row length and mesh, {args.rows} rows per batch shard "
        "per step. Imbalance = (sum over steps and micro-batches of the busiest device's "
        "work) / (the same of the mean device's work): 1.00 is perfect balance. "
        f"'7B step': attention plus the linear work of LLaMA-2-7B (d {DIM}, ffn {FFN}: a "
        f"pair costs {PAIR_PER_TOKEN:.2e} of a token's projections and FFN).",
    ]
    table = Table(
        "Balanced batches: attention work per device, max / mean",
        notes,
        [
            "seq",
            "mesh (batch x sp)",
            "layout",
            "grad_accum",
            "attention before",
            "attention after",
            "7B step before",
            "7B step after",
        ],
        args.out,
    )
    for seq in args.seqs:
        for shards, sp in meshes:
            steps = step_segments(lengths, seq, shards * args.rows, args.steps)
            # with one sequence shard every layout is the same
            for layout in layout_names if sp > 1 else [layout_names[0]]:
                for accum in args.accums:
                    ratios = measure(steps, layout, shards, sp, accum)
                    table.add(
                        (
                            f"{seq:,}",
                            f"{shards} x {sp}",
                            layout if sp > 1 else "any",
                            accum,
                            *(f"{r:.2f}" for r in ratios),
                        )
                    )
    return 0


def _mix_notes(names, lengths: np.ndarray, seqs) -> list[str]:
    big = np.argsort(-lengths)[:3]
    lines = [
        f"Mix: {len(lengths)} documents from {sysconfig.get_paths()['stdlib']}, "
        f"{lengths.sum():,} tokens (demo tokenizer); median {int(np.median(lengths)):,}, "
        "largest " + ", ".join(f"{names[i]} {lengths[i]:,}" for i in big) + "."
    ]
    for seq in seqs:
        share = lengths[lengths >= seq].sum() / lengths.sum()
        lines.append(f"Tokens in documents of >= {seq:,} tokens: {100 * share:.0f}%.")
    return lines


if __name__ == "__main__":
    sys.exit(main())

"""The benchmark suite in one command.

    python -m bench --suite gpu-quick [--out DIR]
    python -m bench --suite gpu [--out DIR] [--parts attention,striped,...]
    python -m bench --suite cpu [--smallest]

Parts (each writes `<part>.md`, most a `<part>.png` too, into the output folder, stamped with
device, JAX version and date; `index.md` lists them with their wall time). The output folder
is `--out`, by default a new `bench_results/<suite>-<YYYYmmdd-HHMMSS>` in the current directory
(untracked); the committed reference results in bench/results/<suite> change only when `--out`
names them.

- `correctness`: every usable kernel's forward and backward against a float32 dense reference
  on this device (bench/correctness.py); a wrong kernel fails the part;
- `attention`: forward and forward+backward TFLOP/s of every usable kernel, cuDNN, the official
  ringattention package, and each one's ratio to cuDNN (bench/attention.py);
- `striped`: striped, zigzag and contiguous ring, simulated on one device (bench/striped_sim.py);
- `train`: train-step tokens/s, MFU, peak memory of LLaMA 1B/3B/7B shapes, and the ratio to the
  plain single-device cuDNN step of bench/baseline.py (bench/train_step.py);
- `max_context`: longest trainable sequence, lclm vs dense baselines (bench/max_context.py).

`--suite gpu-quick` is the first command on a lent GPU: correctness, the fused kernel vs cuDNN
at 8K and 32K blocks (head dims 128 and 64), and the train-step table at 8K and 32K for the
LLaMA-3.2-1B and Striped Attention 1B shapes with the baseline. `--suite gpu` runs the real
sizes on the local accelerator (expect an hour or more on one
H100; `--parts` runs a subset), each part in its own process so that no part holds device
memory another needs. `--suite cpu` runs every part at toy sizes on the CPU in a few minutes:
its numbers check the machinery and are not a performance result (the reports say so).
`--smallest` cuts every part to its first size (the smoke test).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time
import traceback

from bench import ROOT
from bench.attention import AttentionSpec
from bench.correctness import CorrectnessSpec
from bench.max_context import ONE_DEVICE, MaxContextSpec
from bench.report import default_out_dir
from bench.striped_sim import StripedSpec
from bench.train_step import ModelRun, TrainSpec
from lclm import logs
from lclm.errors import StartupError

# part (also the Suite's field name) -> its module in bench/, which writes <module>.md/.png
PARTS = {"correctness": "correctness", "attention": "attention", "striped": "striped_sim",
         "train": "train_step", "max_context": "max_context"}
# the demo's shapes cut down further: a 2-layer, 64-wide LLaMA with small tiles (config
# overrides are command-line arguments, as for train.py)
TINY_MODEL = ("--config.model.n_layers=2", "--config.model.dim=64", "--config.model.n_heads=4",
              "--config.model.n_kv_heads=2", "--config.model.ffn_dim=192",
              "--config.model.ffn_chunk=64", "--config.model.loss_chunk=64",
              "--config.attention.q_chunk=64", "--config.attention.kv_chunk=64")


@dataclasses.dataclass(frozen=True)
class Suite:
    """The sizes of every part the suite runs (None: not in this suite), and how parts run."""
    toy: bool               # labelled "not a performance result"
    separate_parts: bool    # one process per part (device memory is not shared between parts)
    correctness: CorrectnessSpec | None = None
    attention: AttentionSpec | None = None
    striped: StripedSpec | None = None
    train: TrainSpec | None = None
    max_context: MaxContextSpec | None = None

    def parts(self) -> list[str]:
        return [p for p in PARTS if getattr(self, p) is not None]

    def smallest(self) -> "Suite":
        return dataclasses.replace(self, **{p: getattr(self, p).smallest() for p in self.parts()})


SUITES = {
    "gpu": Suite(
        correctness=CorrectnessSpec(),
        attention=AttentionSpec(),
        striped=StripedSpec(),
        train=TrainSpec(models=(
            ModelRun("configs/llama1b.py", (8192, 16384, 32768, 65536, 131072), ONE_DEVICE),
            ModelRun("configs/striped_attention_1b.py", (8192, 16384, 32768, 65536, 131072),
                     ONE_DEVICE),
            ModelRun("configs/llama3b.py", (8192, 32768, 65536, 131072), ONE_DEVICE),
            ModelRun("configs/llama7b_256k.py", (8192, 32768),
                     (*ONE_DEVICE, "--config.data.batch_size=1",
                      "--config.model.param_dtype=bfloat16"),
                     note="one device, batch 1, bfloat16 parameters and AdamW moments "
                          "(float32 ones alone need 108 GB)"),
        ), steps=3, warmup=1),
        # a probe near the limit runs one step at ~1M tokens: minutes, not seconds
        max_context=MaxContextSpec(start=8192, cap=2 ** 21, resolution=32768, timeout=3600),
        toy=False, separate_parts=True),
    # the first run on a lent GPU, under 8 minutes by design (not yet timed on one): kernels
    # right there, the fused kernel against cuDNN at 8K/32K blocks, and lclm's step against
    # the plain cuDNN step (bench.baseline) on both 1B shapes of issue 14
    "gpu-quick": Suite(
        correctness=CorrectnessSpec(),
        attention=AttentionSpec(blocks=(8192, 32768), heads=(16,), head_dims=(128, 64),
                                impls=("tokamax_gpu", "pallas_gpu"), warmup=1, iters=3),
        train=TrainSpec(models=(
            ModelRun("configs/llama1b.py", (8192, 32768), ONE_DEVICE),
            ModelRun("configs/striped_attention_1b.py", (8192, 32768), ONE_DEVICE),
        ), impls=("auto",), steps=3, warmup=1, isolate=True, timeout=240),
        toy=False, separate_parts=True),
    "cpu": Suite(
        correctness=CorrectnessSpec().smallest(),
        attention=AttentionSpec(blocks=(128, 256, 512), heads=(2, 4), q_chunk=64, kv_chunk=64,
                                warmup=1, iters=3),
        striped=StripedSpec(ns=(2, 4), blocks=(128, 256, 512), heads=2, q_chunk=32,
                            kv_chunk=32, warmup=1, iters=3),
        train=TrainSpec(models=(ModelRun("configs/demo.py", (256, 512),
                                         (*ONE_DEVICE, *TINY_MODEL)),),
                        impls=("blockwise",), steps=2, warmup=1, isolate=False),
        max_context=MaxContextSpec(config="configs/demo.py", overrides=TINY_MODEL,
                                   variants=("lclm", "vanilla"), impl="blockwise", start=512,
                                   cap=1024, resolution=512, budget_mib=256, timeout=600),
        toy=True, separate_parts=False),
}


def run_part(part: str, suite: Suite, out_dir: str) -> str:
    """Run one part in this process; returns its report's path."""
    import importlib

    from bench.isolate import launcher_process

    spec = getattr(suite, part)
    if part == "max_context" or (part == "train" and spec.isolate):
        launcher_process()  # children measure; this process must not reserve device memory
    module = importlib.import_module(f"bench.{PARTS[part]}")
    return module.run(spec, out_dir, toy=suite.toy)


def _part_in_child(part: str, args) -> str:
    """Run one part as `python -m bench ... --parts <part>` and wait (output streams through)."""
    from bench.isolate import child_env

    argv = [sys.executable, "-m", "bench", "--suite", args.suite, "--parts", part,
            "--out", args.out, "--in-process"] + (["--smallest"] if args.smallest else [])
    rc = subprocess.call(argv, env=child_env(), cwd=ROOT)
    return "ok" if rc == 0 else f"failed (exit {rc})"


def _device_line(out_dir: str, parts) -> str:
    """The stamp's device line, read back from the first report that was written."""
    for part in parts:
        path = os.path.join(out_dir, f"{PARTS[part]}.md")
        if os.path.isfile(path):
            with open(path) as f:
                for line in f:
                    if line.startswith("device:"):
                        return line.strip()
    return "device: unknown (no report written)"


def write_index(out_dir: str, suite_name: str, suite: Suite, done: list[tuple]) -> str:
    """`index.md`: the stamp and one row per part (report, plot, status, wall time)."""
    from bench.report import TOY_NOTE, emit_table

    notes = [_device_line(out_dir, [d[0] for d in done])]
    if suite.toy:
        notes.append(TOY_NOTE)
    plot = lambda part: (f"[{PARTS[part]}.png]({PARTS[part]}.png)"
                         if os.path.isfile(os.path.join(out_dir, f"{PARTS[part]}.png")) else "-")
    rows = [(part, f"[{PARTS[part]}.md]({PARTS[part]}.md)", plot(part), status,
             f"{seconds:,.0f}") for part, status, seconds in done]
    path = os.path.join(out_dir, "index.md")
    emit_table(f"Benchmark suite '{suite_name}'", notes,
               ["part", "report", "plot", "status", "seconds"], rows, path)
    return path


def _parts(text: str, suite: Suite) -> list[str]:
    parts = [p for p in text.split(",") if p] or suite.parts()
    unknown = sorted(set(parts) - set(suite.parts()))
    if unknown:
        raise StartupError(f"unknown parts {unknown} for this suite; choose from "
                           f"{suite.parts()}")
    return parts


def _out_dir(path: str) -> str:
    """The output folder, created now: an unusable one fails before an hour of measuring."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise StartupError(f"--out {path!r}: {e.strerror}; pass a writable folder") from None
    return os.path.abspath(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    ap.add_argument("--suite", choices=sorted(SUITES), required=True)
    ap.add_argument("--parts", default="", help=f"some of {','.join(PARTS)} (default: all "
                    "of the suite's)")
    ap.add_argument("--out", default="",
                    help="output folder (default: a new ./bench_results/<suite>-<YYYYmmdd-HHMMSS>, "
                         "untracked; the committed reference results are bench/results/<suite>: "
                         "name that folder to update them)")
    ap.add_argument("--smallest", action="store_true", help="first size of every part only")
    ap.add_argument("--in-process", action="store_true",
                    help="run the parts in this process (what a part's own process does)")
    logs.configure()
    args = ap.parse_args(argv)
    try:
        parts = _parts(args.parts, SUITES[args.suite])
        args.out = _out_dir(args.out or default_out_dir(args.suite))
    except StartupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    suite = SUITES[args.suite].smallest() if args.smallest else SUITES[args.suite]
    if args.suite == "cpu":  # toy sizes are meant for the CPU even where an accelerator exists
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        from lclm.parallel.devices import request_cpu_devices
        request_cpu_devices(1)  # only lclm's safe CPU compiler flags (before JAX starts)
    separate = suite.separate_parts and not args.in_process
    done = []
    for part in parts:
        t0 = time.perf_counter()
        if separate:
            status = _part_in_child(part, args)
        else:
            try:
                run_part(part, suite, args.out)
                status = "ok"
            except Exception as e:  # noqa: BLE001  (report the part as failed, run the others)
                traceback.print_exc()
                status = f"failed: {type(e).__name__}"
        done.append((part, status, time.perf_counter() - t0))
    if not args.in_process or len(parts) > 1:
        write_index(args.out, args.suite, suite, done)
        print(f"results: {args.out}")
    return 0 if all(status == "ok" for _, status, _ in done) else 1


if __name__ == "__main__":
    sys.exit(main())

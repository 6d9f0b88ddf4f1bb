"""The benchmark suite in one command.

    python -m bench --suite gpu-quick [--out DIR] [--parts correctness,attention,train]
    python -m bench --suite gpu-quick --compile-only [h100:1]   # no GPU: compile, run nothing
    python -m bench --suite gpu-lease --out DIR    # gpu-quick cut to one 10-minute command
    python -m bench --suite gpu [--out DIR] [--parts attention,striped,...]
    python -m bench --suite cpu [--smallest]
    python -m bench --suite host [--parts loader,checkpoint,compile]   # what a GPU run waits on

Parts (each writes `<part>.md`, most a `<part>.png` too, into the output folder, stamped with
device, JAX version and date; `index.md` lists them with their wall time). The output folder
is `--out`, by default a new `bench_results/<suite>-<YYYYmmdd-HHMMSS>` in the current directory
(untracked); the committed reference results in bench/results/<suite> change only when `--out`
names them. The folder is checked before anything runs (every part's own `--out` too): one that
could not be written, or a `gs://` path, is one line and exit status 2.

- `correctness`: every usable kernel's forward and backward against a float32 dense reference
  on this device (bench/correctness.py); a wrong kernel fails the part;
- `attention`: forward and forward+backward TFLOP/s of every usable kernel, cuDNN, the official
  ringattention package, and each one's ratio to cuDNN (bench/attention.py);
- `striped`: striped, zigzag and contiguous ring, simulated on one device (bench/striped_sim.py);
- `train`: train-step tokens/s, MFU, peak memory of LLaMA 1B/3B/7B shapes, and the ratio to the
  plain single-device cuDNN step of bench/baseline.py, timed with no remat, `dots` and full
  remat, the fastest that fits being the baseline (bench/train_step.py);
- `max_context`: longest trainable sequence, lclm vs dense baselines (bench/max_context.py).

Nothing measured is lost to a kill: every part writes each row to its `.md` file (and stdout,
flushed) the moment it is measured, the table before any plot, and a plot that fails is logged
and skipped. `--suite gpu` and `--suite gpu-quick` need a GPU: elsewhere they say so in one
line and exit 2.

`--compile-only [TARGET]` compiles every program of the correctness, attention and train
parts for described GPUs (default h100:1; the [gpu-aot] extra, no GPU) and runs none
(bench/compile_only.py): the check to run before GPU time is spent.

`--suite gpu-quick` is the first command on a lent GPU: each part at its quick size
(`<Spec>.quick()`, also `python -m bench.<part> --quick`), designed to finish in under 8
minutes on one H100, and cut there by a time budget (rows not started within it are marked
skipped; a part is killed after 9 minutes at the latest): `correctness` (every usable kernel,
every case, head dims 64 and 128), `attention` (causal 8K and 32K blocks, 16 heads of 128 and
64: tokamax_gpu and pallas_gpu vs cuDNN) and `train` (LLaMA-3.2-1B at 8K and 32K: the kernel
`auto` picks vs the baseline); `--parts striped` or `--parts max_context` runs the other two
parts' quick sizes. Every part runs in a process of its own, so a part that is killed costs
only itself; on a machine with a per-command time limit (10 minutes) give each part its own
command, into one folder:

    python -m bench --suite gpu-quick --parts correctness --out DIR
    python -m bench --suite gpu-quick --parts attention --out DIR
    python -m bench --suite gpu-quick --parts train --out DIR

(`index.md` lists the parts of every command into that folder). `--suite gpu` runs the real
sizes on the local accelerator (expect an hour or more on one H100; `--parts` runs a subset),
each part in its own process so that no part holds device memory another needs. `--suite cpu`
runs every part at toy sizes on the CPU in a few minutes: its numbers check the machinery and
are not a performance result (the reports say so). `--smallest` cuts every part to its first
size (the smoke test).

`--suite host` measures on this machine's CPUs what a GPU run waits on, each against a
reference measured in the same run, and judges each figure by its target (issue 77) in
`index.md`'s last table: `loader` (bench/data_throughput.py: the loader tokenising SmolLM2's
code mixture at 8K and 64K rows against the tokenizer alone, waits against a step of 8 H100s,
the pre-tokenised copy against a host's need), `checkpoint` (bench/checkpoint_save.py:
SmolLM2's state saved and restored against `dd` and a numpy read of the same bytes, with the
extra host memory) and `compile` (bench/compile_speed.py: LLaMA-3.2-1B's 8K step compiled for
an H100 without a GPU against the plain step, and the bytes each moves). The compile part needs
the [gpu-aot] extra (Python 3.12: the kernels `auto` picks on Hopper); the first two need the
real model (docs/checkpoints.md).

Outside the suites (host arithmetic, no device): `python -m bench.balance` measures
data.balance, the attention work per device before and after balancing a step's rows, on the
Python standard library's length mix (bench/results/balance.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
import time
import traceback

from bench import ROOT
from bench.attention import AttentionSpec
from bench.checkpoint_save import CheckpointSpec
from bench.compile_speed import CompileSpec
from bench.correctness import CorrectnessSpec
from bench.data_throughput import LoaderSpec
from bench.max_context import ONE_DEVICE, MaxContextSpec
from bench.report import default_out_dir
from bench.striped_sim import StripedSpec
from bench.train_step import ModelRun, TrainSpec
from lclm import logs
from lclm.cli import run_cli
from lclm.errors import StartupError
from lclm.writes import check_output

# part (also the Suite's field name) -> its module in bench/, which writes <module>.md/.png
PARTS = {
    "correctness": "correctness",
    "attention": "attention",
    "striped": "striped_sim",
    "train": "train_step",
    "max_context": "max_context",
    "loader": "data_throughput",
    "checkpoint": "checkpoint_save",
    "compile": "compile_speed",
}
# the demo's shapes cut down further: a 2-layer, 64-wide LLaMA with small tiles (config
# overrides are command-line arguments, as for train.py)
TINY_MODEL = (
    "--config.model.n_layers=2",
    "--config.model.dim=64",
    "--config.model.n_heads=4",
    "--config.model.n_kv_heads=2",
    "--config.model.ffn_dim=192",
    "--config.model.ffn_chunk=64",
    "--config.model.loss_chunk=64",
    "--config.attention.q_chunk=64",
    "--config.attention.kv_chunk=64",
)


@dataclasses.dataclass(frozen=True)
class Suite:
    """The sizes of every part the suite runs (None: not in this suite), and how parts run."""

    toy: bool  # labelled "not a performance result"
    separate_parts: bool  # one process per part (device memory is not shared between parts)
    correctness: CorrectnessSpec | None = None
    attention: AttentionSpec | None = None
    striped: StripedSpec | None = None
    train: TrainSpec | None = None
    max_context: MaxContextSpec | None = None
    loader: LoaderSpec | None = None
    checkpoint: CheckpointSpec | None = None
    compile: CompileSpec | None = None
    needs_gpu: bool = False
    default_parts: tuple[str, ...] | None = None  # run without --parts (None: all)
    # seconds before a separate part's process is killed: one for every part, or per part
    part_timeout: float | dict[str, float] | None = None

    def timeout(self, part: str) -> float | None:
        """Seconds before `part`'s own process is killed (None: never)."""
        if isinstance(self.part_timeout, dict):
            return self.part_timeout.get(part)
        return self.part_timeout

    def parts(self) -> list[str]:
        """Every part the suite can run (`--parts` picks among them)."""
        return [p for p in PARTS if getattr(self, p) is not None]

    def defaults(self) -> list[str]:
        """The parts run when `--parts` is not given."""
        return [p for p in self.parts() if self.default_parts is None or p in self.default_parts]

    def smallest(self) -> Suite:
        return dataclasses.replace(self, **{p: getattr(self, p).smallest() for p in self.parts()})

    def quick(self, default_parts=None, part_timeout: float = 540.0) -> Suite:
        """Every part at its quick size (each designed for under 8 minutes on one H100)."""
        return dataclasses.replace(
            self,
            default_parts=default_parts,
            part_timeout=part_timeout,
            **{p: getattr(self, p).quick() for p in self.parts()},
        )


GPU_TRAIN = TrainSpec(
    models=(
        ModelRun("configs/llama1b.py", (8192, 16384, 32768, 65536, 131072), ONE_DEVICE),
        ModelRun(
            "configs/striped_attention_1b.py", (8192, 16384, 32768, 65536, 131072), ONE_DEVICE
        ),
        ModelRun("configs/llama3b.py", (8192, 32768, 65536, 131072), ONE_DEVICE),
        ModelRun(
            "configs/llama7b_256k.py",
            (8192, 32768),
            (*ONE_DEVICE, "--config.data.batch_size=1", "--config.model.param_dtype=bfloat16"),
            note="one device, batch 1, bfloat16 parameters and AdamW moments "
            "(float32 ones alone need 108 GB)",
        ),
    ),
    steps=3,
    warmup=1,
)
GPU = Suite(
    correctness=CorrectnessSpec(),
    attention=AttentionSpec(),
    striped=StripedSpec(),
    train=GPU_TRAIN,
    # a probe near the limit runs one step at ~1M tokens: minutes, not seconds
    max_context=MaxContextSpec(start=8192, cap=2**21, resolution=32768, timeout=3600),
    toy=False,
    separate_parts=True,
    needs_gpu=True,
)

SUITES = {
    "gpu": GPU,
    # what a GPU run waits on, measured on this host's CPUs against references taken in the
    # same run (issue 77): the loader against the tokenizer alone, checkpoint saves and
    # restores against dd and a numpy read, the step's compile for an H100 against the
    # plain step's; each part in its own process (5 min 40 s on 2 cores: bench/results/host)
    "host": Suite(
        loader=LoaderSpec(),
        checkpoint=CheckpointSpec(),
        compile=CompileSpec(),
        toy=False,
        separate_parts=True,
    ),
    # the first call of a 15-minute lease (one command of at most 10 minutes, ~9.3 with the
    # install and the GPU probe): the fused kernels auto picks on Hopper (cudnn_gpu's whole-
    # sequence call, tokamax_gpu in ring rounds) against the float32 reference at both head
    # dims, tokamax_gpu against cuDNN at 8K/32K, and LLaMA-3.2-1B's step
    # at 8K/32K against the fastest plain cuDNN step; every part cut by a budget and a kill
    "gpu-lease": dataclasses.replace(
        GPU.quick(),
        correctness=dataclasses.replace(
            CorrectnessSpec().quick(), impls=("cudnn_gpu", "tokamax_gpu"), budget_s=90.0
        ),
        attention=dataclasses.replace(
            AttentionSpec().quick(), impls=("tokamax_gpu",), budget_s=90.0
        ),
        train=dataclasses.replace(GPU_TRAIN.quick(), budget_s=170.0, timeout=200.0),
        default_parts=("correctness", "attention", "train"),
        part_timeout={
            "correctness": 130.0,
            "attention": 130.0,
            "train": 270.0,
            "striped": 270.0,
            "max_context": 270.0,
        },
    ),
    # the first run on a lent GPU: every part at its quick size (under 8 minutes each on one
    # H100 by design, cut by a budget; not yet timed on one), by default the kernels' correctness
    # there, the fused kernels against cuDNN at 8K/32K blocks, and lclm's step against the
    # fastest plain cuDNN step (bench.baseline) on LLaMA-3.2-1B at 8K and 32K
    "gpu-quick": GPU.quick(default_parts=("correctness", "attention", "train")),
    "cpu": Suite(
        correctness=CorrectnessSpec().smallest(),
        attention=AttentionSpec(
            blocks=(128, 256, 512), heads=(2, 4), q_chunk=64, kv_chunk=64, warmup=1, iters=3
        ),
        striped=StripedSpec(
            ns=(2, 4), blocks=(128, 256, 512), heads=2, q_chunk=32, kv_chunk=32, warmup=1, iters=3
        ),
        train=TrainSpec(
            models=(ModelRun("configs/demo.py", (256, 512), (*ONE_DEVICE, *TINY_MODEL)),),
            impls=("blockwise",),
            steps=2,
            warmup=1,
            isolate=False,
        ),
        max_context=MaxContextSpec(
            config="configs/demo.py",
            overrides=TINY_MODEL,
            variants=("lclm", "vanilla"),
            impl="blockwise",
            start=512,
            cap=1024,
            resolution=512,
            budget_mib=256,
            timeout=600,
        ),
        toy=True,
        separate_parts=False,
    ),
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


GPU_CHECKED = "LCLM_BENCH_GPU_CHECKED"  # set for a suite's part processes: checked once


def _part_in_child(part: str, args, timeout: float | None) -> str:
    """Run one part as `python -m bench ... --parts <part> --in-process` in a process group of
    its own and wait (output streams through); after `timeout` seconds the group (the part
    and any children it started) is killed, and what the part wrote so far stays."""
    from bench.isolate import child_env

    argv = [
        sys.executable,
        "-m",
        "bench",
        "--suite",
        args.suite,
        "--parts",
        part,
        "--out",
        args.out,
        "--in-process",
    ] + (["--smallest"] if args.smallest else [])
    env = dict(child_env(), **{GPU_CHECKED: "1"})
    proc = subprocess.Popen(argv, env=env, cwd=ROOT, start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return f"killed after {timeout:g} s (rows measured so far are in its report)"
    except BaseException:  # Ctrl-C: the part runs in its own session and would go on
        _kill_group(proc)
        raise
    return "ok" if rc == 0 else f"failed (exit {rc})"


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def gpu_missing() -> str | None:
    """Why no GPU suite can run here (a few words), or None where JAX's backend is a GPU.

    Asked of a short child process, so that this process (the launcher of the parts) never
    holds GPU memory."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and not {"cuda", "gpu", "rocm"} & set(platforms.lower().split(",")):
        return f"JAX_PLATFORMS={platforms}"
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    try:
        probe = subprocess.run(
            [sys.executable, "-c", "import jax; print(jax.default_backend())"],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return "JAX did not start within 300 s"
    backend = (probe.stdout.strip().splitlines() or ["unknown (JAX failed to start)"])[-1]
    return None if backend == "gpu" else f"JAX's default backend here is {backend}"


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
    """`index.md`: the stamp and one row per part (report, plot, status, wall time), the
    parts of earlier commands into the same folder included (kept in `index.json`), so that
    one command per part still gives one index."""
    import json

    from bench.report import TARGETS_HEADER, TOY_NOTE, emit_table, read_targets

    record = os.path.join(out_dir, "index.json")
    try:
        with open(record) as f:
            earlier = {part: tuple(v) for part, v in json.load(f).items() if part in PARTS}
    except (OSError, ValueError, TypeError):
        earlier = {}
    parts = dict(earlier, **{part: (status, seconds) for part, status, seconds in done})
    with open(record, "w") as f:
        json.dump(parts, f)
    done = [(part, *parts[part]) for part in PARTS if part in parts]
    notes = [_device_line(out_dir, [d[0] for d in done])]
    if suite.toy:
        notes.append(TOY_NOTE)
    plot = lambda part: (
        f"[{PARTS[part]}.png]({PARTS[part]}.png)"
        if os.path.isfile(os.path.join(out_dir, f"{PARTS[part]}.png"))
        else "-"
    )
    rows = [
        (part, f"[{PARTS[part]}.md]({PARTS[part]}.md)", plot(part), status, f"{seconds:,.0f}")
        for part, status, seconds in done
    ]
    path = os.path.join(out_dir, "index.md")
    emit_table(
        f"Benchmark suite '{suite_name}'",
        notes,
        ["part", "report", "plot", "status", "seconds"],
        rows,
        path,
    )
    targets = read_targets(out_dir, [PARTS[part] for part, *_ in done])
    if targets:  # the parts' judged figures, each beside its reference from the same run
        with open(path, "a") as f:
            f.write("\n" + emit_table("Against the targets", [], TARGETS_HEADER, targets))
    return path


def _parts(text: str, suite: Suite) -> list[str]:
    parts = [p for p in text.split(",") if p] or suite.defaults()
    unknown = sorted(set(parts) - set(suite.parts()))
    if unknown:
        raise StartupError(f"unknown parts {unknown} for this suite; choose from {suite.parts()}")
    return parts


def _out_dir(path: str) -> str:
    """The output folder (checked by `_run` already), created now, before the first part."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise StartupError(f"--out {path!r}: {e.strerror}; pass a writable folder") from None
    return os.path.abspath(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    ap.add_argument("--suite", choices=sorted(SUITES), required=True)
    ap.add_argument(
        "--parts",
        default="",
        help=f"some of {','.join(PARTS)} (default: the "
        "suite's; gpu-quick: correctness,attention,train)",
    )
    ap.add_argument(
        "--out",
        default="",
        help="output folder (default: a new ./bench_results/<suite>-<YYYYmmdd-HHMMSS>, "
        "untracked; the committed reference results are bench/results/<suite>: "
        "name that folder to update them)",
    )
    ap.add_argument("--smallest", action="store_true", help="first size of every part only")
    ap.add_argument(
        "--compile-only",
        nargs="?",
        const="h100:1",
        default=None,
        metavar="TARGET",
        help="compile every program of the parts for described GPUs (default "
        "h100:1; needs the [gpu-aot] extra, no GPU) and run none "
        "(bench/compile_only.py)",
    )
    ap.add_argument(
        "--in-process",
        action="store_true",
        help="run the parts in this process (what a part's own process does)",
    )
    logs.configure()
    args = ap.parse_args(argv)
    return run_cli(lambda: _run(args))


def _compile_only(args, parts: list[str]) -> int:
    """`--compile-only`: the parts' programs compiled for described GPUs, none run."""
    from bench import compile_only

    if not SUITES[args.suite].needs_gpu:
        raise StartupError(
            "--compile-only compiles a GPU suite's programs: use it with "
            "--suite gpu-quick or --suite gpu"
        )
    unsupported = [p for p in parts if p not in compile_only.PARTS]
    if unsupported:
        raise StartupError(
            f"--compile-only lists the programs of {', '.join(compile_only.PARTS)}"
            f", not {', '.join(unsupported)}; choose --parts among those"
        )
    suite = SUITES[args.suite].smallest() if args.smallest else SUITES[args.suite]
    args.out = _out_dir(args.out)
    return 1 if compile_only.run(suite, parts, args.compile_only, args.out) else 0


def _run(args) -> int:
    parts = _parts(args.parts, SUITES[args.suite])
    args.out = args.out or default_out_dir(args.suite)
    check_output("--out", args.out)  # before the GPU probe (up to 300 s) and an hour of parts
    if args.compile_only:
        return _compile_only(args, parts)
    if SUITES[args.suite].needs_gpu and not os.environ.get(GPU_CHECKED):
        why = gpu_missing()
        if why:
            raise StartupError(
                f"--suite {args.suite} needs a GPU, and {why}; on this machine run --suite cpu"
            )
    args.out = _out_dir(args.out)
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
            print(
                f"== part {part}: python -m bench --suite {args.suite} --parts {part} "
                f"--out {args.out}",
                flush=True,
            )
            status = _part_in_child(part, args, suite.timeout(part))
            print(f"== part {part}: {status} ({time.perf_counter() - t0:,.0f} s)", flush=True)
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

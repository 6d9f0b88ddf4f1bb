"""Throughput accounting (tokens/s, MFU) and metric sinks: console, metrics.jsonl, wandb."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import sys
import time
import uuid
from typing import Any

import jax

from lclm import storage
from lclm.config import ModelConfig
from lclm.config.run_config import RunConfig
from lclm.config.secrets import is_secret, public_config
from lclm.config.syntax import format_tokens
from lclm.models.decoder import param_count
from lclm.writes import replacing

log = logging.getLogger(__name__)


def flops_per_token(c: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 x (non-embedding params + output projection) plus
    attention 6 x layers x seq x heads x head_dim (dim, where head_dim is dim / heads), i.e.
    causal attention counted as half the square."""
    matmul_params = param_count(c, include_embeddings=False)
    if c.tie_embeddings:
        matmul_params += c.vocab_size * c.dim
    return 6.0 * matmul_params + 6.0 * c.n_layers * seq_len * c.n_heads * c.head_dim


def truncate_metrics(path: str, last_step: int) -> int:
    """Keep only the records of `path` up to `last_step` (the step a resumed run restarts
    after), so every step appears once. Unreadable lines go too, whatever their bytes (a line
    cut short by a crash, a torn block of a network filesystem: not UTF-8, not JSON), counted
    in one warning. The file is replaced atomically. Returns how many lines were dropped."""
    if not os.path.isfile(path):
        return 0
    kept: list[bytes] = []
    later = unreadable = 0
    with open(path, "rb") as f:  # bytes: a damaged line must not stop the reading
        for line in f:
            step = _step_of(line)
            if step is None:
                unreadable += 1
            elif step > last_step:
                later += 1
            else:
                kept.append(line if line.endswith(b"\n") else line + b"\n")
    if unreadable:
        log.warning("%s: dropped %d unreadable line(s) (cut short or damaged)", path, unreadable)
    if later or unreadable:
        with replacing(path, binary=True) as out:
            out.writelines(kept)
    return later + unreadable


# On object storage (no append): `<workdir>/metrics/<first step>-<flush>.jsonl`, one object
# per flush, in step order by name; `read_metrics` puts them together
PARTS = "metrics"


def metrics_path(workdir: str) -> str:
    """Where a run in `workdir` writes its metrics: `metrics.jsonl`, or on object storage the
    folder of its parts."""
    return storage.join(workdir, PARTS if storage.is_remote(workdir) else "metrics.jsonl")


def _part_name(first_step: int, flush: int) -> str:
    return f"{first_step:012d}-{flush:06d}.jsonl"


def _part_step(name: str) -> int | None:
    head = name.split("-", 1)[0]
    return int(head) if name.endswith(".jsonl") and head.isdigit() else None


def truncate_metric_parts(directory: str, last_step: int) -> int:
    """`truncate_metrics` for the objects of `directory` (gs://, s3://): parts that begin
    after `last_step` go, and the last part that begins before it loses its later records.
    Earlier parts are left unread (an object is written whole, and each ends before the next
    begins), so a resume reads one part however long the run. Returns the records dropped."""
    parts = sorted(
        (step, name)
        for name in storage.listdir(directory)
        if (step := _part_step(name)) is not None
    )
    dropped = 0
    for step, name in parts:
        if step > last_step:
            path = storage.join(directory, name)
            dropped += len(storage.read_bytes(path).splitlines())
            storage.remove(path)
    before = [name for step, name in parts if step <= last_step]
    if before:
        path = storage.join(directory, before[-1])
        lines = storage.read_bytes(path).splitlines(keepends=True)
        kept = [
            line for line in lines if (step := _step_of(line)) is not None and step <= last_step
        ]
        if len(kept) < len(lines):
            dropped += len(lines) - len(kept)
            storage.write_bytes(path, b"".join(kept))
    return dropped


def _step_of(line: bytes) -> int | None:
    """A metrics line's step; None for a line that cannot be read (any bytes)."""
    try:
        return int(json.loads(line.decode("utf-8"))["step"])
    # UnicodeDecodeError is a ValueError; an infinite step an OverflowError
    except (ValueError, KeyError, IndexError, TypeError, OverflowError, RecursionError):
        return None


def read_metrics(workdir: str) -> list[dict]:
    """The records a run logged in `workdir` (metrics.jsonl, or on object storage its
    parts), in order; unreadable lines are skipped."""
    if storage.is_remote(workdir):
        directory = storage.join(workdir, PARTS)
        names = sorted(n for n in storage.listdir(directory) if _part_step(n) is not None)
        lines = [
            line
            for n in names
            for line in storage.read_bytes(storage.join(directory, n)).splitlines()
        ]
    else:
        path = os.path.join(workdir, "metrics.jsonl")
        lines = storage.read_bytes(path).splitlines() if os.path.isfile(path) else []
    records = []
    for line in lines:
        try:
            records.append(json.loads(line.decode("utf-8")))
        except ValueError:
            continue
    return records


class MetricsFailed(RuntimeError):
    """metrics.jsonl could not be written; the records are held back for the next try."""


class MetricsLogger:
    """Writes one JSON object per logged step to `<workdir>/metrics.jsonl` (on object
    storage: one object per flush in `<workdir>/metrics/`), and to wandb.

    `resume_step`: the step the run restarts after; records past it (from a run that crashed
    after its last checkpoint) are dropped before the re-run steps are logged. A write that
    fails (a full disk, a storage hiccup) leaves the file as it was and raises `MetricsFailed`;
    its records are held in memory and written with the next `log`, `flush` or `close`
    (`lclm.train.step_faults` decides how long to keep trying: the run's `WritePatience`).
    """

    def __init__(self, workdir: str, wandb_run=None, resume_step: int = 0):
        self._remote = storage.is_remote(workdir)
        self._flushes = 0
        self._fd: int | None = None
        self.path = metrics_path(workdir)
        if self._remote:
            truncate_metric_parts(self.path, resume_step)
        else:
            os.makedirs(workdir, exist_ok=True)
            truncate_metrics(self.path, resume_step)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._held: list[str] = []  # lines not yet written
        self._wandb = wandb_run

    def log(self, record: dict, write: bool = True) -> None:
        """`record` to wandb and to the records held; with `write`, those are written now
        (`MetricsFailed`: they stay held)."""
        clean = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in record.items()
        }
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in clean.items() if k != "step"}, step=record["step"])
        self._held.append(json.dumps(clean) + "\n")
        if write:
            self.flush()

    def flush(self) -> None:
        """Write the records held back; `MetricsFailed` (the file as it was) if that fails."""
        if not self._held:
            return
        data = "".join(self._held).encode()
        if self._fd is None:
            self._flush_object(data)
        else:
            self._append(self._fd, data)
        self._held.clear()

    def _flush_object(self, data: bytes) -> None:
        """One object for the held records, named by their first step and this flush: a
        retried write replaces its own object, never another's."""
        name = _part_name(json.loads(self._held[0])["step"], self._flushes)
        try:
            # one try's wait for a silent store, not the client's tries of it: the loop waits
            storage.write_bytes(storage.join(self.path, name), data, within=storage.REQUEST_SECONDS)
        except Exception as e:  # noqa: BLE001  (each client has its own error types)
            raise MetricsFailed(
                f"{self.path}: could not write {len(self._held)} record(s) "
                f"({storage.error_text(e)})"
            ) from None
        self._flushes += 1

    def _append(self, fd: int, data: bytes) -> None:
        size = os.fstat(fd).st_size
        try:
            while data:
                data = data[os.write(fd, data) :]
        except OSError as e:
            # a cut line would glue onto the next record: drop what part of it was written
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise MetricsFailed(
                f"{self.path}: could not write {len(self._held)} record(s) ({e.strerror or e})"
            ) from None

    def outputs(self) -> list[str]:
        """Where the metrics went, for the run's summary."""
        lines = [f"metrics: {self.path}"]
        if self._wandb is not None:
            lines.append(f"wandb: run {self._wandb.id} ({self._wandb.url or self._wandb.dir})")
        return lines

    def held(self) -> list[str]:
        """The JSON lines not written yet."""
        return list(self._held)

    def close(self, write: bool = True) -> None:
        """Write what is held back (`MetricsFailed` if that still fails; without `write`, it
        is raised at once) and close."""
        try:
            if not write and self._held:
                raise MetricsFailed(f"{self.path}: {len(self._held)} record(s) not written")
            self.flush()
        finally:
            if self._fd is not None:
                os.close(self._fd)
            if self._wandb is not None:
                self._wandb.finish()


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return (
        f"{seconds // 3600}h{seconds // 60 % 60:02d}m"
        if seconds >= 3600
        else f"{seconds // 60}m{seconds % 60:02d}s"
    )


class Progress:
    """The console of a run (process 0): "compiling" until the first step is done, then a
    tqdm bar (steps/s, ETA from compiled steps only, loss, lr, tokens/s) on a terminal, or
    one plain line per logged step elsewhere (CI, SLURM logs); a summary at the end."""

    def __init__(self, total_steps: int, first_step: int, stream=sys.stdout):
        self.total, self.first, self.stream = total_steps, first_step, stream
        self.terminal = hasattr(stream, "isatty") and stream.isatty()
        self.start = time.perf_counter()
        self.bar = None
        self.compiled_at: tuple[float, int] | None = None  # (time, step) of the first step run
        print(
            f"compiling the training step (step {first_step} of {total_steps})...",
            file=stream,
            flush=True,
        )

    def step_done(self, step: int) -> None:
        """Called after every step (cheap: no device values)."""
        if self.compiled_at is None:
            self.compiled_at = (time.perf_counter(), step)
            print(
                f"compiled and ran step {step} in {_duration(self.compiled_at[0] - self.start)}",
                file=self.stream,
                flush=True,
            )
            if self.terminal:
                from tqdm import tqdm

                # a pseudo-terminal may report a 0 x 0 screen, on which tqdm hides its bar;
                # shutil falls back to 80 x 24 there
                columns, lines = shutil.get_terminal_size()
                self.bar = tqdm(
                    total=self.total,
                    initial=step,
                    file=self.stream,
                    unit="step",
                    ncols=columns,
                    nrows=lines,
                    smoothing=0.1,
                )
        elif self.bar is not None:
            self.bar.update(step - self.bar.n)

    def update(self, record: dict) -> None:
        """A logged step's metrics."""
        fields = {
            "loss": f"{record['loss']:.4f}" if record["loss"] is not None else "nan",
            "lr": f"{record['lr']:.2e}",
            "tok/s": f"{record['tokens_per_sec']:,.0f}",
        }
        if record.get("val_loss") is not None:
            fields["val"] = f"{record['val_loss']:.4f}"
        for key, value in record.items():  # val_loss@LEN of validation.lengths
            if key.startswith("val_loss@"):
                fields[f"val@{format_tokens(int(key[9:]))}"] = f"{value:.4f}"
        if record.get("mfu") is not None:
            fields["MFU"] = f"{100 * record['mfu']:.1f}%"
        if record.get("skipped_steps"):
            fields["skipped"] = str(record["skipped_steps"])
        # what held the steps back, where it is worth a look: a share of the step time
        for key, label in (("data_wait_time", "data wait"), ("save_block_time", "save")):
            share = (record.get(key) or 0.0) / max(record.get("step_time") or 0.0, 1e-9)
            if share >= 0.01:
                fields[label] = f"{100 * share:.0f}%"
        if self.bar is not None:
            self.bar.set_postfix(fields, refresh=True)
            return
        step = record["step"]
        parts = [f"step {step}/{self.total}"] + [f"{k} {v}" for k, v in fields.items()]
        if self.compiled_at is not None and step > self.compiled_at[1]:
            t, s = self.compiled_at
            rate = (step - s) / (time.perf_counter() - t)
            parts.append(f"{rate:.2f} steps/s, ETA {_duration((self.total - step) / rate)}")
        print(" | ".join(parts), file=self.stream, flush=True)

    def close(self, summary: list[str]) -> None:
        if self.bar is not None:
            self.bar.close()
        for line in summary:
            print(line, file=self.stream, flush=True)


def wandb_run(sections: RunConfig, resume_step: int):
    """The wandb run of this workdir: the same run id across resumes (`<workdir>/wandb_id`),
    so a resumed run continues its run instead of starting a second one."""
    if not sections.log.wandb or jax.process_index() != 0:
        return None
    import wandb  # 0.4 s to import: only runs that log to wandb pay it

    # the environment wins; wandb checks its value (log.wandb_mode is checked at start)
    mode: Any = os.environ.get("WANDB_MODE", sections.log.wandb_mode)
    id_path = storage.join(sections.workdir, "wandb_id")
    if storage.isfile(id_path):
        run_id = storage.read_text(id_path).strip()
    else:
        run_id = uuid.uuid4().hex[:16]  # wandb ids: letters and digits
        with replacing(id_path) as f:
            f.write(run_id)
    # wandb records the command line; not when an override on it names a secret
    secret_args = any(
        is_secret(a.split("=")[0].rsplit(".", 1)[-1].lstrip("-")) for a in sys.argv[1:]
    )
    settings = wandb.Settings(x_disable_meta=True) if secret_args else None
    if resume_step:
        log.info(
            "wandb: resuming run %s after step %d (wandb keeps the values it already "
            "has for re-run steps; metrics.jsonl holds the re-run ones)",
            run_id,
            resume_step,
        )
    # wandb keeps its own files in a local folder: its default (./wandb) for a bucket workdir
    local = None if storage.is_remote(sections.workdir) else sections.workdir
    return wandb.init(
        project=sections.log.wandb_project,
        mode=mode,
        dir=local,
        config=public_config(sections),
        id=run_id,
        resume="allow",
        settings=settings,
    )

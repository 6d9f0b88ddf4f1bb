"""Throughput accounting (tokens/s, MFU) and metric sinks: console, metrics.jsonl, wandb."""

from __future__ import annotations

import json
import math
import os
import sys
import time

from lclm.models.llama import LlamaConfig

# Dense bf16 peak FLOP/s per device, by `device_kind` prefix (vendor datasheets).
PEAK_FLOPS = {
    "NVIDIA H200": 989e12, "NVIDIA H100": 989e12, "NVIDIA A100": 312e12,
    "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12,
    "TPU v5": 459e12, "TPU v6 lite": 918e12, "TPU v6e": 918e12,
}


def peak_flops(device_kind: str) -> float | None:
    """Peak FLOP/s of one device, or None when unknown (CPU): MFU is then not reported."""
    for prefix, flops in PEAK_FLOPS.items():
        if device_kind.startswith(prefix):
            return flops
    return None


def flops_per_token(c: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 x (non-embedding params + output projection) plus
    attention 6 x layers x seq x dim, i.e. causal attention counted as half the square."""
    matmul_params = c.param_count(include_embeddings=False)
    if c.tie_embeddings:
        matmul_params += c.vocab_size * c.dim
    return 6.0 * matmul_params + 6.0 * c.n_layers * seq_len * c.dim


def truncate_metrics(path: str, last_step: int) -> int:
    """Keep only the records of `path` up to `last_step` (the step a resumed run restarts
    after), so every step appears once; unreadable lines (a crash mid-write) go too. The file
    is replaced atomically. Returns how many records were dropped."""
    if not os.path.isfile(path):
        return 0
    kept, dropped = [], 0
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
                keep = isinstance(record, dict) and int(record["step"]) <= last_step
            except (ValueError, KeyError, TypeError):
                keep = False
            if keep:
                kept.append(line if line.endswith("\n") else line + "\n")
            else:
                dropped += 1
    if dropped:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, path)
    return dropped


class MetricsLogger:
    """Writes one JSON object per logged step to `<workdir>/metrics.jsonl`, and to wandb.

    `resume_step`: the step the run restarts after; records past it (from a run that crashed
    after its last checkpoint) are dropped before the re-run steps are logged.
    """

    def __init__(self, workdir: str, wandb_run=None, resume_step: int = 0):
        os.makedirs(workdir, exist_ok=True)
        self.path = os.path.join(workdir, "metrics.jsonl")
        truncate_metrics(self.path, resume_step)
        self._file = open(self.path, "a")
        self._wandb = wandb_run

    def log(self, record: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in clean.items() if k != "step"},
                            step=record["step"])

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()


class Progress:
    """One console line per log interval with an ETA (plain text: logs stay readable)."""

    def __init__(self, total_steps: int, stream=sys.stdout):
        self.total = total_steps
        self.start = time.perf_counter()
        self.stream = stream

    def update(self, record: dict, first_step: int) -> None:
        """`record['step']` is 1-based; `first_step` is the first step of this process."""
        step = record["step"]
        elapsed = time.perf_counter() - self.start
        eta = elapsed / max(step - first_step + 1, 1) * (self.total - step)
        mfu = record.get("mfu")
        parts = [f"step {step}/{self.total}", f"loss {record['loss']:.4f}",
                 f"lr {record['lr']:.2e}", f"grad_norm {record['grad_norm']:.3f}",
                 f"{record['tokens_per_sec']:,.0f} tok/s"]
        if mfu is not None:
            parts.append(f"MFU {100 * mfu:.1f}%")
        parts.append(f"ETA {eta:,.0f}s")
        print(" | ".join(parts), file=self.stream, flush=True)

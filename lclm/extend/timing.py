"""How long each part of an extension run is expected to take on its device, before it runs:
from the model's FLOPs (lclm's formula, `flops_per_token`: 6N + 6 x layers x seq x heads x
head_dim per trained token, causal attention counted as half; a forward is a third of it) at
`extension.mfu` of the device's peak, plus `extension.compile_seconds` per program compiled,
the weights' loading and the checkpoint saves; a stage that has trained steps already is
timed by its own measured step time instead. The device is `extension.device` (a chip of
lclm.hardware) or this machine's: an accelerator by its peak, a CPU by a matmul measured here.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp

from lclm.config.model import DTYPE_BYTES, ModelConfig
from lclm.config.run_config import RunConfig
from lclm.config.stages import validation_lengths
from lclm.data.ruler import TASKS as RULER_TASKS
from lclm.errors import ConfigError
from lclm.extend.plan import PASSKEY_NEW_TOKENS, TRAIN, Part
from lclm.hardware import BY_NAME, peak_flops
from lclm.models.decoder import param_count
from lclm.train.metrics import flops_per_token, read_metrics

# measured on this project's machines (docs/evaluation.md): an Orbax save of a train state to
# local disk runs at ~0.12 GB/s, a restore or a safetensors read at ~0.4 GB/s
SAVE_BYTES_PER_SECOND = 0.12e9
LOAD_BYTES_PER_SECOND = 0.4e9
# a decoding step's fixed cost (a launch of every layer, the host's loop), beside its FLOPs
DECODE_STEP_SECONDS = 0.01
# a stage's start before its first step, beside loading and compiling: the loader's statistics
# tokenise up to 200 documents per source (the 64K config's code:STDLIB mixture with SmolLM2's
# tokenizer: 17.6 s on this project's 2-core machine with other work beside it, 52 s before
# they were read on the loader's threads) and the first batches are read
STAGE_START_SECONDS = 30.0


@dataclasses.dataclass(frozen=True)
class Rate:
    flops: float  # FLOP/s the plan assumes for the whole mesh
    how: str  # how it was found, one line


def _cpu_matmul_flops(seconds: float = 1.0) -> float:
    """FLOP/s of this host's float32 matmuls (all its cores), measured for about `seconds`."""
    n = 1024
    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        f(a).block_until_ready()
        runs += 1
    return 2 * n**3 * runs / (time.perf_counter() - start)


def device_rate(sections: RunConfig, devices: int) -> Rate:
    """The FLOP/s the plan assumes on `devices` devices: extension.mfu x their peak."""
    name, mfu = sections.extension.device.strip().lower(), sections.extension.mfu
    if name:
        if name not in BY_NAME:
            raise ConfigError(
                f"extension.device={name!r} is not a chip lclm knows; use one of "
                f"{', '.join(BY_NAME)} (or empty: this machine's)"
            )
        peak, what = BY_NAME[name].peak_flops * devices, f"{devices} x {name}"
    else:
        device = jax.devices()[0]
        found = peak_flops(device.device_kind)
        if found is None:  # simulated CPU devices share the host's cores
            measured = _cpu_matmul_flops()
            return Rate(
                mfu * measured,
                f"this CPU: {measured / 1e9:.0f} GFLOP/s measured (float32 matmul) x mfu {mfu:g}",
            )
        peak, what = found * devices, f"{devices} x {device.device_kind}"
    return Rate(mfu * peak, f"{what}: {peak / 1e12:.0f} TFLOP/s peak x mfu {mfu:g}")


def _forward(model: ModelConfig, length: int) -> float:
    """FLOPs of one forward over `length` tokens."""
    return length * flops_per_token(model, length) / 3


def _decode(model: ModelConfig, length: int, rate: Rate) -> float:
    """Seconds of one decoded token after a `length`-token prompt."""
    return flops_per_token(model, length) / 3 / rate.flops + DECODE_STEP_SECONDS


def _load(model: ModelConfig) -> float:
    return param_count(model) * DTYPE_BYTES[model.param_dtype] / LOAD_BYTES_PER_SECOND


def _train(stage: RunConfig, rate: Rate, compile_s: float) -> tuple[float, str]:
    """(seconds, how) of a stage: its steps, one compile, its saves and held-out losses."""
    model, data, train = stage.model.resolved(), stage.data, stage.train
    records = read_metrics(stage.workdir)
    measured = [r["step_time"] for r in records if "step_time" in r]
    # a stage started before: its own compile (a run started again loads it from the
    # persistent cache, faster still: the measured time is the bound)
    compiles = [r["compile_time"] for r in records if "compile_time" in r]
    compile_s = compiles[-1] if compiles else compile_s
    done = max([r.get("step", 0) for r in records], default=0)
    left = max(0, train.steps - done)
    if measured:
        step, how = statistics.median(measured), "its measured steps"
    else:
        step, how = (
            (data.batch_size * data.seq_len * flops_per_token(model, data.seq_len) / rate.flops),
            "FLOPs",
        )
    # the parameters and Adam's two float32 moments
    state = param_count(model) * (DTYPE_BYTES[model.param_dtype] + 8)
    saves = 1 + (left // stage.checkpoint.every if stage.checkpoint.every else 0)
    held_out = 0.0
    if stage.validation.path:
        times = 1 + left // stage.validation.every + stage.validation.at_start
        lengths = validation_lengths(data.seq_len, stage.validation.lengths)
        held_out = times * sum(
            stage.validation.batches * data.batch_size * _forward(model, n) / rate.flops
            for n in lengths
        ) + compile_s * len(lengths)
    seconds = (
        STAGE_START_SECONDS
        + _load(model)
        + compile_s
        + left * step
        + saves * state / SAVE_BYTES_PER_SECOND
        + held_out
    )
    return seconds, f"{left} steps of {step:.2f} s ({how}), {saves} saves"


def expected_seconds(
    part: Part, first: RunConfig, stage: RunConfig | None, rate: Rate, documents: dict[int, int]
) -> tuple[float, str]:
    """(seconds, how) part `part` is expected to take; `stage` is the stage a training part
    trains (the last stage for evaluations: its model shape), `documents` the held-out
    documents read at each length."""
    ext, compile_s = first.extension, first.extension.compile_seconds
    if part.task == TRAIN:
        assert stage is not None
        return _train(stage, rate, compile_s)
    model = (stage or first).model.resolved()
    seconds, how = _load(model), []
    for n in part.lengths:
        if part.task == "perplexity":
            docs = min(ext.documents, documents.get(n, 0))
            seconds += compile_s + docs * _forward(model, n) / rate.flops
            how.append(f"{docs} documents")
        elif part.task == "passkey":
            prompts = ext.passkey_depths * ext.passkey_samples
            seconds += 2 * compile_s + prompts * (
                _forward(model, n) / rate.flops + PASSKEY_NEW_TOKENS * _decode(model, n, rate)
            )
            how.append(f"{prompts} prompts")
        else:
            tasks = [t.strip() for t in ext.ruler_tasks.split(",") if t.strip()]
            budgets = [RULER_TASKS[task].budget for task in tasks]
            # one prefill and one decode program per answer budget (tasks share them)
            seconds += 2 * compile_s * len(set(budgets)) + sum(
                ext.ruler_samples
                * (_forward(model, n) / rate.flops + budget * _decode(model, n, rate))
                for budget in budgets
            )
            how.append(f"{len(tasks)} tasks x {ext.ruler_samples} prompts")
    return seconds, ", ".join(how)

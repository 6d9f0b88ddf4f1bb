"""What an extension run does, as parts in the order of their value: the starting weights'
loss by position at the final length, the training, the trained weights' loss there, the
passkey after and before, the other lengths (the short-context loss among them), the starting
weights with YaRN at inference, RULER after and before, and each earlier stage's weights at
its own length. A run cut short (a device's time limit) has answered the main question
first: did the loss at the final length fall?

Every evaluation part is one `python -m lclm.eval TASK` command line (`eval_argv`): the same
code, flags and report as a user's own evaluation, with the same compute dtype, mesh and
attention tiles for every model measured, so that two models compared differ only in their
weights.
"""

from __future__ import annotations

import dataclasses

from lclm import hf
from lclm.config import AttentionConfig, ModelConfig
from lclm.config.fields import from_saved
from lclm.config.run_config import RunConfig, run_config
from lclm.config.stages import stage_configs
from lclm.config.syntax import format_tokens, parse_lengths, parse_tokens
from lclm.data import ruler
from lclm.errors import ConfigError
from lclm.eval.decode import padded_length
from lclm.eval.perplexity import row_length
from lclm.workdir.checkpoint import saved_config
from lclm.workdir.layout import workdir_to_read
from lclm.workdir.resume import CONVERTED_FROM

BEFORE, YARN, AFTER = "before", "yarn", "after"  # the models measured, besides stage i
TRAIN = "train"
# tokens a passkey prompt decodes: lclm.eval.passkey's 5 digits + 4 (a space, EOS, slack)
PASSKEY_NEW_TOKENS = 9
# parts()'s first parts answer the main question: the loss at the final length before, the
# training, the loss there after
MAIN_QUESTION = 3


@dataclasses.dataclass(frozen=True)
class Lengths:
    """The lengths an extension is measured at (tokens)."""

    trained: int  # the starting weights' context
    final: int  # the last stage's seq_len
    perplexity: tuple[int, ...]  # loss by position, ascending; final and short among them
    short: int  # the short-context loss
    near: tuple[int, int]  # positions [start, end) of the far/near target
    far: tuple[int, int]


@dataclasses.dataclass(frozen=True)
class Part:
    """One step of the run: `task` ('perplexity', 'passkey', 'ruler' or 'train') of `model`
    (BEFORE, YARN, AFTER or 'stage <i>') at `lengths`; `key` names its folder."""

    key: str
    task: str
    model: str
    lengths: tuple[int, ...] = ()
    workdir: str = ""  # the checkpoint read (AFTER, a stage), or the stage trained

    @property
    def what(self) -> str:
        at = ",".join(format_tokens(n) for n in self.lengths)
        return f"{self.task} {self.model}" + (f" at {at}" if at else "")


def stage_runs(config) -> list[RunConfig]:
    """The typed config of every stage (a single run: the config's own)."""
    return [run_config(c) for c in stage_configs(config) or [config]]


def starting_length(sections: RunConfig) -> int:
    """The context the starting weights were trained at (extension.trained_length, else
    read from them): an HF model's
    max_position_embeddings, a run's data.seq_len (a converted checkpoint's
    max_position_embeddings); a run from scratch has none to extend (one line)."""
    model = sections.model
    if sections.extension.trained_length:
        return sections.extension.trained_length
    if model.init_from_hf:
        return hf.read_config(model.init_from_hf).max_position_embeddings
    if not model.init_from_checkpoint:
        raise ConfigError(
            "an extension starts from trained weights: set model.init_from_hf "
            "or model.init_from_checkpoint"
        )
    _, saved = saved_config(
        workdir_to_read(model.init_from_checkpoint, "model.init_from_checkpoint")
    )
    if CONVERTED_FROM in saved.get("identity", {}):
        return int(saved["model"]["max_position_embeddings"])
    return int(saved["data"]["seq_len"])


def _positions(text: str, default: tuple[int, int], key: str, final: int) -> tuple[int, int]:
    if not text:
        return default
    try:
        start, end = (parse_tokens(t) if t.strip() != "0" else 0 for t in text.split(":"))
    except ValueError:
        raise ConfigError(f"{key}={text!r} is not START:END token positions (e.g. 4k:8k)") from None
    if not 0 <= start < end <= final:
        raise ConfigError(
            f"{key}={text!r} must satisfy 0 <= START < END <= the final length {final}"
        )
    return start, end


def extension_lengths(first: RunConfig, stages: list[RunConfig], trained: int) -> Lengths:
    """The lengths of `first`'s extension and targets sections, for a run whose stages are
    `stages` (a single run: [first]); a length that cannot be is one line."""
    ext, final = first.extension, stages[-1].data.seq_len
    try:
        short = parse_tokens(ext.short_length)
        given = (
            parse_lengths(ext.lengths)
            if ext.lengths.strip() != "stages"
            else [short, trained, *(s.data.seq_len for s in stages)]
        )
    except ValueError as e:
        raise ConfigError(f"extension.lengths / extension.short_length: {e}") from None
    lengths = tuple(sorted({n for n in given if n <= final} | {short, final}))
    if short > final:
        raise ConfigError(
            f"extension.short_length={ext.short_length!r} is longer than the final length {final}"
        )
    near = _positions(
        first.targets.near_positions,
        (min(trained, final) // 2, min(trained, final)),
        "targets.near_positions",
        final,
    )
    far = _positions(
        first.targets.far_positions, (final // 2, final), "targets.far_positions", final
    )
    for key, (start, end) in (("near_positions", near), ("far_positions", far)):
        width = final / ext.buckets
        if start % width or end % width:
            raise ConfigError(
                f"targets.{key} {start}:{end} does not fall on the edges of the final length's "
                f"{ext.buckets} position ranges ({width:g} tokens each; "
                "extension.buckets)"
            )
    return Lengths(trained, final, lengths, short, near, far)


def parts(first: RunConfig, stages: list[RunConfig], lengths: Lengths) -> list[Part]:
    """Every part of the run, in the order of its value (see the module's docstring)."""
    ext, final, last = first.extension, lengths.final, stages[-1].workdir
    others = tuple(n for n in lengths.perplexity if n != final)
    out = [
        Part(f"perplexity-before-{format_tokens(final)}", "perplexity", BEFORE, (final,)),
        Part(TRAIN, TRAIN, "stages", tuple(s.data.seq_len for s in stages)),
        Part(f"perplexity-after-{format_tokens(final)}", "perplexity", AFTER, (final,), last),
        Part(f"passkey-after-{format_tokens(final)}", "passkey", AFTER, (final,), last),
        Part(f"passkey-before-{format_tokens(final)}", "passkey", BEFORE, (final,)),
    ]
    if others:
        tag = "-".join(format_tokens(n) for n in others)
        out += [
            Part(f"perplexity-before-{tag}", "perplexity", BEFORE, others),
            Part(f"perplexity-after-{tag}", "perplexity", AFTER, others, last),
        ]
    if ext.yarn and final > lengths.trained:
        out.append(Part(f"perplexity-yarn-{format_tokens(final)}", "perplexity", YARN, (final,)))
    if ext.ruler_tasks.strip():
        out += [
            Part(f"ruler-after-{format_tokens(final)}", "ruler", AFTER, (final,), last),
            Part(f"ruler-before-{format_tokens(final)}", "ruler", BEFORE, (final,)),
        ]
    out += [
        Part(
            f"perplexity-stage{i}-{format_tokens(s.data.seq_len)}",
            "perplexity",
            f"stage {i}",
            (s.data.seq_len,),
            s.workdir,
        )
        for i, s in enumerate(stages[:-1])
    ]
    return out


def eval_argv(
    part: Part, first: RunConfig, last: RunConfig, lengths: Lengths, out: str, heldout: str
) -> list[str]:
    """The `python -m lclm.eval <part.task>` flags of an evaluation part: its model (the
    starting weights, with YaRN scaled from their trained length to the final one; a stage's
    checkpoint), the compute dtype, mesh and attention tiles of the last stage for every
    model, the held-out documents prepared in `heldout`, its report into `out`."""
    ext = first.extension
    model = first.model
    if part.model in (BEFORE, YARN):
        source = (
            ["--hf", model.init_from_hf]
            if model.init_from_hf
            else ["--checkpoint", model.init_from_checkpoint]
        )
    else:
        source = ["--checkpoint", part.workdir]
    argv = [
        *source,
        "--dtype",
        last.model.dtype,
        *(f"--{axis}={getattr(last.mesh, axis)}" for axis in ("dp", "fsdp", "tp", "sp")),
        "--layout",
        last.attention.layout,
        "--strategy",
        last.attention.strategy,
        "--ulysses",
        str(last.attention.ulysses),
        "--q-chunk",
        str(last.attention.q_chunk),
        "--kv-chunk",
        str(last.attention.kv_chunk),
        "--lengths",
        ",".join(map(str, part.lengths)),
        "--out",
        out,
    ]
    if part.model == YARN:
        argv += [
            "--rope-scaling",
            "yarn",
            "--rope-factor",
            f"{lengths.final / lengths.trained:g}",
            "--rope-original-max-positions",
            str(lengths.trained),
        ]
    if part.task == "perplexity":
        argv += [
            "--data",
            f"tokenized:{heldout}",
            "--documents",
            str(ext.documents),
            "--buckets",
            str(ext.buckets),
        ]
    elif part.task == "passkey":
        argv += ["--depths", str(ext.passkey_depths), "--samples", str(ext.passkey_samples)]
    elif part.task == "ruler":
        argv += ["--tasks", ext.ruler_tasks, "--samples", str(ext.ruler_samples)]
        if ext.ruler_chat:
            argv += ["--chat", "tokenizer"]
    return argv


# -- the programs the evaluation parts compile (for `python -m lclm.plan --compile`) --------


@dataclasses.dataclass(frozen=True)
class Program:
    """A program an evaluation part compiles: `kind` 'forward' (perplexity's token losses) or
    'decode' (a prefill and its decode step, `max_new` slots) of `model` and `attention`
    over `rows` rows of `row` tokens."""

    what: str
    kind: str
    model: ModelConfig
    attention: AttentionConfig
    rows: int
    row: int
    max_new: int = 0


def eval_models(
    first: RunConfig, last: RunConfig, lengths: Lengths
) -> dict[str, tuple[ModelConfig, AttentionConfig]]:
    """The model and attention each evaluated model runs with (`eval_argv`'s flags as
    lclm.eval.model applies them): the last stage's compute dtype and attention for all."""
    a = last.attention

    def tiled(attention: AttentionConfig) -> AttentionConfig:
        return dataclasses.replace(
            attention,
            layout=a.layout,
            strategy=a.strategy,
            ulysses=a.ulysses,
            q_chunk=a.q_chunk,
            kv_chunk=a.kv_chunk,
        )

    after = dataclasses.replace(last.model.resolved(), dtype=last.model.dtype)
    if first.model.init_from_hf:
        before = dataclasses.replace(
            hf.read_config(first.model.init_from_hf), dtype=last.model.dtype
        )
        before_attention = tiled(AttentionConfig())
    else:
        _, saved = saved_config(
            workdir_to_read(first.model.init_from_checkpoint, "model.init_from_checkpoint")
        )
        before = dataclasses.replace(
            from_saved(ModelConfig, saved["model"]), dtype=last.model.dtype
        )
        before_attention = tiled(from_saved(AttentionConfig, saved["attention"]))
    yarn = dataclasses.replace(
        before,
        rope_scaling="yarn",
        rope_factor=lengths.final / lengths.trained,
        rope_original_max_positions=lengths.trained,
    )
    return {
        BEFORE: (before, before_attention),
        YARN: (yarn, before_attention),
        AFTER: (after, tiled(a)),
    }


def eval_programs(
    stages: list[RunConfig], lengths: Lengths, all_parts: list[Part]
) -> list[Program]:
    """Every distinct program the evaluation parts of `all_parts` compile (an earlier stage's
    weights run with their own RoPE, and the last stage's dtype and tiles)."""
    first, last = stages[0], stages[-1]
    models = eval_models(first, last, lengths)
    for i, stage in enumerate(stages[:-1]):
        models[f"stage {i}"] = (
            dataclasses.replace(stage.model.resolved(), dtype=last.model.dtype),
            models[AFTER][1],
        )
    sp, rows = last.mesh.sp, last.mesh.dp * last.mesh.fsdp
    found: dict[tuple, Program] = {}
    for part in all_parts:
        if part.task == TRAIN:
            continue
        model, attention = models[part.model]
        for n in part.lengths:
            if part.task == "perplexity":
                shapes = [("forward", row_length(model, attention, sp, n), 0)]
            elif part.task == "passkey":
                shapes = [
                    ("decode", padded_length(n, sp, model.ffn_chunk, attention), PASSKEY_NEW_TOKENS)
                ]
            else:
                budgets = {
                    ruler.TASKS[t.strip()].budget
                    for t in first.extension.ruler_tasks.split(",")
                    if t.strip()
                }
                shapes = [
                    ("decode", padded_length(n - b, sp, model.ffn_chunk, attention), b)
                    for b in sorted(budgets)
                ]
            for kind, row, max_new in shapes:
                key = (kind, model, attention, row, max_new)
                if key not in found:
                    found[key] = Program(
                        f"{part.task} {part.model} at {format_tokens(n)}",
                        kind,
                        model,
                        attention,
                        rows,
                        row,
                        max_new,
                    )
    return list(found.values())

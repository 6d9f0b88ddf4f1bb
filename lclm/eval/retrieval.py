"""Retrieval accuracy per (context length, depth bin), shared by the passkey, needle and
line-retrieval tasks: each task makes `Item`s (a token prompt and the answer it asks for);
here they are prefilled with the model's context-parallel attention on its mesh, decoded
greedily (`lclm.eval.decode`) and scored.

Prompts of one length share a row length: each is padded at the FRONT to the next length
that `sp` and the chunks divide, in a pad segment of its own (`decode.pad_front`), so the
prompt's last token is the row's last and no prompt token sees the padding.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Callable

import numpy as np

from lclm.data.line_retrieval import parse_answer
from lclm.eval import report
from lclm.eval.decode import greedy_generate, pad_front, padded_length
from lclm.eval.model import LoadedModel, answer_text

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Item:
    """One prompt: tokens `[n]` int32 (BOS first where the tokenizer adds one), the depth bin
    it belongs to, the expected answer as written, and what else the samples record."""

    depth_bin: int
    tokens: np.ndarray
    answer: str
    info: dict = dataclasses.field(default_factory=dict)


def generate_answers(
    model: LoadedModel,
    prompts: list[np.ndarray],
    max_new: int,
    batch_size: int,
    stop: int | None = None,
) -> tuple[list[str], int]:
    """Greedy answers (text up to EOS, or the first `stop` id) of token prompts, `batch_size`
    rows per prefill, and the padded length all rows shared. The last batch is filled up with
    copies of its last prompt so that the mesh's batch axes divide it."""
    length = padded_length(
        max(map(len, prompts)), model.mesh.shape["sp"], model.config.ffn_chunk, model.attention
    )
    pad = prompts[0][-1]  # any id: the pad segment is never attended to
    answers: list[str] = []
    for start in range(0, len(prompts), batch_size):
        group = prompts[start : start + batch_size]
        n = len(group)
        rows = pad_front(group + [group[-1]] * (batch_size - n), length, pad)
        # decoding stops once every row has ended: answers are a few tokens of max_new
        ids = greedy_generate(
            model.config,
            model.attention,
            model.params,
            *rows,
            max_new,
            mesh=model.mesh,
            stop_ids=stop_ids(model.tokenizer, stop),
        )
        answers.extend(answer_text(model.tokenizer, row, stop) for row in ids[:n])
    return answers, length


def stop_ids(tokenizer, stop: int | None = None) -> tuple[int, ...]:
    """The ids an answer ends at: the tokenizer's EOS (where it has one) and `stop`."""
    return tuple(i for i in (tokenizer.eos_id, stop) if i is not None and i >= 0)


def batch_rows(model: LoadedModel, batch_size: int | None) -> int:
    """`batch_size` (default 1) rounded up to a multiple of the mesh's batch axes."""
    rows = model.mesh.shape["dp"] * model.mesh.shape["fsdp"]
    return rows * max(1, -(-(batch_size or 1) // rows))


def cell(records: list[dict], length: int, b: int, n_bins: int) -> dict:
    """The accuracy of the records of one (length, depth bin)."""
    mine = [r for r in records if r["length"] == length and r["depth_bin"] == b]
    correct = sum(r["correct"] for r in mine)
    return dict(
        length=length,
        depth_bin=b,
        depth_lo=b / n_bins,
        depth_hi=(b + 1) / n_bins,
        n=len(mine),
        correct=correct,
        accuracy=correct / len(mine),
        prompt_tokens=int(np.mean([r["prompt_tokens"] for r in mine])),
        padded_to=mine[0]["padded_to"],
    )


def evaluate(
    model: LoadedModel,
    lengths: list[int],
    items_of: Callable[[int], list[Item]],
    *,
    n_bins: int,
    max_new: int,
    batch_size: int | None = None,
    parse: Callable[[str], str | None] = parse_answer,
) -> dict:
    """Accuracy per (length, depth bin): {'cells': [...], 'samples': [...]}, one sample
    record per prompt (its info, expected and generated answer, whether `parse` of the
    generated text equals the expected answer). `items_of(length)` makes a length's
    prompts; one log line per length reports progress."""
    rows = batch_rows(model, batch_size)
    cells, records = [], []
    for length in lengths:
        items = items_of(length)
        answers, padded = generate_answers(model, [it.tokens for it in items], max_new, rows)
        for it, text in zip(items, answers):
            records.append(
                dict(
                    length=length,
                    depth_bin=it.depth_bin,
                    **it.info,
                    prompt_tokens=len(it.tokens),
                    padded_to=padded,
                    answer=it.answer,
                    output=text,
                    correct=parse(text) == it.answer,
                )
            )
        cells += [cell(records, length, b, n_bins) for b in range(n_bins)]
        log.info(
            "length %d: accuracy %.3f",
            length,
            np.mean([r["correct"] for r in records if r["length"] == length]),
        )
    return dict(cells=cells, samples=records)


# -- the passkey and needle command lines --------------------------------------------------


def add_grid_arguments(ap: argparse.ArgumentParser, digits: int) -> None:
    """Flags of a retrieval task (beside `add_model_arguments`')."""
    report.add_lengths_argument(ap)
    ap.add_argument("--depths", type=int, default=5, help="number of needle-depth bins")
    ap.add_argument("--samples", type=int, default=5, help="prompts per (length, depth bin)")
    ap.add_argument(
        "--seed",
        type=int,
        default=1234,
        help="the prompts' random numbers and depths (the same prompts every run)",
    )
    ap.add_argument("--digits", type=int, default=digits, help="digits of the hidden number")
    ap.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="prompts per prefill (default 1; rounded up to the mesh's dp x fsdp)",
    )
    ap.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="tokens decoded per prompt (default: digits + 4)",
    )


GRID_FLAGS = ("depths", "samples", "digits", "batch_size", "max_new_tokens")  # all >= 1


def number(rng, digits: int) -> str:
    """A random `digits`-digit number (no leading zero), as written."""
    return str(int(rng.integers(10 ** (digits - 1), 10**digits)))


def depth_in_bin(rng, b: int, n_bins: int) -> float:
    """A depth drawn uniformly from bin b, [b/n_bins, (b+1)/n_bins)."""
    return (b + float(rng.random())) / n_bins


def run_grid(
    args,
    task: str,
    model: LoadedModel,
    lengths: list[int],
    items_of: Callable[[int], list[Item]],
    meta: dict,
    title: str,
    trained: int | None = None,
) -> int:
    """Evaluate, print the table and write `OUT/<task>.{md,json,png}` (see `report`);
    `trained`: the trained length, marked on the heatmap."""
    max_new = args.max_new_tokens or args.digits + 4  # a space, the digits, EOS, slack
    result = evaluate(
        model, lengths, items_of, n_bins=args.depths, max_new=max_new, batch_size=args.batch_size
    )
    meta = dict(
        meta,
        **report.model_meta(model),
        trained_length=trained,
        samples_per_cell=args.samples,
        seed=args.seed,
        digits=args.digits,
    )
    table = report.accuracy_table(result["cells"], lengths, args.depths)
    print(table, flush=True)

    def write(folder: str) -> None:
        report.write_files(
            folder,
            task,
            table,
            dict(meta, lengths=lengths, depth_bins=args.depths, **result),
            lambda path: report.accuracy_heatmap(
                path,
                result["cells"],
                lengths,
                args.depths,
                f"{title}: {model.name}",
                trained=trained,
                samples=args.samples,
            ),
        )

    return report.save_report(args.out, task, write)

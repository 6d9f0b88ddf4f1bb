"""Passkey retrieval: a random number hidden in repeated filler text, accuracy per context
length and depth (Mohtashami & Jaggi, "Landmark Attention", 2023; used by LongLoRA, YaRN).

    python -m lclm.eval passkey --checkpoint WORKDIR --lengths 4k,16k,64k --depths 5
    python -m lclm.eval passkey --hf HF_DIR --lengths 32k,128k --sp 8 --samples 10

A prompt of exactly L tokens: BOS, an instruction, repetitions of the filler ("The grass is
green. The sky is blue. ...", the last one cut to fill L), with the passkey sentence placed
between two of them at a depth drawn from one of `--depths` equal bins, then the question
"What is the pass key? The pass key is". The answer is decoded greedily after a prefill with the
model's context-parallel attention (`lclm.eval.retrieval`); it is correct when its first
number is the key. Every prompt is deterministic from (seed, length, bin, sample).

Writes the table to stdout and `OUT/passkey.md`, `OUT/passkey.json` (cells, every sample)
and `OUT/passkey.png` (accuracy heatmap, length x depth).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from lclm.eval import report, retrieval
from lclm.eval.model import load_model

TASK = "passkey"
INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and "
    "memorize it. I will quiz you about the important information there."
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"


def build_prompt(tokenizer, length: int, key: str, depth: float) -> tuple[np.ndarray, float]:
    """(tokens `[length]` int32, the needle's actual depth: the share of the k whole filler
    repetitions before it). Pieces are encoded separately and joined, so each repetition is the same
    tokens; the needle goes between repetitions round(depth * k) and the next of the k whole
    ones that fit, and the first tokens of one more repetition fill the prompt to exactly
    `length` (a row of the table is a prompt of that many tokens)."""
    head = [tokenizer.bos_id] * tokenizer.add_bos + tokenizer.encode(INTRO)
    needle = tokenizer.encode(NEEDLE.format(key=key))
    question = tokenizer.encode(QUESTION)
    unit = tokenizer.encode(FILLER)
    filler = length - len(head) - len(needle) - len(question)
    k = filler // len(unit)
    if k < 1:
        raise ValueError(
            f"a passkey prompt needs more than {length} tokens; use a longer --lengths"
        )
    at = min(k, round(depth * k))
    tokens = head + unit * at + needle + unit * (k - at) + unit[: filler - k * len(unit)] + question
    return np.asarray(tokens, np.int32), at / k


def items(
    tokenizer, length: int, n_bins: int, samples: int, digits: int, seed: int
) -> list[retrieval.Item]:
    """`samples` prompts for each depth bin, each from rng(seed, length, bin, sample)."""
    out = []
    for b in range(n_bins):
        for i in range(samples):
            rng = np.random.default_rng([seed, length, b, i])
            key = retrieval.number(rng, digits)
            tokens, depth = build_prompt(
                tokenizer, length, key, retrieval.depth_in_bin(rng, b, n_bins)
            )
            out.append(retrieval.Item(b, tokens, key, dict(depth=round(depth, 4))))
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    retrieval.add_grid_arguments(ap, digits=5)


def parse_args(argv=None, prog: str | None = None):
    return report.parse_task_args(__doc__, TASK, add_arguments, argv, prog)


def main(argv=None, prog: str | None = None) -> int:
    return report.run_task(parse_args(argv, prog), _run)


def _run(args) -> int:
    report.check_model_args(args, retrieval.GRID_FLAGS)
    given = report.explicit_lengths(args)
    model, saved = load_model(args)
    lengths = report.task_lengths(given, model, saved)
    make = lambda length: items(
        model.tokenizer, length, args.depths, args.samples, args.digits, args.seed
    )
    return retrieval.run_grid(
        args,
        TASK,
        model,
        lengths,
        make,
        {},
        "passkey retrieval",
        report.trained_length(model, saved),
    )


if __name__ == "__main__":
    sys.exit(main())

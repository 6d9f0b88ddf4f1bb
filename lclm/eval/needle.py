"""Needle in a haystack on your own documents: a sentence holding a random number inserted
at a depth into real text, accuracy per context length and depth.

    python -m lclm.eval needle --checkpoint WORKDIR --data heldout.jsonl --lengths 4k,16k
    python -m lclm.eval needle --hf HF_DIR --data books/ --lengths 32k,128k --sp 8 \\
        --needle "The secret code of the vault is {number}." \\
        --question "What is the secret code of the vault? The secret code of the vault is"

The haystack is the text of `--data` (read by the training data sources, as `perplexity`
reads it): the documents' tokens without BOS/EOS, concatenated from a document chosen per
prompt (wrapping round the set) until the prompt is L tokens. The needle (`--needle`, a
template with `{number}`) is inserted at a depth drawn from one of `--depths` equal bins of
the haystack, and the prompt ends with `--question`. The answer is decoded greedily after a
prefill with the model's context-parallel attention (`lclm.eval.retrieval`); it is correct
when its first number is the needle's. Prompts are deterministic from (seed, length, bin,
sample) and the data.

Writes the table to stdout and `OUT/needle.md`, `OUT/needle.json` (cells, every sample) and
`OUT/needle.png` (accuracy heatmap, length x depth).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from lclm.data.sources import open_documents
from lclm.errors import StartupError
from lclm.eval import report, retrieval
from lclm.eval.model import load_model
from lclm.eval.perplexity import data_source

TASK = "needle"
NEEDLE = "The special magic number is {number}."
QUESTION = "What is the special magic number mentioned in the text? The special magic number is"


def haystack(docs, tokenizer, start: int, n: int) -> np.ndarray:
    """`n` tokens `[n]` int32 of the documents from `start` on (wrapping round), BOS and EOS
    removed so that the text reads on; a ValueError if the whole set holds fewer."""
    special = {tokenizer.bos_id, tokenizer.eos_id}
    parts, have = [], 0
    for i in range(len(docs)):
        doc = docs[(start + i) % len(docs)]
        if doc is None:  # a malformed record
            continue
        tokens = np.asarray([t for t in doc[0] if t not in special], np.int32)
        parts.append(tokens)
        have += len(tokens)
        if have >= n:
            return np.concatenate(parts)[:n]
    raise ValueError(
        f"--data holds only {have} tokens of text; a needle prompt of this "
        f"length needs {n}: use more documents or shorter --lengths"
    )


def build_prompt(
    docs,
    tokenizer,
    length: int,
    number: str,
    depth: float,
    start: int,
    needle: str = NEEDLE,
    question: str = QUESTION,
) -> tuple[np.ndarray, float]:
    """(tokens `[length]` int32, the needle's actual depth: the share of the haystack before
    it). BOS, haystack with the needle at token round(depth * n), question."""
    head = [tokenizer.bos_id] * tokenizer.add_bos
    sentence = tokenizer.encode(needle.replace("{number}", number))
    asked = tokenizer.encode(question)
    n = length - len(head) - len(sentence) - len(asked)
    if n < 1:
        raise ValueError(f"a needle prompt needs more than {length} tokens; use a longer --lengths")
    hay = haystack(docs, tokenizer, start, n)
    at = min(n, round(depth * n))
    tokens = np.concatenate(
        [
            np.asarray(head, np.int32),
            hay[:at],
            np.asarray(sentence, np.int32),
            hay[at:],
            np.asarray(asked, np.int32),
        ]
    )
    return tokens.astype(np.int32), at / n


def items(
    docs,
    tokenizer,
    length: int,
    n_bins: int,
    samples: int,
    digits: int,
    seed: int,
    needle: str = NEEDLE,
    question: str = QUESTION,
) -> list[retrieval.Item]:
    """`samples` prompts for each depth bin, each from rng(seed, length, bin, sample)."""
    out = []
    for b in range(n_bins):
        for i in range(samples):
            rng = np.random.default_rng([seed, length, b, i])
            number = retrieval.number(rng, digits)
            start = int(rng.integers(len(docs)))
            tokens, depth = build_prompt(
                docs,
                tokenizer,
                length,
                number,
                retrieval.depth_in_bin(rng, b, n_bins),
                start,
                needle,
                question,
            )
            out.append(
                retrieval.Item(b, tokens, number, dict(depth=round(depth, 4), document=start))
            )
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The task's flags (beside `add_model_arguments`')."""
    ap.add_argument(
        "--data",
        required=True,
        help="the haystack's documents: a .jsonl/.json/.txt/.parquet/.arrow file, "
        "a directory or glob of them, or a lclm.data.prepare directory",
    )
    ap.add_argument("--text-field", default="text", help="the documents' text field")
    ap.add_argument(
        "--needle",
        default=NEEDLE,
        help="the inserted sentence; {number} is replaced by the random number",
    )
    ap.add_argument("--question", default=QUESTION, help="the end of the prompt")
    retrieval.add_grid_arguments(ap, digits=4)


def parse_args(argv=None, prog: str | None = None):
    return report.parse_task_args(__doc__, TASK, add_arguments, argv, prog)


def _run(args) -> int:
    report.check_model_args(args, retrieval.GRID_FLAGS)
    if "{number}" not in args.needle:
        raise StartupError(f"--needle {args.needle!r} has no {{number}} to put the number in")
    source = data_source("--data", args.data)
    given = report.explicit_lengths(args)
    model, saved = load_model(args)
    lengths = report.task_lengths(given, model, saved)
    docs = open_documents(source.kind, source.path, model.tokenizer, text_field=args.text_field)
    make = lambda length: items(
        docs,
        model.tokenizer,
        length,
        args.depths,
        args.samples,
        args.digits,
        args.seed,
        args.needle,
        args.question,
    )
    meta = dict(data=args.data, needle=args.needle, question=args.question)
    return retrieval.run_grid(
        args,
        TASK,
        model,
        lengths,
        make,
        meta,
        "needle in a haystack",
        report.trained_length(model, saved),
    )


def main(argv=None, prog: str | None = None) -> int:
    return report.run_task(parse_args(argv, prog), _run)


if __name__ == "__main__":
    sys.exit(main())

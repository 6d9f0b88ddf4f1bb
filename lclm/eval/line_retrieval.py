"""Line-retrieval accuracy per context length and needle depth (Ring Attention, section 5.3).

    python -m lclm.eval.line_retrieval --checkpoint WORKDIR --lengths 2k,4k,8k --samples 10
    python -m lclm.eval.line_retrieval --hf HF_DIR --format paper --lengths 4k,16k --sp 4

Each prompt is a document of numbered lines holding random numbers, ending with a question
for one line (`lclm.data.line_retrieval`, the format the tiny config trains on). The asked
line is drawn from one of `--depths` equal bins of the document, `--samples` prompts per
(length, bin). A prompt is prefilled with the same striped ring attention as training, on
the mesh given by the flags (default: the checkpoint's), then decoded greedily with a KV
cache (`lclm.eval.decode`); the answer is the first number in the generated text.

Lengths and padding. A prompt built for length L holds at most L tokens (the example is L
tokens with its answer, so the prompt is L minus the answer's). The ring needs a sequence
that `sp` and the attention/feed-forward chunks divide, so each row is padded at the FRONT
to the next such length with a separate pad segment: segment ids keep the padding and the
document apart (the pad tokens are never attended to), positions start at 0 at the
document's first token (as in training's packed rows), and the prompt's last token is the
row's last, where decoding continues.

Writes a markdown table to stdout and `OUT/line_retrieval.md`, `OUT/line_retrieval.json`
(cells and per-sample answers) and `OUT/line_retrieval.png` (accuracy heatmap). OUT is checked
before the model is loaded; the table is printed before the files are written, and a write
that still fails (a disk filled meanwhile) puts the report in a temporary folder and says
where (exit status 1). Loading reads Orbax tensors, JSON, safetensors and a SentencePiece
model only: nothing is unpickled.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import numpy as np

from lclm.data.line_retrieval import Spec, build_example, line_format, spec_of_config
from lclm.eval import report, retrieval
from lclm.eval.model import LoadedModel, load_model

TASK = "line_retrieval"


# -- prompts (host side, numpy only) --------------------------------------------------------


def make_examples(tokenizer, length: int, n_bins: int, samples: int, fmt, seed: int):
    """`samples` examples of `length` tokens for each depth bin: [(bin, Example)], each
    deterministic from (seed, length, bin, sample)."""
    out = []
    for b in range(n_bins):
        for i in range(samples):
            rng = np.random.default_rng([seed, length, b, i])
            out.append((b, build_example(tokenizer, rng, length, fmt, depth_bin=b, n_bins=n_bins)))
    return out


def items(tokenizer, length: int, n_bins: int, samples: int, fmt, seed: int):
    """The prompts of `make_examples` as `retrieval.Item`s (asked line, its depth, lines)."""
    return [
        retrieval.Item(
            b,
            ex.tokens[: ex.prompt_len],
            ex.answer,
            dict(depth=round(ex.depth, 4), key=ex.key, lines=ex.n_lines),
        )
        for b, ex in make_examples(tokenizer, length, n_bins, samples, fmt, seed)
    ]


# -- evaluation ----------------------------------------------------------------------------

_cell = retrieval.cell


def evaluate(
    model: LoadedModel,
    lengths,
    *,
    samples: int,
    n_bins: int,
    fmt,
    seed: int = 0,
    batch_size: int | None = None,
    max_new: int | None = None,
) -> dict:
    """Accuracy per (length, depth bin): {'cells': [...], 'samples': [...]} (one record per
    prompt: asked line, depth, expected and generated answer)."""
    max_new = max_new or fmt.digits + 3  # the leading '▁' (a space), digits, EOS, slack
    return retrieval.evaluate(
        model,
        list(lengths),
        lambda length: items(model.tokenizer, length, n_bins, samples, fmt, seed),
        n_bins=n_bins,
        max_new=max_new,
        batch_size=batch_size,
    )


markdown_table = report.accuracy_table


def write_report(out_dir: str, result: dict, lengths, n_bins: int, meta: dict) -> str:
    """Write table, JSON and PNG into `out_dir`; returns the markdown table. `meta` holds
    `report.model_meta`'s fields, `trained_length` and `samples_per_cell`."""
    table = markdown_table(result["cells"], lengths, n_bins)
    report.write_files(
        out_dir,
        TASK,
        table,
        dict(meta, lengths=lengths, depth_bins=n_bins, **result),
        lambda path: report.accuracy_heatmap(
            path,
            result["cells"],
            lengths,
            n_bins,
            f"line retrieval: {meta['model']}",
            depth_of="the asked line",
            trained=meta.get("trained_length"),
            samples=meta.get("samples_per_cell"),
        ),
    )
    return table


# -- command line --------------------------------------------------------------------------


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The task's flags (beside `add_model_arguments`')."""
    report.add_lengths_argument(ap)
    ap.add_argument("--samples", type=int, default=10, help="prompts per (length, depth bin)")
    ap.add_argument("--depths", type=int, default=5, help="number of needle-depth bins")
    ap.add_argument(
        "--seed",
        type=int,
        default=1234,
        help="the prompts' random numbers and asked lines (the same prompts every run)",
    )
    ap.add_argument(
        "--format", help="line format (default: the run's line_retrieval data, else 'compact')"
    )
    ap.add_argument("--digits", type=int, help="digits of the numbers (default: as --format)")
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
        help="tokens decoded per prompt (default: digits + 3)",
    )


def parse_args(argv=None, prog: str | None = None):
    return report.parse_task_args(__doc__, TASK, add_arguments, argv, prog)


def _line_format(args, saved: dict | None):
    spec = spec_of_config(saved.get("data", {})) if saved else None
    spec = spec or Spec()
    return line_format(args.format or spec.format, args.digits or spec.digits)


def main(argv=None, prog: str | None = None) -> int:
    return report.run_task(parse_args(argv, prog), _run)


def _run(args) -> int:
    # flags that would fail only after the model is loaded, or at the very end (--out)
    report.check_model_args(args, ("samples", "depths", "batch_size", "max_new_tokens"))
    given = report.explicit_lengths(args)
    model, saved = load_model(args)
    lengths = report.task_lengths(given, model, saved)
    fmt = _line_format(args, saved)
    result = evaluate(
        model,
        lengths,
        samples=args.samples,
        n_bins=args.depths,
        fmt=fmt,
        seed=args.seed,
        batch_size=args.batch_size,
        max_new=args.max_new_tokens,
    )
    meta = dict(
        report.model_meta(model),
        trained_length=report.trained_length(model, saved),
        format=dataclasses.asdict(fmt),
        samples_per_cell=args.samples,
        seed=args.seed,
    )
    print(markdown_table(result["cells"], lengths, args.depths), flush=True)
    return report.save_report(
        args.out, TASK, lambda folder: write_report(folder, result, lengths, args.depths, meta)
    )


if __name__ == "__main__":
    sys.exit(main())

"""Pre-tokenise a corpus into memory-mappable files that the loader streams from.

    python -m lclm.data.prepare --source sharegpt --input chats.json --tokenizer T.model --out DIR
    python -m lclm.data.prepare --source text --input 'owt/*.jsonl' --tokenizer T.model --out DIR

Writes DIR/tokens.bin (uint32), DIR/loss.bin (int8: token is a training target),
DIR/offsets.bin (int64 document boundaries) and DIR/lclm_tokens.json (counts, tokenizer).
Then train with `--config.data.path=tokenized:DIR`. Malformed records are skipped, counted
and reported.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from lclm import logs
from lclm.cli import run_cli
from lclm.data.chat import TEMPLATES
from lclm.data.sources import TOKENIZED_META, SourceStats, open_documents
from lclm.data.tokenizer import Tokenizer
from lclm.errors import StartupError


def prepare(source: str, input_path: str, tokenizer_path: str, out: str,
            text_field: str = "text", chat_template: str = "vicuna") -> dict:
    """Tokenise every record of `input_path` into `out`; returns the metadata written."""
    tokenizer = Tokenizer(tokenizer_path)
    stats = SourceStats()
    docs = open_documents(source, input_path, tokenizer, text_field=text_field,
                          chat_template=chat_template, stats=stats)
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise StartupError(f"--out {out!r}: {e.strerror}; pass a writable folder") from None
    offsets = [0]
    start = time.perf_counter()
    with open(os.path.join(out, "tokens.bin"), "wb") as ft, \
            open(os.path.join(out, "loss.bin"), "wb") as fl:
        for i in range(len(docs)):
            doc = docs[i]
            if doc is None:
                continue
            tokens, loss = doc
            ft.write(np.asarray(tokens, np.uint32).tobytes())
            fl.write(np.asarray(loss, np.int8).tobytes())
            offsets.append(offsets[-1] + len(tokens))
    np.asarray(offsets, np.int64).tofile(os.path.join(out, "offsets.bin"))
    if len(offsets) == 1:
        raise ValueError(f"{input_path!r} produced no documents ({stats.summary()})")
    meta = dict(source=source, input=input_path, documents=len(offsets) - 1,
                tokens=offsets[-1], vocab_size=tokenizer.vocab_size,
                tokenizer=os.path.abspath(tokenizer_path), skipped=stats.skipped,
                skipped_examples=stats.examples,
                seconds=round(time.perf_counter() - start, 3))
    with open(os.path.join(out, TOKENIZED_META), "w") as f:
        json.dump(meta, f, indent=1)
    return meta


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Pre-tokenise a corpus for lclm.")
    ap.add_argument("--source", choices=("text", "sharegpt"), required=True)
    ap.add_argument("--input", required=True, help="file, directory, glob or hub:NAME")
    ap.add_argument("--tokenizer", required=True, help="SentencePiece .model, HuggingFace "
                                                       "tokenizer.json or a directory holding one")
    ap.add_argument("--out", required=True)
    ap.add_argument("--text-field", default="text")
    ap.add_argument("--chat-template", default="vicuna", choices=sorted(TEMPLATES))
    logs.configure()
    args = ap.parse_args(argv)

    def body():
        meta = prepare(args.source, args.input, args.tokenizer, args.out, args.text_field,
                       args.chat_template)
        skipped = (f"; {meta['skipped']} records skipped (first: "
                   f"{'; '.join(meta['skipped_examples'])})" if meta["skipped"] else "")
        print(f"{meta['documents']} documents, {meta['tokens']} tokens in {meta['seconds']} s "
              f"-> {args.out}{skipped}")

    return run_cli(body, input_errors=(ValueError,))  # a corpus no document came from


if __name__ == "__main__":
    sys.exit(main())

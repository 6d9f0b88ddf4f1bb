"""Pre-tokenise a corpus into memory-mappable files that the loader streams from.

    python -m lclm.data.prepare --source sharegpt --input chats.json --tokenizer T.model --out DIR
    python -m lclm.data.prepare --source text --input 'owt/*.jsonl' --tokenizer T.model --out DIR
    python -m lclm.data.prepare --source code --input SITE_PACKAGES --tokenizer T.json --out DIR

Writes DIR/tokens.bin (uint32), DIR/loss.bin (int8: token is a training target),
DIR/offsets.bin (int64 document boundaries) and DIR/lclm_tokens.json (counts, tokenizer).
Then train with `--config.data.path=tokenized:DIR`. Malformed records are skipped, counted
and reported. Preparing again into the DIR a run reads is safe: the files are written under
temporary names (DIR needs room for both versions meanwhile) and renamed into place at the
end; the run keeps reading the files it opened. DIR is checked before the corpus is read: one
that could not be written is one line.

DIR, --input and --tokenizer may be on gs:// or s3://. An object-store DIR is prepared in a
local temporary folder (the machine needs room for it) and uploaded when complete, one whole
object at a time and the metadata last, so that a reader never takes a half-uploaded prefix
for prepared data; a run reading that prefix meanwhile is not safe there (objects are
replaced in place), so prepare into a new prefix.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import sys
import tempfile
import time

import numpy as np

from lclm import logs, storage
from lclm.cli import run_cli
from lclm.data.ahead import Ahead
from lclm.data.chat import TEMPLATE_NAMES
from lclm.data.prepared import TOKENIZED_META, offsets_digest
from lclm.data.sources import KINDS, open_documents
from lclm.data.stats import SourceStats
from lclm.data.tokenizer import Tokenizer
from lclm.errors import StartupError
from lclm.writes import check_input, check_output, replacing

# Renamed into place in this order once all are written: the metadata last, so that it
# never names data that is not there yet, and offsets.bin first, so that a reader that opens
# the directory during the renames gets offsets that disagree with the metadata it read (see
# TokenizedDocuments) rather than old offsets over new tokens.
OUTPUTS = ("offsets.bin", "tokens.bin", "loss.bin", TOKENIZED_META)


def prepare(
    source: str,
    input_path: str,
    tokenizer_path: str,
    out: str,
    text_field: str = "text",
    chat_template: str = "vicuna",
) -> dict:
    """Tokenise every record of `input_path` into `out`; returns the metadata written.

    Every file is written under a temporary name and renamed into place at the end: a run
    reading `out` keeps the files it opened, and a prepare that fails leaves what was there.
    An `out` that could not be written fails before anything is read. An object-store `out`
    is written locally first, then uploaded (see the module's docstring).
    """
    check_input("--input", input_path)
    check_input("--tokenizer", tokenizer_path)
    check_output("--out", out, remote=True)
    tokenizer = Tokenizer(tokenizer_path)
    stats = SourceStats()
    docs = open_documents(
        source,
        input_path,
        tokenizer,
        text_field=text_field,
        chat_template=chat_template,
        stats=stats,
    )
    if not storage.is_remote(out):
        return write_prepared(docs, out, source, input_path, tokenizer, stats)
    with tempfile.TemporaryDirectory(prefix="lclm-prepare-") as local:
        meta = write_prepared(docs, local, source, input_path, tokenizer, stats)
        for name in OUTPUTS:  # in the order of the renames, and for the same reasons
            storage.upload(os.path.join(local, name), storage.join(out, name))
    return meta


def write_prepared(
    docs, out: str, source: str, input_path: str, tokenizer, stats: SourceStats
) -> dict:
    """`docs` (any sequence of (ids, loss flags) or None) written into the local folder `out`
    as a prepared directory; returns the metadata written."""
    try:
        os.makedirs(out, exist_ok=True)
        _remove_leftovers(out)
    except OSError as e:
        raise StartupError(f"--out {out!r}: {e.strerror}; pass a writable folder") from None
    start = time.perf_counter()
    with _staged(out) as files:
        offsets = _write_documents(docs, files["tokens.bin"], files["loss.bin"])
        if len(offsets) == 1:
            raise ValueError(f"{input_path!r} produced no documents ({stats.summary()})")
        files["offsets.bin"].write(offsets.tobytes())
        meta = dict(
            source=source,
            input=input_path,
            documents=len(offsets) - 1,
            tokens=int(offsets[-1]),
            vocab_size=tokenizer.vocab_size,
            tokenizer=storage.absolute(tokenizer.path),
            skipped=stats.skipped,
            skipped_examples=stats.examples,
            offsets_sha256=offsets_digest(offsets),
            seconds=round(time.perf_counter() - start, 3),
        )
        json.dump(meta, files[TOKENIZED_META], indent=1)
        for f in files.values():  # all on disk before the first rename: a full disk fails
            f.flush()  # here, with nothing replaced
            os.fsync(f.fileno())
    return meta


def _write_documents(docs, tokens, loss) -> np.ndarray:
    """Writes every usable document's tokens and loss flags, in order, tokenised on a thread
    per core (`lclm.data.ahead`); returns the document offsets."""
    offsets = [0]
    ahead = Ahead(docs)
    try:
        for doc in ahead.read_many(range(len(docs))):
            if doc is not None:
                offsets.append(offsets[-1] + _write_document(doc, tokens, loss))
    finally:
        ahead.close()
    return np.asarray(offsets, np.int64)


def _write_document(doc, tokens, loss) -> int:
    """Writes one document's tokens and loss flags; returns its length."""
    ids, flags = doc
    tokens.write(np.asarray(ids, np.uint32).tobytes())
    loss.write(np.asarray(flags, np.int8).tobytes())
    return len(ids)


@contextlib.contextmanager
def _staged(out: str):
    """{name: temporary file in `out`} for every name of OUTPUTS, renamed onto the names (in
    that order) when the block ends without an error, removed when it raises."""
    with contextlib.ExitStack() as stack:
        try:
            # entered in reverse: the stack leaves (and renames) the last one entered first
            files = {
                name: stack.enter_context(
                    replacing(os.path.join(out, name), binary=name != TOKENIZED_META)
                )
                for name in reversed(OUTPUTS)
            }
        except OSError as e:
            raise StartupError(f"--out {out!r}: {e.strerror}; pass a writable folder") from None
        yield files


def _remove_leftovers(out: str) -> None:
    """Temporary files of a prepare killed before it renamed them (lclm.writes.replacing names
    them .NAME.*.tmp; one that fails cleanly removes its own)."""
    for name in OUTPUTS:
        for path in glob.glob(os.path.join(glob.escape(out), f".{name}.*.tmp")):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Pre-tokenise a corpus for lclm.")
    ap.add_argument(
        "--source", choices=[k.name for k in KINDS.values() if k.prepare], required=True
    )
    ap.add_argument("--input", required=True, help="file, directory, glob or hub:NAME")
    ap.add_argument(
        "--tokenizer",
        required=True,
        help="SentencePiece .model, HuggingFace tokenizer.json or a directory holding one",
    )
    ap.add_argument("--out", required=True)
    ap.add_argument("--text-field", default="text")
    ap.add_argument("--chat-template", default="vicuna", choices=sorted(TEMPLATE_NAMES))
    logs.configure()
    args = ap.parse_args(argv)

    def body():
        meta = prepare(
            args.source, args.input, args.tokenizer, args.out, args.text_field, args.chat_template
        )
        skipped = (
            f"; {meta['skipped']} records skipped (first: {'; '.join(meta['skipped_examples'])})"
            if meta["skipped"]
            else ""
        )
        print(
            f"{meta['documents']} documents, {meta['tokens']} tokens in {meta['seconds']} s "
            f"-> {args.out}{skipped}"
        )

    return run_cli(body, input_errors=(ValueError,))  # a corpus no document came from


if __name__ == "__main__":
    sys.exit(main())

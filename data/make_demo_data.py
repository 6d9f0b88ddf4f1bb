"""Regenerate the bundled demo corpus and its SentencePiece tokenizer.

    python data/make_demo_data.py [--out DIR]

Writes DIR/corpus.jsonl ({"text": ...} per line), DIR/heldout.jsonl (documents of the same
grammar that the corpus does not hold: the demo's validation set), DIR/sharegpt.jsonl
(synthetic ShareGPT conversations) and DIR/tokenizer.model (BPE trained on the corpus, LLaMA
ids: unk=0, bos=1, eos=2, byte fallback); DIR is data/demo by default. All are committed,
and the script documents how they were made: it writes them byte for byte again
(tests/data/test_demo_data.py checks), so running it leaves `git status` clean.
"""

import argparse
import io
import json
import os
import sys

import sentencepiece as spm

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from lclm.data.synthetic import conversations, corpus  # noqa: E402
from lclm.writes import replacing  # noqa: E402

OUT = os.path.join(os.path.dirname(__file__), "demo")


def write_jsonl(path: str, records) -> None:
    with replacing(path) as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


def train_tokenizer(docs: list[str]) -> bytes:
    """The serialised model. Trained into memory: a model_prefix would be stored in the model
    as given (an absolute path differs between clones); one thread, so that nothing can
    depend on how work is split."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(docs),
        model_writer=model,
        model_type="bpe",
        vocab_size=512,
        character_coverage=1.0,
        byte_fallback=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=1,
        split_digits=True,
        minloglevel=2,
    )
    return model.getvalue()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Regenerate the demo corpus and tokenizer.")
    ap.add_argument("--out", default=OUT, help="folder to write to (default: data/demo)")
    out = ap.parse_args(argv).out
    os.makedirs(out, exist_ok=True)
    write_jsonl(os.path.join(out, "sharegpt.jsonl"), conversations(1000, seed=0))
    docs = corpus(3000, seed=0)
    path = os.path.join(out, "corpus.jsonl")
    write_jsonl(path, ({"text": d} for d in docs))
    # another seed: other documents of the same grammar, so val_loss measures generalisation
    seen = set(docs)
    held_out = [d for d in corpus(200, seed=1) if d not in seen]
    write_jsonl(os.path.join(out, "heldout.jsonl"), ({"text": d} for d in held_out))
    with replacing(os.path.join(out, "tokenizer.model"), binary=True) as f:
        f.write(train_tokenizer(docs))
    print(f"{len(docs)} documents, {os.path.getsize(path) / 1e6:.2f} MB -> {out}")


if __name__ == "__main__":
    main()

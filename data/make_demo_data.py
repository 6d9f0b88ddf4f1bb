"""Regenerate the bundled demo corpus and its SentencePiece tokenizer.

    python data/make_demo_data.py

Writes data/demo/corpus.jsonl ({"text": ...} per line), data/demo/sharegpt.jsonl (synthetic
ShareGPT conversations) and data/demo/tokenizer.model (BPE trained on the corpus, LLaMA
ids: unk=0, bos=1, eos=2, byte fallback). All are committed; the script documents how they
were made.
"""

import json
import os
import sys

import sentencepiece as spm

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from lclm.data.synthetic import conversations, corpus  # noqa: E402

OUT = os.path.join(os.path.dirname(__file__), "demo")


def write_conversations():
    with open(os.path.join(OUT, "sharegpt.jsonl"), "w") as f:
        for record in conversations(1000, seed=0):
            f.write(json.dumps(record) + "\n")


def main():
    os.makedirs(OUT, exist_ok=True)
    write_conversations()
    docs = corpus(3000, seed=0)
    path = os.path.join(OUT, "corpus.jsonl")
    with open(path, "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(docs), model_prefix=os.path.join(OUT, "tokenizer"),
        model_type="bpe", vocab_size=512, character_coverage=1.0, byte_fallback=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=2, split_digits=True,
        minloglevel=2)
    os.remove(os.path.join(OUT, "tokenizer.vocab"))
    print(f"{len(docs)} documents, {os.path.getsize(path) / 1e6:.2f} MB -> {OUT}")


if __name__ == "__main__":
    main()

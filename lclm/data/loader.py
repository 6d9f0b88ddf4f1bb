"""Global batches for the trainer: documents -> tokens -> packed rows -> layout -> mesh.

Striping happens here, once, on the host (`batch_to_layout`), for all per-token arrays of a
batch together; the devices never reshuffle tokens.
"""

from __future__ import annotations

import logging
import random
from typing import Iterator

import jax
import numpy as np
from jax.sharding import NamedSharding

from lclm.data.packing import ROW_KEYS, pack_documents
from lclm.data.sources import SourceStats, read_documents
from lclm.data.tokenizer import Tokenizer
from lclm.ops.layout import batch_to_layout
from lclm.parallel.mesh import logical_spec

log = logging.getLogger(__name__)


def load_corpus(path: str, text_field: str, tokenizer: Tokenizer) -> list[list[int]]:
    """Every document of the source, tokenised as BOS + text + EOS (small corpora)."""
    stats = SourceStats()
    docs = list(read_documents(path, text_field, stats))
    if stats.skipped:
        log.warning("skipped %d malformed records (first: %s)", stats.skipped,
                    "; ".join(stats.examples))
    if not docs:
        raise ValueError(f"config.data.path={path!r} holds no usable documents")
    return [[tokenizer.bos_id] + ids + [tokenizer.eos_id] for ids in tokenizer.encode_batch(docs)]


def rows(corpus: list[list[int]], seq_len: int, seed: int, reset_positions: bool = True
         ) -> Iterator[dict[str, np.ndarray]]:
    """Packed rows over endless epochs, documents shuffled per epoch from `seed`."""
    def docs():
        epoch = 0
        while True:
            order = list(range(len(corpus)))
            random.Random(seed * 100003 + epoch).shuffle(order)
            for i in order:
                yield corpus[i]
            epoch += 1
    return pack_documents(docs(), seq_len, reset_positions)


def batch_sharding(mesh) -> NamedSharding:
    """Per-token arrays `[batch, seq]`: batch over (dp, fsdp), sequence over sp."""
    return NamedSharding(mesh, logical_spec(("batch", "seq")))


def global_batches(config, mesh, tokenizer: Tokenizer, start_step: int = 0
                   ) -> Iterator[dict[str, jax.Array]]:
    """Endless global batches `{key: [batch, seq]}` in the configured layout, on `mesh`.

    Resuming after `start_step` completed steps replays the deterministic row stream past the
    rows those steps consumed, so the next batch is the one an uninterrupted run would see.
    """
    if jax.process_count() > 1:
        raise NotImplementedError("multi-process data loading is not implemented yet")
    d = config.data
    corpus = load_corpus(d.path, d.text_field, tokenizer)
    source = rows(corpus, d.seq_len, config.seed, d.reset_positions)
    for _ in range(start_step * d.batch_size):
        next(source)
    sharding = batch_sharding(mesh)
    sp = mesh.shape["sp"]
    while True:
        group = [next(source) for _ in range(d.batch_size)]
        batch = {k: np.stack([r[k] for r in group]) for k in ROW_KEYS}
        batch = batch_to_layout(batch, config.attention.layout, sp)
        yield {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}

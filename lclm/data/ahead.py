"""Documents read ahead, in parallel: tokenising off the training step's path.

`Ahead(docs)` wraps a document set (`lclm.data.kind.Documents`) whose documents cost work to
make (records read and tokenised); `want(wanted)` starts reading those documents on worker
threads and forgets the ones read ahead that are no longer wanted, and `ahead[i]` is
document i: the one read ahead if it is there (waiting for it if it is still being read),
else read on the caller's thread. A document set that reads documents in parts (a long
text's pieces, `lclm.data.documents.Partial`) is read ahead only as far as it is wanted:
`(i, n)`, at least n tokens (what a source's length options need to decide a draw, else its
first piece), the rest as the rows use it. Document i is the same whichever thread reads it and
whenever, so reading ahead changes no batch and no resume: it only moves work.

The threads run in parallel where the work releases the GIL: a HuggingFace tokenizer's
batch calls do (`Tokenizer.encode_long`, which also shares one long text's pieces out over
the library's own threads), as does reading files; rendering a chat template or parsing a
record holds it. `read_many` reads a list of documents the same way, for the statistics and
for `python -m lclm.data.prepare`.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from lclm.data.documents import Partial


def cores() -> int:
    """The cores this process may run on (its CPU affinity): the threads that read ahead."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class Ahead:
    """`docs` read ahead on `workers` threads (see the module's docstring)."""

    def __init__(self, docs, workers: int | None = None):
        self.docs, self.workers = docs, workers or cores()
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="lclm-ahead")
        self._reads: dict[int, Future] = {}  # read ahead, in the order they were wanted

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, i: int):
        read = self._reads.pop(i, None)
        if read is None:
            return self.docs[i]
        got = read.result()
        return got.whole() if isinstance(got, Partial) else got

    def most_tokens(self, i: int) -> int | None:
        most = getattr(self.docs, "most_tokens", None)
        return None if most is None else most(i)

    def partial(self, i: int, n: int):
        """`read_partly(docs, i, n)`: what was read ahead, read further where it must be."""
        read = self._reads.pop(i, None)
        if read is None:
            partial = getattr(self.docs, "partial", None)
            return self.docs[i] if partial is None else partial(i, n, self.workers)
        got = read.result()
        if isinstance(got, Partial):
            got.read_to(n)
        return got

    def want(self, wanted: Iterable[tuple[int, int]]) -> None:
        """Read documents ahead, the soonest needed first: `(i, n)` is document i read to at
        least n tokens (see `partial`), all of it where the documents are not read in parts;
        forget those read ahead that are no longer wanted (a read under way finishes
        unused)."""
        tokens: dict[int, int] = {}
        for i, n in wanted:  # readers that share these may want one document twice
            tokens[int(i)] = max(n, tokens.get(int(i), n))
        for i in [i for i in self._reads if i not in tokens]:
            self._reads.pop(i).cancel()
        partial = getattr(self.docs, "partial", None)
        for i, n in tokens.items():
            if i not in self._reads:  # (one read to fewer tokens is read further when used)
                if partial is None:
                    self._reads[i] = self._pool.submit(self.docs.__getitem__, i)
                else:
                    self._reads[i] = self._pool.submit(partial, i, n, self.workers)

    def read_many(self, indices: Iterable[int]) -> Iterator:
        """Documents `indices`, in order, read on the threads; at most two per thread are
        held at once beyond the one handed out (a sample of long documents stays small)."""
        window: collections.deque[Future] = collections.deque()
        for i in indices:
            window.append(self._pool.submit(self.docs.__getitem__, int(i)))
            if len(window) > 2 * self.workers:
                yield window.popleft().result()
        while window:
            yield window.popleft().result()

    def close(self) -> None:
        self._reads.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)


def read_many(docs, indices: Iterable[int]) -> Iterator:
    """Documents `indices` of `docs`, in order: read on `docs`' threads where it is an
    `Ahead`, else one after another."""
    if isinstance(docs, Ahead):
        return docs.read_many(indices)
    return (docs[int(i)] for i in indices)

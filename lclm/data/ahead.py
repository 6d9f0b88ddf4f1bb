"""Documents read ahead, in parallel: tokenising off the training step's path.

`Ahead(docs)` wraps a document set (`lclm.data.kind.Documents`) whose documents cost work to
make (records read and tokenised); `want(wanted)` starts reading those documents on worker
threads and forgets the ones read ahead that are no longer wanted, and `ahead[i]` is
document i: the one read ahead if it is there (waiting for it if it is still being read),
else read on the caller's thread. A source with a length limit (`?max_tokens=`) wants a
document of unknown length only up to its limit (`upto`): a document over it is encoded
only until past the limit, read ahead or not. Document i is the same whichever thread reads it and
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

from lclm.data.kind import Longer


def cores() -> int:
    """The cores this process may run on (its CPU affinity): the threads that read ahead."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class Ahead:
    """`docs` read ahead on `workers` threads (see the module's docstring)."""

    def __init__(self, docs, workers: int | None = None):
        self.docs, self.workers = docs, workers or cores()
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="lclm-ahead")
        # read ahead, in the order they were wanted: document -> (its limit, the read)
        self._reads: dict[int, tuple[int | None, Future]] = {}

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, i: int):
        read = self._reads.pop(i, None)
        if read is not None and not isinstance(got := read[1].result(), Longer):
            return got
        return self.docs[i]

    def most_tokens(self, i: int) -> int | None:
        most = getattr(self.docs, "most_tokens", None)
        return None if most is None else most(i)

    def upto(self, i: int, limit: int):
        """`docs.upto(i, limit)` (see `lclm.data.kind.Documents`), or document i whole: what
        was read ahead where it answers that, else read now."""
        read = self._reads.pop(i, None)
        if read is not None:
            got = read[1].result()
            if not isinstance(got, Longer) or got.at_least > limit:
                return got
        upto = getattr(self.docs, "upto", None)
        return self.docs[i] if upto is None else upto(i, limit)

    def want(self, wanted: Iterable[tuple[int, int | None]]) -> None:
        """Read documents ahead, the soonest needed first: `(i, limit)` is document i where
        it has at most `limit` tokens (else a `Longer`: see `upto`), `(i, None)` document i
        whole; forget those read ahead that are no longer wanted (a read under way finishes
        unused)."""
        limits: dict[int, int | None] = {}
        for i, limit in wanted:  # readers that share these may want one document twice
            i, had = int(i), limits.get(int(i), limit)
            limits[i] = None if limit is None or had is None else max(had, limit)
        for i in [i for i in self._reads if i not in limits]:
            self._reads.pop(i)[1].cancel()
        upto = getattr(self.docs, "upto", None)
        for i, limit in limits.items():
            if i in self._reads and self._reads[i][0] in (None, limit):
                continue
            if i in self._reads:
                self._reads.pop(i)[1].cancel()
            if limit is None or upto is None:
                self._reads[i] = (None, self._pool.submit(self.docs.__getitem__, i))
            else:
                self._reads[i] = (limit, self._pool.submit(upto, i, limit))

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

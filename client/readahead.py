"""Read-ahead of the sequences a stream of units needs, several reads at a time.

A DataLoader worker (or the trainer process) knows, before it starts, every unit it will build
and so every sequence it will need, in order. :class:`ReadAhead` turns that into *reads* (one
``source.fetch`` call each) and runs up to ``threads`` of them at once, ahead of the unit that
first needs them, so one process decodes on several cores (decoding releases the GIL) and I/O
overlaps decoding and collation. A read is one whole block of ``block`` consecutive sequences
(``block > 1``: block or windowed shuffle, or a sequential stream), or the sequences first
needed by a group of ``group`` consecutive units (``block = 1``; see :func:`read_granularity`).
Each read is issued once, in the order of its first use, and dropped after its last: memory
holds the reads in use or read ahead, never the whole epoch. The records of a unit are exactly
the source's, so the stream does not depend on ``threads``.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from .errors import SourceError
from .sources import CacheSource

if TYPE_CHECKING:
    from logitcache.cache_format import Manifest, SequenceRecord

    from .config import StreamConfig

__all__ = ["ReadAhead", "default_read_threads", "read_granularity", "row_bytes"]

#: Items whose sequences one ``source.fetch`` call reads when reads follow the units (``block =
#: 1``): more give the source longer runs to merge and fewer calls, at the price of memory and
#: first-batch delay.
FETCH_ITEMS = 64

#: Sequences per read when ``shuffle=False`` (the order is the storage order: contiguous reads).
SEQUENTIAL_BLOCK = 64

#: Bytes per row from which a shuffled stream reads the sequences of each unit instead of whole
#: shuffle blocks (hidden rows at d >= 1024 in bfloat16; top-k rows below k = 256). Block reads
#: hold about ``lanes * window * block`` sequences at once: with ``TRAINER_SHUFFLE``, 3.6 GB of
#: top-k rows at k=100 but 37 GB of hidden rows at d=4096, while a hidden store's ~1 MiB inner
#: chunks make single-sequence reads cheap (benchmarks/results/loader.md).
UNIT_READ_ROW_BYTES = 2048


def default_read_threads(num_workers: int, cpus: int | None) -> int:
    """Read threads per iterating process: ``min(4, cpus // max(1, num_workers))``, at least 1.

    The trainer process (``num_workers = 0``) on a 16-core host gets 4; each of 8 DataLoader
    workers gets 2; 12 or more workers get 1 each.
    """
    return max(1, min(4, (cpus or 1) // max(1, num_workers)))


def row_bytes(manifest: Manifest) -> int:
    """Bytes of one row of the records a source returns for a cache with ``manifest``: a hidden
    cache's bfloat16 state (``2 d``, FORMAT.md 4.10), else ``k`` int32 ids and float32 logprobs
    plus a float32 tail."""
    hidden = getattr(manifest, "hidden", None)
    return 2 * int(hidden["dim"]) if hidden else 8 * int(manifest.k) + 4


def read_granularity(config: StreamConfig, row_size: int) -> tuple[int, int]:
    """``(block, group)`` of :class:`ReadAhead` for a stream ``config``
    (:class:`~logitcache.client.config.StreamConfig`) over rows of ``row_size`` bytes
    (:func:`row_bytes`): :data:`SEQUENTIAL_BLOCK` sequences per read unshuffled; whole shuffle
    blocks shuffled, unless the rows have :data:`UNIT_READ_ROW_BYTES` or more (then each read
    is the sequences of one unit) or the blocks are single sequences (then of the units of
    :data:`FETCH_ITEMS` items). The stream is the same whichever reads serve it."""
    unit = config.batch_size or 1
    if not config.shuffle:
        return SEQUENTIAL_BLOCK, 1
    if row_size >= UNIT_READ_ROW_BYTES:
        return 1, 1
    if config.shuffle_block_size > 1:
        return config.shuffle_block_size, 1
    return 1, max(1, FETCH_ITEMS // unit)


class ReadAhead:
    """Records for a fixed list of units, read ahead in a thread pool (module docstring).

    ``unit_seqs[u]``: sorted unique sequence indices unit ``u`` needs. ``records(u)`` must be
    called for ``u = 0, 1, ...`` in order; it returns ``{sequence: record}`` for unit ``u``.
    """

    def __init__(
        self,
        source: CacheSource,
        unit_seqs: Sequence[np.ndarray],
        *,
        block: int,
        num_sequences: int,
        threads: int = 1,
        ahead: int | None = None,
        group: int = 8,
    ) -> None:
        self.source = source
        self.threads = max(1, int(threads))
        self.ahead = max(self.threads + 1, 2 * self.threads if ahead is None else int(ahead))
        self._unit_reads: list[list[int]] = []
        self._reads: list[np.ndarray] = []  # sequence indices of each read, first-use order
        self._first_use: list[int] = []
        last_use: list[int] = []
        read_of: dict[int, int] = {}  # block id (block > 1) or sequence (block = 1) -> read
        for u, seqs in enumerate(unit_seqs):
            seqs = np.asarray(seqs, dtype=np.int64)
            keys = np.unique(seqs // block).tolist() if block > 1 else seqs.tolist()
            fresh = [k for k in keys if k not in read_of]
            if block > 1:
                for b in fresh:
                    read_of[b] = len(self._reads)
                    lo, hi = b * block, min((b + 1) * block, num_sequences)
                    self._reads.append(np.arange(lo, hi, dtype=np.int64))
                    self._first_use.append(u)
                    last_use.append(u)
            elif fresh:
                if self._reads and self._first_use[-1] // group == u // group:
                    r = len(self._reads) - 1  # same group of units: extend its read
                    self._reads[r] = np.concatenate([self._reads[r], fresh])
                else:
                    r = len(self._reads)
                    self._reads.append(np.asarray(fresh, dtype=np.int64))
                    self._first_use.append(u)
                    last_use.append(u)
                for s in fresh:
                    read_of[s] = r
            used = sorted({read_of[k] for k in keys})
            for r in used:
                last_use[r] = u
            self._unit_reads.append(used)
        self._drop_after: dict[int, list[int]] = {}
        for r, u in enumerate(last_use):
            self._drop_after.setdefault(u, []).append(r)
        self._futures: dict[int, Future] = {}
        self._done: dict[int, dict[int, SequenceRecord]] = {}
        self._next_read = 0
        self._pool: ThreadPoolExecutor | None = None

    def _fetch(self, r: int) -> dict[int, SequenceRecord]:
        seqs = self._reads[r]
        got = self.source.fetch(seqs)
        lost = [int(i) for i in seqs if int(i) not in got]
        if lost:
            raise SourceError(f"source did not return sequences {lost[:10]}")
        return got

    def _submit_up_to(self, u: int) -> None:
        """Issue every read first needed by units ``<= u`` and up to ``ahead`` reads beyond."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="logitcache-read")
        while self._next_read < len(self._reads):
            r = self._next_read
            in_flight = len(self._futures)
            if self._first_use[r] > u and in_flight >= self.ahead:
                break
            self._futures[r] = self._pool.submit(self._fetch, r)
            self._next_read += 1

    def records(self, u: int) -> dict[int, SequenceRecord]:
        """``{sequence: record}`` of every sequence unit ``u`` needs (units in order)."""
        self._submit_up_to(u)
        out: dict[int, SequenceRecord] = {}
        for r in self._unit_reads[u]:
            if r not in self._done:
                self._done[r] = self._futures.pop(r).result()
            out.update(self._done[r])
        for r in self._drop_after.get(u, ()):
            self._done.pop(r, None)
        self._submit_up_to(u)
        return out

    def close(self) -> None:
        """Cancel reads not started; running ones finish in the background."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._futures.clear()
        self._done.clear()

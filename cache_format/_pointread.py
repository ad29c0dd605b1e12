"""The NumPy decoder's chunk reads (FORMAT.md §6, D4): stored values of row ranges of the
format's sharded arrays, chunk by chunk in Python.

:func:`read` fetches exactly the inner chunks a call needs (:func:`._shardread.chunk_frames`)
and decodes each once, straight into the output when it lies inside one requested range, else
into a scratch chunk copied to each range that uses it. With a pool and ``threads > 1`` the
ranges are split at chunk edges by :func:`._plan.split` (at most :data:`MAX_SHARES` threads)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from . import _plan
from . import _shardread as shardread
from ._shardread import DirectLayout
from .errors import CorruptStoreError

PARALLEL_MIN_BYTES = 192 * 1024
"""The least work (bytes decoded, or read + written by a row block) one decode thread is given:
a call with less than twice this runs in the calling thread alone (a hand-off costs tens of
microseconds)."""

MAX_SHARES = 4
"""A call's work goes to at most this many threads (the calling thread included), whatever
``decode_threads``: about half of a read's CPU holds the GIL (the Python around each chunk,
CRC32C), so more threads only queue on it (benchmarks/results/format.md, random access)."""


Job = tuple[str, int, int]
"""``(array name, first entry, end entry)`` of one point-read range."""


Item = tuple[DirectLayout, int, "shardread.Frame | None", "np.ndarray | None", list]
"""One chunk decode of a point read: ``(layout, global chunk, frame, dest, targets)``: ``dest``
is the slice of an output the whole chunk decodes into, or ``None``: the chunk decodes into a
scratch chunk and its rows are copied to each ``(out, start, stop)`` range of ``targets``."""


def read(
    direct: dict[str, DirectLayout],
    jobs: list[Job],
    pool: ThreadPoolExecutor | None = None,
    threads: int = 1,
) -> list[np.ndarray]:
    """Stored values of each ``array[start:stop]`` of ``jobs`` (every array in ``direct``),
    each needed inner chunk fetched and decoded once. With a pool and ``threads > 1`` the jobs
    are split over up to ``threads`` (at most :data:`MAX_SHARES`) threads by
    :func:`._plan.split`, each reading and decoding its share."""
    outs: list[np.ndarray] = []
    for n, a, b in jobs:
        lay = direct[n]
        if not 0 <= a <= b <= lay.length:  # R6: never past the committed count
            raise CorruptStoreError(f"read of {n}[{a}:{b}] past the committed {lay.length} entries")
        outs.append(lay.empty(b - a))
    if pool is not None and threads > 1:
        lays = [direct[n] for n, _, _ in jobs]
        items = [(j, a, b, 0) for j, (_, a, b) in enumerate(jobs) if b > a]
        row_bytes = [lay.row_items * lay.dtype.itemsize for lay in lays]
        n_threads = min(threads, MAX_SHARES)
        groups = _plan.split(
            items, [lay.chunk_rows for lay in lays], row_bytes, n_threads, PARALLEL_MIN_BYTES
        )
        if len(groups) > 1:  # each thread reads (pread releases the GIL) and decodes its share

            def run(group: list[_plan.Item]) -> None:
                sub = [(jobs[j][0], a, b) for j, a, b, _ in group]
                _read_jobs(direct, sub, [outs[j][o : o + b - a] for j, a, b, o in group])

            _plan.run_groups(run, groups, pool)
            return outs
    _read_jobs(direct, jobs, outs)
    return outs


Plan = tuple[DirectLayout, list[int], list[list[int]]]
"""The chunks one array needs (sorted global chunk numbers) and, per chunk, the jobs using it."""


def _read_jobs(direct: dict[str, DirectLayout], jobs: list[Job], outs: list[np.ndarray]) -> None:
    """Fetch and decode the chunks of ``jobs`` into ``outs`` in this thread, each chunk once."""
    per: dict[str, list[int]] = {}
    for j, (n, a, b) in enumerate(jobs):
        if b > a:
            per.setdefault(n, []).append(j)
    plans: list[Plan] = []
    for n, js in per.items():
        lay = direct[n]
        cr = lay.chunk_rows
        if len(js) == 1:
            _, a, b = jobs[js[0]]
            chunks = list(range(a // cr, (b - 1) // cr + 1))
            plans.append((lay, chunks, [js] * len(chunks)))
            continue
        need: dict[int, list[int]] = {}
        for j in js:
            _, a, b = jobs[j]
            for g in range(a // cr, (b - 1) // cr + 1):
                need.setdefault(g, []).append(j)
        chunks = sorted(need)
        plans.append((lay, chunks, [need[g] for g in chunks]))
    _decode_items(_items(plans, shardread.chunk_frames([p[:2] for p in plans]), jobs, outs))


def _items(
    plans: list[Plan],
    frames: list[list[shardread.Frame | None]],
    jobs: list[Job],
    outs: list[np.ndarray],
) -> list[Item]:
    """The decode :data:`Item` of every chunk of ``plans``."""
    items: list[Item] = []
    for (lay, chunks, users), fr in zip(plans, frames, strict=True):
        cr = lay.chunk_rows
        for g, frame, js in zip(chunks, fr, users, strict=True):
            r0 = g * cr
            if len(js) == 1:
                j = js[0]
                _, a, b = jobs[j]
                if a <= r0 and r0 + cr <= b:  # the chunk lies inside the one range using it
                    items.append((lay, g, frame, outs[j][r0 - a : r0 + cr - a], []))
                    continue
            items.append((lay, g, frame, None, [(outs[j], jobs[j][1], jobs[j][2]) for j in js]))
    return items


def _decode_items(items: list[Item]) -> None:
    """Decode every item (see :data:`Item`)."""
    for lay, g, frame, dest, targets in items:
        cr = lay.chunk_rows
        r0 = g * cr
        if dest is not None:
            shardread.decode_frame(lay, frame, g, dest, (r0, r0 + cr))
            continue
        scratch = _scratch(lay)
        lo = min(max(a, r0) for _, a, _ in targets)
        hi = max(min(b, r0 + cr) for _, _, b in targets)
        shardread.decode_frame(lay, frame, g, scratch, (lo, hi))
        for out, a, b in targets:
            x, y = max(a, r0), min(b, r0 + cr)
            out[x - a : y - a] = scratch[x - r0 : y - r0]


_local = threading.local()


def _scratch(lay: DirectLayout) -> np.ndarray:
    """This thread's scratch chunk for ``lay``'s chunk shape (reused: a decode copies out of it
    before the thread decodes another chunk)."""
    cache = getattr(_local, "scratch", None)
    if cache is None:
        cache = _local.scratch = {}
    key = (lay.dtype.str, lay.chunk_rows, lay.inner)
    buf = cache.get(key)
    if buf is None:
        buf = cache[key] = lay.empty(lay.chunk_rows)
    return buf

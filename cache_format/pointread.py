"""Point reads: whole sequences by index, the path of ``CacheReader.sequence`` / ``sequences``
(FORMAT.md §6, D4).

A random sequence needs a few inner chunks of each row array and of ``input_ids``. This module
reads exactly those (:func:`.shardread.chunk_frames`: ``os.pread`` on a local store, no event
loop), decodes every needed chunk once per call, straight into the output when the chunk lies
inside one requested range (else into a scratch chunk copied to each range that uses it), and
then decodes the logprobs (row-delta inverse, float16 -> float32) in row blocks. With a thread
pool, the chunk decodes of at least :data:`PARALLEL_MIN_BYTES` run in parallel (blosc releases
the GIL; ``google_crc32c`` and the Python around each task do not, so small tasks stay in the
calling thread); the values do not depend on it.

The row-block kernels use torch (when :mod:`.kernels` selects it) on blocks of at most
:data:`BLOCK_ELEMENTS` elements: below torch's intra-op grain size every call runs serially in
the calling thread, vectorised (about 2x faster than numpy's cumulative sum along short rows and
6x faster than its float16 cast, measured), with no thread start-up.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from . import kernels, shardread
from .errors import CorruptStoreError
from .shardread import DirectLayout

BLOCK_ELEMENTS = 32_000
"""Elements per row-block kernel call (below torch's intra-op grain size of 32,768)."""

PARALLEL_MIN_BYTES = 192 * 1024
"""Only tasks that decode at least this many bytes run on the decode threads: smaller ones (the
``random_access`` preset's 100 KB chunks of 256 rows, the logprob row blocks) hold the GIL for
too large a share of their time, and threads made them slower (benchmarks/results/client.md,
random access); they run in the calling thread."""

Job = tuple[str, int, int]
"""``(array name, first entry, end entry)`` of one point-read range."""


def run_tasks(
    tasks: list[Callable[[], None]], cost: list[int], pool: ThreadPoolExecutor | None, n: int
) -> None:
    """Run ``tasks`` (``cost``: bytes each decodes). With a pool and ``n > 1``, the tasks of at
    least :data:`PARALLEL_MIN_BYTES` go in ``n`` balanced groups (longest first), ``n - 1`` of
    them on the pool; the calling thread runs the first group and every smaller task."""
    big = [i for i, c in enumerate(cost) if c >= PARALLEL_MIN_BYTES]
    if pool is None or n <= 1 or len(big) <= 1:
        for t in tasks:
            t()
        return
    groups: list[list[Callable[[], None]]] = [[] for _ in range(min(n, len(big)))]
    load = [0] * len(groups)
    for i in sorted(big, key=lambda i: -cost[i]):
        g = load.index(min(load))
        groups[g].append(tasks[i])
        load[g] += cost[i]
    small = set(range(len(tasks))).difference(big)
    groups[0] += [tasks[i] for i in sorted(small)]

    def run(group: list[Callable[[], None]]) -> None:
        for t in group:
            t()

    futures = [pool.submit(run, g) for g in groups[1:]]
    err: BaseException | None = None
    try:
        run(groups[0])  # the calling thread takes a share
    except BaseException as e:
        err = e
    for f in futures:  # every group finishes before the caller sees its buffers or an error
        failed = f.exception()
        err = err or failed
    if err is not None:
        raise err


def read(
    direct: dict[str, DirectLayout],
    jobs: list[Job],
    pool: ThreadPoolExecutor | None = None,
    threads: int = 1,
) -> list[np.ndarray]:
    """Stored values of each ``array[start:stop]`` of ``jobs`` (every array in ``direct``),
    each needed inner chunk fetched and decoded once."""
    outs = [direct[n].empty(b - a) for n, a, b in jobs]
    need: dict[str, dict[int, list[int]]] = {}
    for j, (n, a, b) in enumerate(jobs):
        if not 0 <= a <= b <= direct[n].length:  # R6: never past the committed count
            raise CorruptStoreError(
                f"read of {n}[{a}:{b}] past the committed {direct[n].length} entries"
            )
        if b > a:
            cr = direct[n].chunk_rows
            per = need.setdefault(n, {})
            for g in range(a // cr, (b - 1) // cr + 1):
                per.setdefault(g, []).append(j)
    names = list(need)
    frames = shardread.chunk_frames([(direct[n], need[n].keys()) for n in names])
    tasks: list[Callable[[], None]] = []
    cost: list[int] = []
    for n, fr in zip(names, frames, strict=True):
        lay = direct[n]
        nbytes = lay.chunk_rows * lay.row_items * lay.dtype.itemsize
        for g, js in need[n].items():
            tasks.append(_decode_task(lay, g, fr[g], [(outs[j], *jobs[j][1:]) for j in js]))
            cost.append(nbytes)
    run_tasks(tasks, cost, pool, threads)
    return outs


def _decode_task(
    lay: DirectLayout, g: int, frame: np.ndarray | None, targets: list[tuple[np.ndarray, int, int]]
) -> Callable[[], None]:
    """Decode chunk ``g`` into the ranges ``(out, start, stop)`` that use it."""
    cr = lay.chunk_rows
    r0, r1 = g * cr, (g + 1) * cr
    lo = min(max(a, r0) for _, a, _ in targets)
    hi = max(min(b, r1) for _, _, b in targets)

    whole = len(targets) == 1 and targets[0][1] <= r0 and r1 <= targets[0][2]

    def task() -> None:
        if whole:  # the chunk lies inside the one range that uses it: decode in place
            out, a, _ = targets[0]
            shardread.decode_frame(lay, frame, g, out[r0 - a : r1 - a], (lo, hi))
            return
        scratch = _scratch(lay)
        shardread.decode_frame(lay, frame, g, scratch, (lo, hi))
        for out, a, b in targets:
            x, y = max(a, r0), min(b, r1)
            out[x - a : y - a] = scratch[x - r0 : y - r0]

    return task


_local = threading.local()


def _scratch(lay: DirectLayout) -> np.ndarray:
    """This thread's scratch chunk for ``lay``'s chunk shape (reused: a decode task copies out of
    it before the thread runs another)."""
    cache = getattr(_local, "scratch", None)
    if cache is None:
        cache = _local.scratch = {}
    key = (lay.dtype.str, lay.chunk_rows, lay.inner)
    buf = cache.get(key)
    if buf is None:
        buf = cache[key] = lay.empty(lay.chunk_rows)
    return buf


# --------------------------------------------------------------------------- row-block kernels
def row_blocks(rows: int, k: int) -> list[tuple[int, int]]:
    """``[(a, b), ...]`` row blocks of at most :data:`BLOCK_ELEMENTS` elements covering ``rows``."""
    step = max(1, BLOCK_ELEMENTS // max(1, k))
    return [(a, min(a + step, rows)) for a in range(0, rows, step)]


_SIGNED = {
    np.dtype(np.uint8): np.int8,
    np.dtype(np.uint16): np.int16,
    np.dtype(np.uint32): np.int32,
}


def undelta_block(d: np.ndarray) -> None:
    """In place: ``d[:, j] = d[:, 0] + ... + d[:, j]`` modulo ``2**bits`` (FORMAT.md 4.2) for a
    C-contiguous unsigned ``[m, k]`` block of at most :data:`BLOCK_ELEMENTS` elements."""
    torch = kernels._torch()
    if torch is None:
        np.cumsum(d, axis=1, dtype=d.dtype, out=d)
        return
    t = torch.from_numpy(d.view(_SIGNED[d.dtype]))
    t.copy_(torch.cumsum(t, 1, dtype=t.dtype))


def widen_block(h: np.ndarray, out: np.ndarray) -> None:
    """``out[...] = h`` (exact float16 -> float32) for a block of at most
    :data:`BLOCK_ELEMENTS` elements."""
    torch = kernels._torch()
    if torch is None:
        np.copyto(out, h, casting="same_kind")
        return
    torch.from_numpy(out).copy_(torch.from_numpy(h))

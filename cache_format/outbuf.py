"""Large read outputs without transparent huge pages (issue #14).

numpy asks the kernel for transparent huge pages (``madvise(MADV_HUGEPAGE)``) for every array of
4 MiB or more. Where THP defragmentation is ``madvise`` (the 2-core VM: ``defrag`` =
``[madvise]``), the first write to such an array can stall on memory compaction and zero whole
2 MiB pages, in system time that comes and goes with the machine's memory state: a loader
fetching 64-sequence blocks spent 8-9 s of system time per 157 batches with its outputs from
numpy, 1.4-1.6 s without (session 8; the job process turns numpy's requests off for the same
reason, ``server/jobs.py::numpy_hugepages_off``). A library should not change numpy's global
setting, so the reader allocates its own large outputs here: an anonymous mapping (4 KiB pages,
faulted in as they are written, unmapped when the last view of the array is gone).
"""

from __future__ import annotations

import math
import mmap

import numpy as np

HUGEPAGE_BYTES = 4 << 20
"""numpy's threshold for its huge-page request (``numpy/_core/src/multiarray/alloc.c``)."""


def empty(shape: int | tuple[int, ...], dtype: np.dtype | type | str = np.uint8) -> np.ndarray:
    """An uninitialised C-contiguous array: numpy's below :data:`HUGEPAGE_BYTES`, an anonymous
    mapping from there (contents then zero, as the kernel maps them)."""
    dt = np.dtype(dtype)
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = math.prod(dims) * dt.itemsize
    if nbytes < HUGEPAGE_BYTES:
        return np.empty(dims, dtype=dt)
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=dt).reshape(dims)

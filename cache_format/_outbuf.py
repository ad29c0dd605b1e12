"""Large read outputs without transparent huge pages.

numpy asks for transparent huge pages (``madvise(MADV_HUGEPAGE)``) for every array of 4 MiB or
more; where THP defragmentation is ``madvise``, the first write to such memory can stall on
compaction, in system time. A library should not change numpy's global setting, so the reader
takes its large outputs from here: numpy's allocation with the request withdrawn at once
(``MADV_NOHUGEPAGE``, before anything is written)."""

from __future__ import annotations

import ctypes
import math
import mmap
from typing import Any

import numpy as np

HUGEPAGE_BYTES = 4 << 20
"""numpy's threshold for its huge-page request (``numpy/_core/src/multiarray/alloc.c``)."""

_PAGE = mmap.PAGESIZE
_MADV_NOHUGEPAGE = 15  # linux/mman.h
_madvise: Any = None
try:
    _madvise = ctypes.CDLL(None, use_errno=True).madvise
    _madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    _madvise.restype = ctypes.c_int
except (AttributeError, OSError):  # not Linux/glibc: nothing to withdraw
    _madvise = None


def empty(shape: int | tuple[int, ...], dtype: np.dtype | type | str = np.uint8) -> np.ndarray:
    """An uninitialised C-contiguous numpy array; from :data:`HUGEPAGE_BYTES` on, its whole pages
    advised ``MADV_NOHUGEPAGE`` (numpy's huge-page request withdrawn) before it is returned."""
    dt = np.dtype(dtype)
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    out = np.empty(dims, dtype=dt)
    nbytes = math.prod(dims) * dt.itemsize
    if nbytes >= HUGEPAGE_BYTES and _madvise is not None:
        start = -(-out.ctypes.data // _PAGE) * _PAGE
        end = (out.ctypes.data + nbytes) // _PAGE * _PAGE
        if end > start:
            _madvise(start, end - start, _MADV_NOHUGEPAGE)  # advice only: errors are ignored
    return out

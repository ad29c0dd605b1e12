"""The C functions a compiled read calls (FORMAT.md R7, D2, D4): ``crc32c_value`` of the libcrc32c
that ``google_crc32c``'s extension links and ``blosc_decompress_ctx`` that ``numcodecs``' blosc
extension exports, found once at import through :mod:`ctypes` and checked on a known frame
against the Python wrappers. :data:`FOUND` says whether both were found (without them the reader
decodes with NumPy)."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np


def _load() -> tuple[Any, Any] | None:
    """``(crc32c_value, blosc_decompress_ctx)`` as ctypes functions, or ``None``."""
    try:
        import google_crc32c
        import numcodecs.blosc

        if getattr(google_crc32c, "implementation", "c") != "c":
            return None
        from google_crc32c import _crc32c

        crc = ctypes.CDLL(_crc32c.__file__).crc32c_value
        dec = ctypes.CDLL(numcodecs.blosc.__file__).blosc_decompress_ctx
    except (ImportError, OSError, AttributeError):
        return None
    crc.restype = ctypes.c_uint32
    crc.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    dec.restype = ctypes.c_int
    dec.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    # self-check on a known frame: the symbols must compute what the wrappers do
    probe = np.arange(64, dtype=np.int32)
    frame = np.frombuffer(numcodecs.blosc.compress(probe, b"lz4", 5, 1), dtype=np.uint8)
    out = np.empty_like(probe)
    if crc(frame.ctypes.data, frame.size) != google_crc32c.value(frame):
        return None
    if dec(frame.ctypes.data, out.ctypes.data, out.nbytes, 1) != out.nbytes:
        return None
    if not np.array_equal(out, probe):
        return None
    return crc, dec


FUNCS = _load()
"""``(crc32c_value, blosc_decompress_ctx)`` as ctypes functions, or ``None``."""

FOUND = FUNCS is not None
"""Whether both C functions were found."""

"""GIL-free checks and decompression of inner chunks (FORMAT.md R7, D2, D4; issue #14).

A point read's CPU is the CRC32C and blosc decompression of a few inner chunks plus Python
around them. The Python functions of the two installed wheels hold the GIL for that work on our
chunk sizes: ``google_crc32c.value`` releases it only for ``bytes`` of at least 1 MiB (its C
source, version 1.9: ``gil_threshold``; the reader passes numpy views, never released), and
``numcodecs.blosc.decompress`` runs its C call without the GIL but wraps it in Python (buffer
checks, and in the main thread blosc's global context under a lock). So threads decoding the
chunks of one call mostly queued on the GIL (benchmarks/results/client.md, random access).

This module calls the same C functions that those wheels carry, through :mod:`ctypes` (which
releases the GIL for the duration of every foreign call): ``crc32c_value`` of the libcrc32c that
``google_crc32c``'s extension links, and ``blosc_decompress_ctx`` (one internal thread, no
global state, safe from any thread) that ``numcodecs``' blosc extension exports. The values and
checks are those of the Python wrappers (tests/test_cdecode.py compares both on every frame
kind); what changes is that a thread spends its chunk's CRC and decompression outside the GIL,
and the per-chunk Python is a few hundred nanoseconds per call.

:data:`FOUND` says whether both symbols were found (``False`` with another build of the wheels,
or ``google_crc32c``'s pure-Python fallback). The reader uses this module only where
``LOGITCACHE_NOGIL=1`` is set (:data:`AVAILABLE`): measured on the 16-core H200 box (gVisor),
decode threads did not gain from it (a hand-off costs 23-34 us there and threads raised the CPU
per sequence 2-3x with or without the GIL), and on one thread it costs 2-4% more CPU than the
wrappers on the 2-core VM (``frame.ctypes.data`` and ctypes argument conversion;
benchmarks/results/client.md, session 6). Otherwise :mod:`.shardread` decodes through the
wrappers (same values, same errors).
"""

from __future__ import annotations

import ctypes
import os
import struct
from typing import Any, cast

import numpy as np

_U32 = struct.Struct("<I")
_HEADER = struct.Struct("<III")  # nbytes, blocksize, cbytes: bytes 4..16 of a blosc frame
BLOSC_HEADER = 16


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


_FUNCS = _load()
FOUND = _FUNCS is not None
"""Whether the GIL-free functions were found (else :func:`decode` must not be called)."""

AVAILABLE = FOUND and os.environ.get("LOGITCACHE_NOGIL", "0").strip().lower() in ("1", "true")
"""Whether the reader decodes through this module (``LOGITCACHE_NOGIL=1`` and :data:`FOUND`)."""


def decode(frame: np.ndarray, dest: np.ndarray) -> str | None:
    """Check the stored bytes of one inner chunk (``frame``: a blosc frame followed by its
    CRC32C, uint32 LE; C-contiguous uint8) and decompress it into ``dest`` (C-contiguous,
    writeable, exactly the chunk's decoded size). Returns why it cannot (the message of a
    :class:`~.errors.ChecksumError`), else ``None``. The CRC32C and the decompression run
    without the GIL."""
    assert _FUNCS is not None
    crc, dec = _FUNCS
    size = frame.size
    if size < 4 or not frame.flags.c_contiguous:
        return "chunk fails its CRC32C"
    ptr = frame.ctypes.data
    raw = cast(Any, frame)  # a numpy array is a buffer (numpy's stubs do not say so)
    if crc(ptr, size - 4) != _U32.unpack_from(raw, size - 4)[0]:
        return "chunk fails its CRC32C"
    nbytes = dest.nbytes
    if size < BLOSC_HEADER + 4:
        return "chunk shorter than a blosc header"
    got, _blocksize, cbytes = _HEADER.unpack_from(raw, 4)
    if got != nbytes or cbytes != size - 4:
        return f"blosc frame of {got} bytes, expected {nbytes}"
    if not (dest.flags.c_contiguous and dest.flags.writeable):
        raise ValueError("decode: dest must be C-contiguous and writeable")
    done = dec(ptr, dest.ctypes.data, nbytes, 1)
    if done != nbytes:
        return f"blosc frame does not decompress ({done})"
    return None

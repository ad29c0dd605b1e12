"""The C functions a compiled read calls (``cache_format/cdecode.py``): through ctypes they must
compute the CRC32C and decompression of the Python wrappers on every frame kind, from many
threads at once."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import google_crc32c
import numcodecs.blosc
import numpy as np
import pytest
from logitcache.cache_format import _cdecode as cdecode

pytestmark = pytest.mark.skipif(not cdecode.FOUND, reason="cdecode symbols not found")


def _frame(data: np.ndarray, cname: bytes, shuffle: int) -> np.ndarray:
    return np.frombuffer(numcodecs.blosc.compress(data, cname, 5, shuffle), np.uint8)


def _cases() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(3)
    out = []
    for dtype in (np.int32, np.uint16, np.float32, np.uint8):
        data = (rng.zipf(1.3, size=(97, 13)) % 251).astype(dtype)
        for cname in (b"lz4", b"zstd", b"blosclz"):
            for shuffle in (numcodecs.blosc.NOSHUFFLE, numcodecs.blosc.SHUFFLE, 2):
                out.append((data, _frame(data, cname, shuffle)))
    return out


def _decode(frame: np.ndarray, dest: np.ndarray) -> tuple[int, int]:
    assert cdecode.FUNCS is not None
    crc, dec = cdecode.FUNCS
    return crc(frame.ctypes.data, frame.size), dec(
        frame.ctypes.data, dest.ctypes.data, dest.nbytes, 1
    )


def test_values_equal_the_wrappers():
    for data, frame in _cases():
        dest = np.full_like(data, 77)
        crc, done = _decode(frame, dest)
        assert crc == google_crc32c.value(frame) and done == data.nbytes
        ref = np.empty_like(data)
        numcodecs.blosc.decompress(frame, ref)
        assert np.array_equal(dest, data) and np.array_equal(dest, ref)


def test_a_flipped_byte_changes_the_crc():
    data, frame = _cases()[0]
    bad = frame.copy()
    bad[len(bad) // 2] ^= 0x10
    assert _decode(bad, np.empty_like(data))[0] == google_crc32c.value(bad)
    assert google_crc32c.value(bad) != google_crc32c.value(frame)


def test_many_threads_decode_the_same_values():
    """Each thread decodes other frames at the same time: no shared state (blosc's
    ``_ctx`` function, a private context per call), every output exact."""
    cases = _cases() * 8

    def one(i: int) -> bool:
        data, frame = cases[i]
        dest = np.empty_like(data)
        return _decode(frame, dest)[1] == data.nbytes and np.array_equal(dest, data)

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(one, range(len(cases))))

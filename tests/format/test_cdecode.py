"""GIL-free chunk decode (``cache_format/cdecode.py``, issue #14; opt-in, ``LOGITCACHE_NOGIL=1``):
the C functions of the installed wheels through ctypes must give the values and errors of the
Python wrappers, from any number of threads at once, and a reader using them reads the same
values as one using the wrappers."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import google_crc32c
import numcodecs.blosc
import numpy as np
import pytest
from logitcache.cache_format import cdecode, shardread

pytestmark = pytest.mark.skipif(not cdecode.FOUND, reason="cdecode symbols not found")


def _frame(data: np.ndarray, cname: bytes, shuffle: int) -> np.ndarray:
    body = numcodecs.blosc.compress(data, cname, 5, shuffle)
    return np.frombuffer(body + google_crc32c.value(body).to_bytes(4, "little"), np.uint8)


def _cases() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(3)
    out = []
    for dtype in (np.int32, np.uint16, np.float32, np.uint8):
        data = (rng.zipf(1.3, size=(97, 13)) % 251).astype(dtype)
        for cname in (b"lz4", b"zstd", b"blosclz"):
            for shuffle in (numcodecs.blosc.NOSHUFFLE, numcodecs.blosc.SHUFFLE, 2):
                out.append((data, _frame(data, cname, shuffle)))
    return out


def test_values_equal_the_wrappers():
    for data, frame in _cases():
        dest = np.full_like(data, 77)
        assert cdecode.decode(frame, dest) is None
        ref = np.empty_like(data)
        numcodecs.blosc.decompress(frame[:-4], ref)
        assert np.array_equal(dest, data) and np.array_equal(dest, ref)


def test_errors_equal_the_wrappers():
    data, frame = _cases()[0]
    dest = np.empty_like(data)
    bad = frame.copy()
    bad[len(bad) // 2] ^= 0x10
    for f in (bad, frame[:3], frame[:-1]):
        assert cdecode.decode(f, dest) == shardread._frame_error(f, dest.nbytes)
        assert cdecode.decode(f, dest) == "chunk fails its CRC32C"
    wrong = np.empty(data.size + 1, data.dtype)
    assert cdecode.decode(frame, wrong) == shardread._frame_error(frame, wrong.nbytes)
    # a frame whose CRC32C holds but whose blosc header is cut short
    short = np.frombuffer(
        frame[:10].tobytes() + google_crc32c.value(frame[:10]).to_bytes(4, "little"), np.uint8
    )
    assert cdecode.decode(short, dest) == "chunk shorter than a blosc header"
    with pytest.raises(ValueError, match="C-contiguous"):
        cdecode.decode(frame, np.empty((data.shape[1], data.shape[0]), data.dtype).T)


def test_many_threads_decode_the_same_values():
    """Each thread decodes other frames at the same time: no shared state (blosc's
    ``_ctx`` function, a private context per call), every output exact."""
    cases = _cases() * 8

    def one(i: int) -> bool:
        data, frame = cases[i]
        dest = np.empty_like(data)
        return cdecode.decode(frame, dest) is None and np.array_equal(dest, data)

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(one, range(len(cases))))


@pytest.mark.parametrize("nogil", ["0", "1"])
def test_reader_reads_the_same_values_either_way(tmp_path: Path, nogil: str):
    """A reader in a process with ``LOGITCACHE_NOGIL=1`` (cdecode) or ``0`` (the wrappers)
    gives the values of this process's reader."""
    from format_support import make_manifest, make_records
    from logitcache.cache_format import CacheReader, CacheWriter

    url = tmp_path / "c"
    recs = make_records(12, k=5, vocab=200, seed=5, min_len=2, max_len=30)
    with CacheWriter.open(url, make_manifest(k=5, vocab_size=200)) as w:
        w.append(recs)
    code = (
        "import sys; from logitcache.cache_format import CacheReader, cdecode;"
        "assert cdecode.AVAILABLE == (sys.argv[3] == '1'); r = CacheReader(sys.argv[1]);"
        "import numpy as np; np.save(sys.argv[2], np.concatenate("
        "[r.sequence(i).topk_logprobs.ravel() for i in range(len(r))]))"
    )
    env = dict(os.environ, LOGITCACHE_NOGIL=nogil)
    out = tmp_path / "lp.npy"
    subprocess.run([sys.executable, "-c", code, str(url), str(out), nogil], check=True, env=env)
    r = CacheReader(url)
    here = np.concatenate([r.sequence(i).topk_logprobs.ravel() for i in range(len(r))])
    assert np.array_equal(np.load(out), here)

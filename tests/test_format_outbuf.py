"""``cache_format/outbuf.py``: large read outputs are anonymous mappings (numpy would request
transparent huge pages for them), small ones numpy's; both are plain writable C arrays."""

from __future__ import annotations

import gc
import mmap

import numpy as np
from logitcache.cache_format import outbuf, shardread


def _owner(a):
    while isinstance(a, np.ndarray) and a.base is not None:
        a = a.base
    return a.obj if isinstance(a, memoryview) else a


def test_large_outputs_are_mappings_small_ones_numpys():
    small = outbuf.empty((16, 100), np.float32)
    assert small.base is None and small.shape == (16, 100) and small.dtype == np.float32
    big = outbuf.empty((outbuf.HUGEPAGE_BYTES // 256, 64), np.int32)
    assert isinstance(_owner(big), mmap.mmap) and big.flags.c_contiguous and big.flags.writeable
    assert big.nbytes == outbuf.HUGEPAGE_BYTES
    big[-1] = 7
    view = big[-2:].view(np.uint8)
    below = outbuf.empty(outbuf.HUGEPAGE_BYTES - 1)
    assert below.base is None
    del big
    gc.collect()
    assert view[-1, -4:].view(np.int32)[0] == 7  # a view keeps the mapping alive


def test_the_readers_blocks_come_from_here(tmp_path):
    from logitcache.cache_format import CacheReader
    from test_format_random_access import SMALL, _write

    _write(tmp_path / "c", SMALL)
    lay = CacheReader(tmp_path / "c")._direct["topk_ids"]
    assert isinstance(lay, shardread.DirectLayout)
    assert isinstance(_owner(lay.empty(outbuf.HUGEPAGE_BYTES // 24 + 1)), mmap.mmap)
    assert lay.empty(3).base is None

"""``cache_format/outbuf.py``: large read outputs are numpy arrays whose pages carry
``MADV_NOHUGEPAGE`` (numpy's transparent-huge-page request withdrawn before any write); small
ones are plain numpy arrays. Checked in the kernel's own view of the memory
(``/proc/self/smaps`` VmFlags: ``nh`` = no huge pages, ``hg`` = huge pages advised)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from logitcache.cache_format import _outbuf as outbuf
from logitcache.cache_format import _shardread as shardread

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="madvise flags are Linux's")


def _vm_flags(address: int) -> set[str]:
    """VmFlags of the mapping holding ``address``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_large_outputs_withdraw_the_huge_page_request():
    big = outbuf.empty((outbuf.HUGEPAGE_BYTES // 256, 64), np.int32)
    assert big.nbytes == outbuf.HUGEPAGE_BYTES and big.flags.c_contiguous and big.flags.writeable
    middle = big.ctypes.data + big.nbytes // 2
    assert "nh" in _vm_flags(middle) and "hg" not in _vm_flags(middle)
    small = outbuf.empty((16, 100), np.float32)
    assert small.shape == (16, 100) and small.dtype == np.float32


def test_the_readers_blocks_come_from_here(tmp_path):
    from format_support import SMALL, write_small_cache
    from logitcache.cache_format import CacheReader

    write_small_cache(tmp_path / "c", SMALL)
    lay = CacheReader(tmp_path / "c")._opened.direct["topk_ids"]
    assert isinstance(lay, shardread.DirectLayout)
    block = lay.empty(outbuf.HUGEPAGE_BYTES // 24 + 1)
    assert "nh" in _vm_flags(block.ctypes.data + block.nbytes // 2)

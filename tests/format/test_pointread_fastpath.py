"""Point reads (issue #14): open shard files kept per layout, reads split over decode threads.

``shardread.OpenShards`` keeps up to ``FD_CACHE`` shard files open per layout (closed when the
reader drops the layout); ``pointread.read`` with decode threads cuts the needed chunks into
pieces that each thread reads (``pread``) and decodes. Values must equal the range path in every
case; an open file must never hand a reader rows from another version of the store than its
snapshot allows; errors from a thread are the same typed errors.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import numpy as np
import pytest
from format_support import ZarrReader, make_manifest, make_records
from logitcache.cache_format import CacheReader, CacheWriter, Layout
from logitcache.cache_format import _pointread as pointread
from logitcache.cache_format import _shardread as shardread
from logitcache.cache_format.errors import ChecksumError

# 8-row chunks, 32-row shards: the 40 sequences of 2..40 tokens span many shards of every array
SMALL = Layout(row_chunk=8, row_shard=32, token_chunk=16, token_shard=64, seq_chunk=4, seq_shard=8)
K = 6


def _write(url: Path, n: int = 40, seed: int = 11, prefix: str = "s") -> list:
    recs = make_records(n, k=K, vocab=300, seed=seed, min_len=2, max_len=40, prefix=prefix)
    with CacheWriter.open(url, make_manifest(k=K, vocab_size=300), layout=SMALL) as w:
        w.append(recs)
    return recs


def _open_under(root: Path) -> list[str]:
    """Files under ``root`` this process has open."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(root)):
            out.append(target)
    return out


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
def test_open_shards_are_capped_and_closed_with_the_layouts(tmp_path, monkeypatch):
    monkeypatch.setattr(shardread, "FD_CACHE", 2)
    url = tmp_path / "c"
    recs = _write(url)
    r = CacheReader(url)
    ranged = ZarrReader(url)
    for i in range(len(recs)):  # every shard of every array, in order
        assert r.sequence(i).equals(ranged.sequence(i))
    for lay in r._opened.direct.values():
        assert len(lay.fds.fds) <= 2
    kept = r._opened.direct["topk_ids"].fds.fds
    assert len(kept) == 2 and _open_under(url)
    del r, ranged, lay, kept
    gc.collect()
    assert _open_under(url) == []  # dropping the reader closed every kept file


def test_open_files_of_all_readers_stay_within_the_process_budget(tmp_path, monkeypatch):
    url = tmp_path / "c"
    recs = _write(url)
    before = shardread._kept[0]
    monkeypatch.setattr(shardread, "FD_BUDGET", before + 3)
    readers = [CacheReader(url), CacheReader(url)]
    for r in readers:
        got = r.sequences(range(len(recs)))  # every shard of every array
        assert all(np.array_equal(g.topk_ids, x.topk_ids) for g, x in zip(got, recs, strict=True))
    kept = sum(len(lay.fds.fds) for r in readers for lay in r._opened.direct.values())
    assert kept == 3 and shardread._kept[0] == before + 3
    del readers, r
    gc.collect()
    assert shardread._kept[0] == before


def test_kept_files_serve_the_snapshot_across_appends(tmp_path):
    """A writer's append replaces the partly filled shards after the reader kept them open:
    the old snapshot still reads its rows; after ``refresh`` the new rows are read too."""
    url = tmp_path / "c"
    recs = _write(url)
    r = CacheReader(url, decode_threads=2)
    last = len(recs) - 1
    before = r.sequences(range(len(recs)))  # keeps the last (partial) shards open
    more = make_records(6, k=K, vocab=300, seed=13, prefix="u")
    with CacheWriter.open(url, make_manifest(k=K, vocab_size=300)) as w:
        w.append(more)
    again = r.sequences([last, 0, last])
    for g in again:
        want = before[last] if g.key == recs[last].key else before[0]
        assert g.equals(want)
    assert r.refresh()
    got = r.sequences([len(recs) + 5, last])
    assert np.array_equal(got[0].topk_ids, more[5].topk_ids)
    assert np.array_equal(got[0].input_ids, more[5].input_ids)
    assert got[1].equals(before[last])


@pytest.mark.parametrize("min_bytes", [1, 64, 10**9])
@pytest.mark.parametrize("threads", [2, 5])
def test_threaded_pieces_equal_the_serial_read(tmp_path, monkeypatch, min_bytes, threads):
    """Whatever the share size (one chunk per piece .. no threads at all), the values are the
    serial point read's and the range path's."""
    monkeypatch.setattr(pointread, "PARALLEL_MIN_BYTES", min_bytes)
    url = tmp_path / "c"
    recs = _write(url)
    threaded = CacheReader(url, decode_threads=threads)
    serial = CacheReader(url)
    ranged = ZarrReader(url)
    idx = [5, 3, 5, 39, 0, 22, 21, 22, 38, 1]
    for a, b, c in zip(
        threaded.sequences(idx), serial.sequences(idx), ranged.sequences(idx), strict=True
    ):
        assert a.equals(b) and a.equals(c)
    for i in (0, 17, 39):
        assert threaded.sequence(i).equals(ranged.sequence(i))
    every = threaded.sequences(range(len(recs)))
    assert [g.key for g in every] == [x.key for x in recs]
    assert all(np.array_equal(g.topk_ids, x.topk_ids) for g, x in zip(every, recs, strict=True))


def test_a_damaged_chunk_read_by_a_thread_is_a_checksum_error(tmp_path, monkeypatch):
    monkeypatch.setattr(pointread, "PARALLEL_MIN_BYTES", 1)  # one chunk per piece, on threads
    url = tmp_path / "c"
    _write(url)
    shard = url / "topk_logprobs" / "c" / "0" / "0"
    raw = bytearray(shard.read_bytes())
    raw[12] ^= 0x55  # inside chunk 0
    shard.write_bytes(bytes(raw))
    r = CacheReader(url, decode_threads=4)
    with pytest.raises(ChecksumError, match="topk_logprobs shard 0 chunk 0"):
        r.sequences([0, 30, 20])
    assert r.sequence(39).key  # other shards still read


def test_logprob_blocks_split_over_at_most_max_shares_threads(monkeypatch):
    """The NumPy decoder's row blocks (row-delta inverse, widening, id remap) go through the one
    chunk planner: at most ``MAX_SHARES`` groups, nothing split below the share size, and the
    values of the serial decode."""
    from concurrent.futures import ThreadPoolExecutor

    from logitcache.cache_format import _decode, _plan

    seen: list[int] = []
    split = _plan.split

    def spy(items, chunk_rows, row_bytes, n, min_bytes):
        groups = split(items, chunk_rows, row_bytes, n, min_bytes)
        seen.append(len(groups))
        return groups

    monkeypatch.setattr(_plan, "split", spy)
    rng = np.random.default_rng(0)
    order = rng.permutation(500).astype(np.int32)

    def blocks():
        out = []
        for rows, k in ((7000, 16), (3, 16), (0, 16), (20000, 8)):
            d = rng.integers(0, 1 << 16, (rows, k), dtype=np.uint16)
            out.append(
                (
                    d,
                    np.empty((rows, k), np.float32),
                    rng.integers(0, 500, (rows, k), dtype=np.int32),
                )
            )
        return out

    want = blocks()
    got = [(d.copy(), lp, ids.copy()) for d, lp, ids in want]
    with ThreadPoolExecutor(8) as pool:
        monkeypatch.setattr(pointread, "PARALLEL_MIN_BYTES", 1)
        _decode._decode_blocks(got, order, pool, 16)
        assert seen[-1] == pointread.MAX_SHARES
        monkeypatch.setattr(pointread, "PARALLEL_MIN_BYTES", 10**9)
        _decode._decode_blocks(blocks(), order, pool, 16)
        assert seen[-1] == 1  # not worth a thread
    for (d, _, ids), (gd, glp, gids) in zip(want, got, strict=True):
        bits = np.cumsum(d, axis=1, dtype=np.uint16)
        assert np.array_equal(gd, bits) and np.array_equal(gids, order[ids])
        assert np.array_equal(glp, bits.view(np.float16).astype(np.float32), equal_nan=True)


def test_frame_checks_on_any_buffer():
    """The CRC32C and blosc-header checks read numpy views of pread's bytes (no copies)."""
    import google_crc32c
    import numcodecs.blosc

    data = np.arange(64, dtype=np.int32)
    frame = numcodecs.blosc.compress(data, b"lz4", 5, numcodecs.blosc.SHUFFLE)
    stored = np.frombuffer(frame + google_crc32c.value(frame).to_bytes(4, "little"), np.uint8)
    assert shardread.crc_ok(stored) and shardread._frame_error(stored, data.nbytes) is None
    assert shardread._frame_error(stored, data.nbytes + 4) == (
        f"blosc frame of {data.nbytes} bytes, expected {data.nbytes + 4}"
    )
    bad = stored.copy()
    bad[20] ^= 1
    assert shardread._frame_error(bad, data.nbytes) == "chunk fails its CRC32C"
    assert not shardread.crc_ok(stored[:3])

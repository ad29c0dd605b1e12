"""Compiled point reads (``cache_format/fastdecode.py``, issue #14): the whole decode of a
``sequence`` / ``sequences`` call in one compiled call per thread must return the per-chunk path's
values bit for bit (every encoding it takes, id remap, loss mask, repeats, chunk and shard edges,
threads), check every CRC32C (a flipped byte is the per-chunk path's typed error), hand back what
it does not handle, leak no descriptors, and be optional (no numba, ``LOGITCACHE_FASTDECODE=0``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from format_support import CASES, SMALL, K, assert_same_record, make_records, write_small_cache
from logitcache.cache_format import CacheReader, fastdecode, shardread
from logitcache.cache_format.errors import ChecksumError, MissingDataError

pytestmark = pytest.mark.skipif(not fastdecode.ready(), reason="numba or C symbols missing")


class Spy:
    """Counts :func:`fastdecode.read_arrays` calls and those handed back (``None``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.calls = self.handed_back = 0
        real = fastdecode.read_arrays

        def spy(*a, **kw):
            self.calls += 1
            got = real(*a, **kw)
            self.handed_back += got is None
            return got

        monkeypatch.setattr(fastdecode, "read_arrays", spy)


def _per_chunk(url, **kw) -> CacheReader:
    """A reader whose point reads take the per-chunk path (pointread)."""

    class PerChunk(CacheReader):
        def _fetch_fast(self, *a, **k):
            return None

    return PerChunk(url, **kw)


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: ",".join(kw) or "float16")
@pytest.mark.parametrize("threads", [1, 3])
def test_compiled_reads_equal_the_per_chunk_path(tmp_path, monkeypatch, kw, threads):
    monkeypatch.setattr(fastdecode, "PARALLEL_MIN_BYTES", 1)  # tiny calls split over threads too
    spy = Spy(monkeypatch)
    recs = write_small_cache(tmp_path / "c", SMALL, **kw)
    fast = CacheReader(tmp_path / "c", decode_threads=threads)
    slow = _per_chunk(tmp_path / "c")
    for i in range(len(recs)):
        assert_same_record(fast.sequence(i), slow.sequence(i))
        a, b = fast.sequence(i, logprob_dtype="float16"), slow.sequence(i, logprob_dtype="float16")
        assert a.equals(b) and a.topk_logprobs.dtype == b.topk_logprobs.dtype
    idx = [5, 3, 5, 39, 0, 22, 21, 22, 38, 1]  # unsorted, repeated, neighbours sharing chunks
    for g, want in zip(fast.sequences(idx), slow.sequences(idx), strict=True):
        assert_same_record(g, want)
    for g, want in zip(fast.sequences(range(len(recs))), recs, strict=True):
        assert np.array_equal(g.topk_ids, want.topk_ids)
        assert np.array_equal(g.input_ids, want.input_ids)
    # uint8 (quantised) and float32 rounded to float16 on request: the per-chunk path
    per_seq = {"uint8": 0, "float32": 1}.get(kw.get("logprob_dtype", ""), 2)
    assert spy.calls == per_seq * len(recs) + (2 if per_seq else 0)
    assert spy.handed_back == 0


def test_a_flipped_byte_is_a_checksum_error(tmp_path, monkeypatch):
    """Every chunk's CRC32C is checked: a flipped byte in any array's chunk makes the compiled
    call hand back, and the per-chunk path raises its typed error (after the reader's retries)."""
    monkeypatch.setattr("logitcache.cache_format.reader._RETRIES", 2)
    url = tmp_path / "c"
    write_small_cache(url, SMALL)
    spy = Spy(monkeypatch)
    for array in ("topk_ids", "topk_logprobs", "tail_mass", "input_ids"):
        shard = url / array / "c" / "0"
        shard = shard / "0" if shard.is_dir() else shard
        raw = bytearray(shard.read_bytes())
        saved = bytes(raw)
        raw[20] ^= 0x01  # inside chunk 0's frame (the index is at the end)
        shard.write_bytes(bytes(raw))
        r = CacheReader(url)
        before = spy.handed_back
        with pytest.raises(ChecksumError, match=array):
            r.sequence(0)
        assert spy.handed_back > before
        assert r.sequence(r.num_sequences - 1).key  # later shards still read
        shard.write_bytes(saved)
    assert CacheReader(url).sequence(0).key


def test_a_missing_shard_is_the_per_chunk_paths_error(tmp_path, monkeypatch):
    url = tmp_path / "c"
    write_small_cache(url, SMALL)
    (url / "topk_logprobs" / "c" / "1" / "0").unlink()
    spy = Spy(monkeypatch)
    r = CacheReader(url)
    i = next(j for j in range(r.num_sequences) if r.row_starts[j] >= SMALL.row_shard)
    with pytest.raises(MissingDataError):
        r.sequence(i)
    assert spy.handed_back >= 1
    assert r.sequence(0).key


def test_descriptors_not_kept_are_closed(tmp_path, monkeypatch):
    """With no room to keep shard files open, each call reads through private tables and
    closes what it opened: same values, no descriptor left open."""
    recs = write_small_cache(tmp_path / "c", SMALL)
    monkeypatch.setattr(shardread, "FD_CACHE", 0)
    r = CacheReader(tmp_path / "c", decode_threads=2)
    monkeypatch.setattr(fastdecode, "PARALLEL_MIN_BYTES", 1)
    r.sequence(0)
    before = len(os.listdir("/proc/self/fd"))
    for i in range(len(recs)):
        assert np.array_equal(r.sequence(i).topk_ids, recs[i].topk_ids)
    got = r.sequences(range(len(recs)))
    assert all(np.array_equal(g.input_ids, w.input_ids) for g, w in zip(got, recs, strict=True))
    assert len(os.listdir("/proc/self/fd")) == before
    assert all((t["tables"].fd < 0).all() for lay in r._direct.values() for t in [lay.fast] if t)


def test_pieces_cover_every_row_once_at_chunk_edges():
    meta = np.array([[4, 8, 24, 32, 0], [4, 16, 4, 64, 0]], np.int64)  # chunk rows 8 and 16
    items = [(0, 3, 70, 0), (1, 5, 90, 0), (0, 100, 101, 67)]
    for n in (1, 2, 3, 5):
        groups = fastdecode._pieces(items, meta, n)
        assert 1 <= len(groups) <= n
        rows: dict[int, list[int]] = {0: [], 1: []}
        for g in groups:
            for a, st, sp, out in g.tolist():
                assert st < sp
                rows[a] += [(r, out + r - st) for r in range(st, sp)]  # type: ignore[misc]
        assert sorted(rows[0]) == [(r, r - 3) for r in range(3, 70)] + [(100, 67)]
        assert sorted(rows[1]) == [(r, r - 5) for r in range(5, 90)]
        for g in groups[1:]:  # every cut at a chunk edge of its array
            a, st = int(g[0, 0]), int(g[0, 1])
            assert st in (3, 5, 100) or st % int(meta[a, 1]) == 0


def test_kernels_match_numpy_on_every_float16():
    assert fastdecode._self_check(fastdecode._kernels)


@pytest.mark.parametrize("k", [1, 2, 31, 32, 33, 63, 64, 65, 100, 128, 129])
def test_vector_row_sums_match_numpy_at_every_width(k):
    """The row-delta inverse goes 32 values at a time through a vector prefix sum, the rest of
    a row serially: bit for bit numpy's wrapping cumsum (in place) and its float16 -> float32
    view (widened), at widths below, at and across the vector's, for rows whose sums wrap."""
    from logitcache.cache_format import _fastkernels as fk

    rng = np.random.default_rng(k)
    d = rng.integers(0, 1 << 16, (37, k)).astype(np.uint16)
    u = np.cumsum(d, axis=1, dtype=np.uint16)
    u[np.isnan(u.view(np.float16))] = 0  # (NaN payloads aside) then deltas of those sums
    d = u.copy()
    d[:, 1:] = u[:, 1:] - u[:, :-1]
    out = np.full(u.shape, np.nan, np.float32)
    fk.undelta(d.copy(), out, True)
    want = u.view(np.float16).astype(np.float32)
    assert np.array_equal(out.view(np.uint32), want.view(np.uint32))
    inplace = d.copy()
    fk.undelta(inplace, out, False)
    assert np.array_equal(inplace, u)
    wide = rng.integers(0, 1 << 32, (5, k), dtype=np.uint64).astype(np.uint32)  # the serial sum
    fk.undelta(got := wide.copy(), out, False)
    assert np.array_equal(got, np.cumsum(wide, axis=1, dtype=np.uint32))


def test_wide_rows_read_like_the_per_chunk_path(tmp_path, monkeypatch):
    """k = 70 (two vectors and a serial rest per row) through a whole read, raw and compressed
    layouts, float32 and float16 requests: the per-chunk path's values, bit for bit."""
    from format_support import make_manifest
    from logitcache.cache_format import CacheWriter, spec

    recs = make_records(12, k=70, vocab=500, seed=5, min_len=2, max_len=60)
    for name in ("random_access_raw", "default"):
        url = tmp_path / name
        lay = replace(spec.LAYOUTS[name], row_chunk=16, row_shard=64)
        with CacheWriter.open(url, make_manifest(k=70, vocab_size=500), layout=lay) as w:
            w.append(recs)
        spy = Spy(monkeypatch)
        fast, slow = CacheReader(url), _per_chunk(url)
        for dtype in ("float32", "float16"):
            got = fast.sequences(range(12), logprob_dtype=dtype)
            for a, b in zip(got, slow.sequences(range(12), logprob_dtype=dtype), strict=True):
                assert a.equals(b) and a.topk_logprobs.dtype == np.dtype(dtype)
        assert spy.calls == 2 and spy.handed_back == 0


def test_optional(tmp_path):
    """Without numba (or with LOGITCACHE_FASTDECODE=0) the reader takes the per-chunk path."""
    url = tmp_path / "c"
    recs = write_small_cache(url, SMALL)
    code = (
        "import sys\n"
        "if sys.argv[2] == 'nonumba': sys.modules['numba'] = None\n"
        "from logitcache.cache_format import CacheReader, fastdecode\n"
        "r = CacheReader(sys.argv[1])\n"
        "print(r.sequence(3).topk_ids.sum(), fastdecode.ready(), fastdecode._kernels)\n"
    )
    want = str(int(recs[3].topk_ids.sum()))
    root = Path(__file__).resolve().parents[2]
    for mode, env in (("nonumba", {}), ("off", {"LOGITCACHE_FASTDECODE": "0"})):
        out = subprocess.run(
            [sys.executable, "-c", code, str(url), mode],
            capture_output=True,
            text=True,
            env={**os.environ, **env},
            cwd=root,
            check=True,
        ).stdout.split()
        assert out[:2] == [want, "False"], (mode, out)


def test_a_kernel_failure_hands_the_reader_back(tmp_path, monkeypatch):
    """A specialisation that does not compile (or any kernel error) turns the compiled path off
    for the process and the call is read per chunk: the caller sees values, not an error."""
    recs = write_small_cache(tmp_path / "c", SMALL)

    def broken(*a):
        raise RuntimeError("no such specialisation")

    monkeypatch.setitem(fastdecode._kernels, "read_items", broken)
    monkeypatch.setattr(fastdecode, "AVAILABLE", True)
    r = CacheReader(tmp_path / "c")
    assert np.array_equal(r.sequence(4).topk_ids, recs[4].topk_ids)
    assert fastdecode.AVAILABLE is False


def test_compiled_kernels_are_cached_on_disk():
    """The kernels are module-level numba functions cached on disk (next to the module, or
    numba's user cache): a second process loads them instead of compiling (seconds each)."""
    code = (
        "from logitcache.cache_format import fastdecode, _fastkernels as fk\n"
        "assert fastdecode.ready()\n"
        "st = fk.read_items.stats\n"
        "print(sum(st.cache_hits.values()), len(st.cache_misses))\n"
    )
    root = Path(__file__).resolve().parents[2]
    run = [sys.executable, "-c", code]
    subprocess.run(run, check=True, cwd=root, capture_output=True)  # fills the cache if empty
    hits, misses = subprocess.run(run, check=True, cwd=root, capture_output=True).stdout.split()
    assert (int(hits), int(misses)) == (1, 0)


def test_threads_reading_one_reader_at_once(tmp_path, monkeypatch):
    """Several caller threads (a loader's read-ahead) share one reader, its layouts' tables and
    its decode pool: every result is exact."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(fastdecode, "PARALLEL_MIN_BYTES", 1)
    monkeypatch.setattr(shardread, "FD_CACHE", 3)  # some shards kept, some opened per call
    recs = write_small_cache(tmp_path / "c", SMALL)
    r = CacheReader(tmp_path / "c", decode_threads=2)
    want = _per_chunk(tmp_path / "c").sequences(range(len(recs)))
    rng = np.random.default_rng(5)
    batches = [rng.integers(0, len(recs), 6).tolist() for _ in range(60)]

    def one(b: list[int]) -> bool:
        return all(g.equals(want[i]) for g, i in zip(r.sequences(b), b, strict=True))

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(one, batches))


def test_an_engine_started_after_a_compiled_read_can_scan_the_modules(tmp_path):
    """vLLM's kernel-override scan (``vllm/triton_utils/dispatcher.py``) calls
    ``vars(value).get("kernel")`` on every module attribute with a ``__dict__``: after a compiled
    read (numba has loaded llvmlite's library object) that scan must not raise (it did on
    ``llvmlite.binding.ffi.lib``; run in a fresh process, as an engine's start would)."""
    url = tmp_path / "c"
    recs = write_small_cache(url, SMALL)
    code = (
        "import sys\n"
        "from logitcache.cache_format import CacheReader, fastdecode\n"
        "assert fastdecode.ready()\n"
        "print(int(CacheReader(sys.argv[1]).sequence(2).topk_ids.sum()))\n"
        "for m in list(sys.modules.values()):\n"
        "    for name in list(getattr(m, '__dict__', None) or {}):\n"
        "        v = m.__dict__[name]\n"
        "        if hasattr(v, '__dict__'):\n"
        "            vars(v).get('kernel')\n"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code, str(url)], capture_output=True, text=True, cwd=root
    )
    assert out.returncode == 0, out.stderr[-800:]
    assert out.stdout.split() == [str(int(recs[2].topk_ids.sum()))]


def test_the_last_shard_stays_open_and_reads_its_version_after_the_writer_replaced_it(
    tmp_path, monkeypatch
):
    """The incomplete last shard's descriptor and index are kept like a complete shard's (no
    open + index read per call); a writer then appending (replacing that shard's file) does not
    change what the reader's layout reads: its descriptor holds the version it opened, with
    every row committed when the layout was made."""
    from logitcache.cache_format import CacheWriter

    url = tmp_path / "c"
    recs = write_small_cache(url, SMALL)
    r = CacheReader(url)
    lay = r._direct["topk_ids"]
    assert lay.length % lay.shard_rows, "the store must end inside a shard"
    last = len(recs) - 1
    want = _per_chunk(url).sequence(last)
    assert_same_record(r.sequence(last), want)
    opened = []
    real = shardread.open_shard
    monkeypatch.setattr(shardread, "open_shard", lambda *a: opened.append(a[2]) or real(*a))
    for _ in range(3):
        assert_same_record(r.sequence(last), want)
    assert opened == []  # the last shard was not opened again
    more = make_records(12, k=K, vocab=300, seed=12, min_len=20, max_len=40)
    more = [replace(m, key=f"more{j}") for j, m in enumerate(more)]  # not duplicates of recs
    with CacheWriter.open(url, r.manifest) as w:
        w.append(more)
    assert_same_record(r.sequence(last), want)  # the version its layout opened
    fresh = CacheReader(url)
    assert fresh.sequence(len(recs) + 11).key == more[11].key
    assert_same_record(fresh.sequence(len(recs) + 11), _per_chunk(url).sequence(len(recs) + 11))
    assert_same_record(fresh.sequence(last), want)

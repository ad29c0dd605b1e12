"""Reader processes (``CacheReader(read_processes=n)``, ``cache_format/procread.py``, issue #14):
bit-identical to the in-process range path for every encoding, id remap and loss mask, with
sequences cut across workers at chunk edges; a damaged chunk read by a worker is the caller's
``ChecksumError``; the cut covers every row once."""

from __future__ import annotations

import numpy as np
import pytest
from format_support import SMALL, assert_same_record, write_small_cache
from logitcache.cache_format import CacheReader, procread
from logitcache.cache_format.errors import ChecksumError


def _spans(r, idx):
    return [(a.start, a.stop, t.start, t.stop) for a, t in (r._span(i) for i in idx)]


def test_cut_covers_every_row_once_at_chunk_edges():
    rng = np.random.default_rng(0)
    for _ in range(200):
        spans, t = [], 0
        for _ in range(int(rng.integers(1, 9))):
            a = int(rng.integers(0, 5000))
            n = int(rng.integers(1, 900))
            spans.append((a, a + n, t, t + n + 1))
            t += n + 1
        n_workers = int(rng.integers(1, 9))
        cr = int(rng.choice([8, 64, 256]))
        groups = procread.cut(spans, n_workers, cr)
        assert 1 <= len(groups) <= n_workers
        seen: list[list[tuple[int, int]]] = [[] for _ in spans]
        toks = [0] * len(spans)
        region = 0
        starts = np.cumsum([0] + [b - a for a, b, _, _ in spans])
        for pieces in groups:
            assert pieces
            for a, b, ta, tb, ro, to in pieces:
                j = int(np.searchsorted(starts, ro, side="right") - 1)
                sa, sb, sta, stb = spans[j]
                assert sa <= a < b <= sb and ro == starts[j] + a - sa
                assert ro == region  # pieces in call order, contiguous
                region += b - a
                seen[j].append((a, b))
                if tb > ta:
                    assert (ta, tb, a) == (sta, stb, sa) and to == sum(
                        x[3] - x[2] for x in spans[:j]
                    )
                    toks[j] += 1
                # an inner cut lies on a chunk edge
                if a != sa:
                    assert a % cr == 0
        assert toks == [1] * len(spans)
        for (sa, sb, _, _), parts in zip(spans, seen, strict=True):
            assert sorted(parts)[0][0] == sa and sum(b - a for a, b in parts) == sb - sa


# every encoding of test_format_random_access's CASES, id remap and loss mask together (each
# store starts its own processes: a few seconds each)
STORES = [
    {},
    {"logprob_dtype": "float32"},
    {"logprob_dtype": "uint8", "id_remap": True, "loss_mask": True},
]


@pytest.mark.parametrize("kw", STORES, ids=lambda kw: ",".join(map(str, kw.values())) or "float16")
def test_processes_equal_the_range_path(tmp_path, kw):
    url = tmp_path / "c"
    recs = write_small_cache(url, SMALL, **kw)
    ranged = CacheReader(url)
    ranged.point_reads = False
    with CacheReader(url, read_processes=1) as procs:
        idx = [5, 3, 5, 39, 0, 22, 21, 22, 38, 1]
        got = procs.sequences(idx)
        assert procs._procs is not None  # the call went to the processes
        for g, want in zip(got, ranged.sequences(idx), strict=True):
            assert_same_record(g, want)
        for i in (0, 39, 17):
            assert_same_record(procs.sequence(i), ranged.sequence(i))
        half = procs.sequences(range(len(recs)), logprob_dtype="float16")
        want16 = ranged.sequences(range(len(recs)), logprob_dtype="float16")
        for g, want in zip(half, want16, strict=True):
            assert np.array_equal(g.topk_logprobs, want.topk_logprobs)
    assert procs._procs is None


def test_worker_checksum_error_reaches_the_caller(tmp_path, monkeypatch):
    from logitcache.cache_format import reader as reader_mod

    url = tmp_path / "c"
    write_small_cache(url, SMALL)
    shard = url / "topk_ids" / "c" / "0" / "0"
    raw = bytearray(shard.read_bytes())
    raw[40] ^= 0xFF  # inside the first chunk's frame
    shard.write_bytes(bytes(raw))
    monkeypatch.setattr(reader_mod, "_RETRIES", 1)  # the caller's side; workers retry as usual
    with CacheReader(url, read_processes=1) as r:
        idx = list(range(9, -1, -1))  # sequence 0 (the damaged chunk) last: the worker's run
        assert any(p[0] == 0 for p in procread.cut(_spans(r, idx), 2, 8)[-1])
        with pytest.raises(ChecksumError):
            r.sequences(idx)
        assert r.sequences([39])[0].key == r.keys[39]  # the workers still serve


def test_segments_are_reused_only_once_free(tmp_path):
    url = tmp_path / "c"
    recs = write_small_cache(url, SMALL)
    with CacheReader(url, read_processes=1) as r:
        by_key = {rec.key: rec for rec in recs}
        held = r.sequences([0, 1, 2, 3, 4, 5])
        for _ in range(6):  # later calls never write into a segment a held record uses
            got = r.sequences([39, 38, 37, 36, 35, 34])
            assert all(np.array_equal(g.topk_ids, by_key[g.key].topk_ids) for g in got)
            del got
        for g, want in zip(held, recs[:6], strict=True):
            assert np.array_equal(g.topk_ids, want.topk_ids)
            assert np.array_equal(g.input_ids, want.input_ids)
        assert r._procs is not None
        assert len(r._procs.segments) == 2  # the held one and one reused by every later call
        del held
        r.sequences([0, 1, 2, 3, 4, 5])
        assert len(r._procs.segments) == 2


def test_a_forked_reader_starts_its_own_processes(tmp_path):
    import os

    url = tmp_path / "c"
    recs = write_small_cache(url, SMALL)
    r = CacheReader(url, read_processes=1)
    r.sequences([0, 1, 2, 3])
    parent = r._procs
    assert parent is not None
    parent.pid = -1  # as a forked child sees it: the processes belong to another pid
    got = r.sequences([39, 38, 37, 36, 35])
    assert r._procs is not parent and r._procs.pid == os.getpid()
    assert [g.key for g in got] == [recs[i].key for i in (39, 38, 37, 36, 35)]
    r.close()
    parent.pid = os.getpid()
    parent.close()


def test_a_reader_with_started_processes_pickles_as_its_configuration(tmp_path):
    """A DataLoader worker receives the reader pickled: the copy keeps the settings, starts its
    own processes at its first point read, and reads the same values."""
    import pickle

    url = tmp_path / "c"
    write_small_cache(url, SMALL)
    with CacheReader(url, read_processes=1, decode_threads=2) as r:
        r.point_reads = True
        idx = [5, 3, 39, 0, 22]
        want = r.sequences(idx)
        assert r._procs is not None
        copy = pickle.loads(pickle.dumps(r))
        assert (copy.read_processes, copy.decode_threads, copy.url) == (1, 2, r.url)
        assert copy._procs is None and copy.num_sequences == r.num_sequences
        with copy:
            got = copy.sequences(idx)
            assert copy._procs is not None
            assert {p.pid for p in copy._procs.procs}.isdisjoint(p.pid for p in r._procs.procs)
            for g, w in zip(got, want, strict=True):
                assert_same_record(g, w)
        ranged = pickle.loads(pickle.dumps(CacheReader(url)))
        ranged.point_reads = False
        assert not pickle.loads(pickle.dumps(ranged)).point_reads

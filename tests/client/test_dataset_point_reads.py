"""``point_reads`` in the loader (issue #14): ``CacheDataset(point_reads=True)`` and
``LocalSource(point_reads=True)`` fetch with one point read (``CacheReader.sequences``) instead
of merged range reads; the records and the stream are the same; the setting is pickled with the
source and refused where the source is not a LocalSource."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
from client_support import collect, same_stream
from format_support import SMALL, write_small_cache
from logitcache.client import CacheDataLoader, CacheDataset, ConfigError, LocalSource

OPTS = {"tokens_per_item": 48, "seed": 3, "read_threads": 1}


def _no_range_reads(source: LocalSource, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make the source's reader refuse range reads and count its point reads (sequences)."""
    reader = source.reader
    calls: list[int] = []
    real = reader.sequences

    def sequences(indices: Any, **kw: Any) -> list:
        calls.append(len(indices))
        return real(indices, **kw)

    def refused(*a: Any, **kw: Any) -> None:
        raise AssertionError("a range read")

    monkeypatch.setattr(reader, "sequences", sequences)
    monkeypatch.setattr(reader, "read_ranges", refused)
    return calls


def test_point_reads_fetch_by_point_reads_and_keep_the_stream(tmp_path, monkeypatch) -> None:
    url = str(tmp_path / "c")
    write_small_cache(url, SMALL)
    plain = collect(CacheDataset(url, **OPTS))
    ds = CacheDataset(url, point_reads=True, **OPTS)
    assert ds.point_reads and ds.source.point_reads
    calls = _no_range_reads(ds.source, monkeypatch)
    assert same_stream(collect(ds), plain)
    assert sum(calls) >= 40  # every sequence came from a point read
    copy = pickle.loads(pickle.dumps(ds))  # what a spawned DataLoader worker receives
    assert copy.point_reads and copy.source.point_reads and copy.source._reader is None
    # point_reads=False reads ranges (the patch above does catch them)
    other = CacheDataset(url, point_reads=False, **OPTS)
    _no_range_reads(other.source, monkeypatch)
    with pytest.raises(AssertionError, match="a range read"):
        collect(other)


def test_the_default_reads_scattered_fetches_by_point_reads(tmp_path, monkeypatch):
    """``point_reads=None`` (default): a fetch of scattered sequences (at least one merged range
    per two of them) from a local directory store read by the compiled path is one point read,
    a fetch of neighbours (a shuffle block) range reads, and without the compiled path
    (``fastdecode`` off) range reads; the records are the range reads' every time."""
    from logitcache.cache_format import fastdecode

    url = str(tmp_path / "c")
    write_small_cache(url, SMALL)
    want = LocalSource(url, point_reads=False).fetch(range(40))
    src = LocalSource(url, max_gap_tokens=0)  # only adjacent sequences merge
    assert src.point_reads is None and "point_reads" not in repr(src)
    scattered, block = [2, 9, 17, 30, 35], list(range(8, 20))
    if fastdecode.AVAILABLE and fastdecode.ready():
        calls = _no_range_reads(src, monkeypatch)
        got = src.fetch(scattered)
        assert calls == [5] and all(got[i].equals(want[i]) for i in scattered)
        with pytest.raises(AssertionError, match="a range read"):
            src.fetch(block)
    monkeypatch.setattr(fastdecode, "AVAILABLE", False)
    off = LocalSource(url, max_gap_tokens=0)
    _no_range_reads(off, monkeypatch)
    with pytest.raises(AssertionError, match="a range read"):
        off.fetch(scattered)
    got = LocalSource(url).fetch(block)  # no patch: range reads, the same records
    assert all(got[i].equals(want[i]) for i in block)


def test_local_source_takes_point_reads_itself(tmp_path, monkeypatch) -> None:
    """``LocalSource(url, point_reads=True)``: pickled, in its repr, fetch by point reads with
    the records of the range reads; a source given to the dataset keeps it, and the dataset's
    copy for another setting keeps it too."""
    url = str(tmp_path / "c")
    write_small_cache(url, SMALL)
    src = LocalSource(url, point_reads=True)
    assert "point_reads=True" in repr(src) and "point_reads" not in repr(LocalSource(url))
    assert "point_reads=False" in repr(LocalSource(url, point_reads=False))
    assert pickle.loads(pickle.dumps(src)).point_reads
    want = LocalSource(url, point_reads=False).fetch([5, 2, 30, 31])
    calls = _no_range_reads(src, monkeypatch)
    got = src.fetch([31, 5, 2, 30])
    assert calls == [4] and sorted(got) == sorted(want) == [2, 5, 30, 31]
    assert all(got[i].equals(want[i]) for i in want)
    assert CacheDataset(src, **OPTS).source.point_reads
    ds = CacheDataset(src, decode_threads=2, **OPTS)
    assert ds.source is not src and ds.source.point_reads and ds.source.decode_threads == 2


def test_point_reads_need_a_local_source() -> None:
    with pytest.raises(ConfigError, match="point_reads"):  # refused before any request
        CacheDataset("http://127.0.0.1:9", cache="c", point_reads=True)


def test_point_reads_in_forked_workers_after_the_parent_read(tmp_path) -> None:
    """Forked DataLoader workers (the default start method for a local store) of a dataset whose
    parent already read with point reads (its reader, descriptors and compiled-read state
    inherited) give the stream of the range reads, as does the parent again afterwards."""
    url = str(tmp_path / "c")
    write_small_cache(url, SMALL)
    plain = collect(CacheDataset(url, batch_size=2, **OPTS))
    ds = CacheDataset(url, batch_size=2, point_reads=True, **OPTS)
    assert same_stream(collect(ds), plain)  # the parent reads first
    loader = CacheDataLoader(ds, num_workers=2, multiprocessing_context="fork")
    assert same_stream(collect(loader), plain)
    assert same_stream(collect(ds), plain)

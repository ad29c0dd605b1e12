"""A LocalSource fetches scattered sequences with one point read (``CacheReader.sequences``)
where the compiled path serves them, else merged range reads; the records are the same."""

from __future__ import annotations

from typing import Any

import pytest
from client_support import collect, make_dataset, same_stream
from format_support import SMALL, write_small_cache
from logitcache.cache_format import CacheReader
from logitcache.client import CacheDataLoader
from logitcache.client.sources import LocalSource

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


def test_the_default_reads_scattered_fetches_by_point_reads(tmp_path, monkeypatch):
    """A fetch of scattered sequences (at least one merged range
    per two of them) from a local directory store read by the compiled path is one point read,
    a fetch of neighbours (a shuffle block) range reads, and without the compiled path
    (``fastdecode`` off) range reads; the records are the range reads' every time."""
    from logitcache.cache_format import _fastdecode as fastdecode

    url = str(tmp_path / "c")
    write_small_cache(url, SMALL)
    want = dict(enumerate(CacheReader(url).read_ranges([(0, 40)], logprob_dtype="float32")))
    src = LocalSource(url, max_gap_tokens=0)  # only adjacent sequences merge
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


def test_point_reads_in_forked_workers_after_the_parent_read(tmp_path) -> None:
    """Forked DataLoader workers (the default start method for a local store) of a dataset whose
    parent already read (its reader, descriptors and compiled-read state inherited) give the
    parent's stream, as does the parent again afterwards."""
    url = str(tmp_path / "c")
    write_small_cache(url, SMALL)
    ds = make_dataset(url, batch_size=2, **OPTS)
    plain = collect(ds)  # the parent reads first
    loader = CacheDataLoader(ds, num_workers=2, multiprocessing_context="fork")
    assert same_stream(collect(loader), plain)
    assert same_stream(collect(ds), plain)

"""``ReadOptions(read_processes=n)`` (issue #14): the dataset's reader gets ``n`` reader
processes and fetches with point reads over them; the stream is the one without; the setting
survives pickling (DataLoader workers) and is refused where it cannot apply."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from client_support import collect, same_stream
from format_support import SMALL, write_small_cache
from logitcache.cache_format import CacheReader
from logitcache.client import CacheDataset, ReadOptions, StreamConfig
from logitcache.client.errors import ConfigError


@pytest.mark.subprocess
def test_read_processes_reach_the_reader_and_keep_the_stream(tmp_path):
    url = str(tmp_path / "c")
    write_small_cache(
        url, SMALL
    )  # 8-row chunks: a fetch of several sequences splits over processes
    plain = collect(
        CacheDataset(
            url, StreamConfig(tokens_per_item=48, seed=3), read=ReadOptions(read_threads=1)
        )
    )
    ds = CacheDataset(
        url,
        StreamConfig(tokens_per_item=48, seed=3),
        read=ReadOptions(read_threads=1, read_processes=1),
    )
    try:
        assert same_stream(collect(ds), plain)
        reader = ds.source.reader
        assert reader.read_processes == 1 and reader._procs is not None  # processes were used
        copy = pickle.loads(pickle.dumps(ds))  # what a DataLoader worker receives
        assert copy.read.read_processes == 1 and copy.source.read_processes == 1
        assert copy.source._reader is None  # opens its own reader (and processes) when read
        got = copy.source.fetch([39, 0, 7])
        want = CacheReader(url).sequences([0, 7, 39])
        assert sorted(got) == [0, 7, 39]
        for i, w in zip([0, 7, 39], want, strict=True):
            assert got[i].equals(w)
        copy.source.reader.close()
    finally:
        ds.source.reader.close()


def test_read_processes_are_checked(tmp_path):
    url = str(tmp_path / "c")
    write_small_cache(url, SMALL)
    with pytest.raises(ConfigError, match="read_processes"):
        CacheDataset(url, read=ReadOptions(read_processes=-1))

    class Other:  # a CacheSource that is not a LocalSource
        def __init__(self, reader: CacheReader) -> None:
            self.manifest, self.num_sequences = reader.manifest, reader.num_sequences
            self.lengths = np.asarray(reader.lengths, dtype=np.int64)

        def fetch(self, indices):  # pragma: no cover - never read
            return {}

        def refresh(self) -> None:  # pragma: no cover
            pass

    with pytest.raises(ConfigError, match="LocalSource"):
        CacheDataset(Other(CacheReader(url)), read=ReadOptions(read_processes=2))


@pytest.mark.subprocess
def test_local_source_takes_read_processes_itself(tmp_path):
    """``LocalSource(url, read_processes=n)``: the option lives on the source (pickled with it,
    shown in its repr, refused below 0); fetch returns what the range reads return."""
    from logitcache.client.errors import SourceError
    from logitcache.client.sources import LocalSource

    url = str(tmp_path / "c")
    write_small_cache(url, SMALL)
    with pytest.raises(SourceError, match="read_processes"):
        LocalSource(url, read_processes=-1)
    src = LocalSource(url, read_processes=1)
    try:
        assert "read_processes=1" in repr(src) and "read_processes" not in repr(LocalSource(url))
        assert pickle.loads(pickle.dumps(src)).read_processes == 1
        got, want = src.fetch([5, 2, 30]), LocalSource(url).fetch([5, 2, 30])
        assert sorted(got) == sorted(want) == [2, 5, 30]
        assert all(got[i].equals(want[i]) for i in want)
    finally:
        src.reader.close()

"""``decode_threads`` from the loader to the reader (issue #14): ``ReadOptions(decode_threads=n)``,
``LocalSource(decode_threads=n)`` and ``HttpSource(decode_threads=n)`` read
through ``CacheReader(decode_threads=n)`` in the trainer process and in every DataLoader worker
(the setting is pickled with the source); the stream is the one without; it is refused where no
reader of this process decodes."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from client_support import collect, make_dataset, same_stream
from format_support import SMALL, write_small_cache
from logitcache.cache_format import CacheReader
from logitcache.client import CacheDataLoader, CacheDataset, ReadOptions
from logitcache.client.errors import ConfigError, SourceError
from logitcache.client.sources import HttpSource, LocalSource
from server_support import StoreServer
from torch.utils.data import get_worker_info

OPTS = {"tokens_per_item": 48, "seed": 3, "read_threads": 1}


def _probe(unit: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A DataLoader ``collate_fn`` (it runs in the worker): the unit, plus what the worker's
    reader was built with and whether its decode pool was used."""
    info = get_worker_info()
    reader = info.dataset.source.reader
    probe = {
        "probe_threads": reader.decode_threads,
        "probe_pooled": int(reader._decode_pool is not None),
        "probe_pid": os.getpid(),
    }
    return {**unit, **{k: torch.tensor(v) for k, v in probe.items()}}


def test_decode_threads_reach_the_reader_and_keep_the_stream(tmp_path) -> None:
    url = str(tmp_path / "c")
    write_small_cache(url, SMALL)
    plain = collect(make_dataset(url, **OPTS))
    ds = make_dataset(url, decode_threads=3, **OPTS)
    assert ds.read.decode_threads == 3 and ds.source.decode_threads == 3
    assert same_stream(collect(ds), plain)
    reader = ds.source.reader
    assert reader.decode_threads == 3 and reader._decode_pool is not None  # the threads decoded
    copy = pickle.loads(pickle.dumps(ds))  # what a spawned DataLoader worker receives
    assert copy.read.decode_threads == 3 and copy.source._reader is None
    assert copy.source.reader.decode_threads == 3
    assert make_dataset(url, **OPTS).source.reader.decode_threads == 1  # the default


@pytest.mark.subprocess
def test_decode_threads_reach_the_reader_of_a_spawned_worker(tmp_path) -> None:
    """A spawned worker unpickles the dataset: its own reader has the threads and used them."""
    url = str(tmp_path / "c")
    write_small_cache(url, SMALL)
    plain = collect(make_dataset(url, batch_size=2, **OPTS))
    ds = make_dataset(url, batch_size=2, decode_threads=3, **OPTS)
    loader = CacheDataLoader(ds, num_workers=1, multiprocessing_context="spawn", collate_fn=_probe)
    got = collect(loader)
    assert got and all(int(u["probe_threads"]) == 3 and int(u["probe_pooled"]) for u in got)
    assert {int(u["probe_pid"]) for u in got} != {os.getpid()}
    units = [{k: v for k, v in u.items() if not k.startswith("probe_")} for u in got]
    assert same_stream(units, plain)


def test_local_source_takes_decode_threads_itself(tmp_path) -> None:
    """``LocalSource(url, decode_threads=n)``: refused below 1, pickled, in its repr, given to its
    reader; fetch returns the records of a plain source. A source given to the dataset keeps its
    setting, and the dataset's copy keeps the source's other reader setting."""
    url = str(tmp_path / "c")
    write_small_cache(url, SMALL)
    with pytest.raises(SourceError, match="decode_threads"):
        LocalSource(url, decode_threads=0)
    src = LocalSource(url, decode_threads=2)
    assert "decode_threads=2" in repr(src) and "decode_threads" not in repr(LocalSource(url))
    assert pickle.loads(pickle.dumps(src)).decode_threads == 2
    assert src.reader.decode_threads == 2
    got, want = src.fetch([5, 2, 30]), LocalSource(url).fetch([5, 2, 30])
    assert sorted(got) == sorted(want) == [2, 5, 30]
    assert all(got[i].equals(want[i]) for i in want)
    assert make_dataset(src, **OPTS).source.reader.decode_threads == 2
    given = LocalSource(url, max_gap_tokens=7)
    ds = make_dataset(given, decode_threads=4, **OPTS)
    assert (ds.source.max_gap_tokens, ds.source.decode_threads) == (7, 4)
    assert given.decode_threads == 1  # the given source is left as it is


def test_decode_threads_over_the_http_store_transport(tmp_path) -> None:
    """The store transport's reader (a LocalSource over the store URL) gets the threads, from
    the source and from the dataset (a server URL or a given HttpSource), in pickled copies too."""
    url = tmp_path / "c"
    write_small_cache(str(url), SMALL)
    with StoreServer(tmp_path) as server:
        src = HttpSource(server.url, "c", decode_threads=2)
        assert src.reader.decode_threads == 2
        copy = pickle.loads(pickle.dumps(src))
        assert copy.decode_threads == 2 and copy.reader.decode_threads == 2
        got = src.fetch([0, 7, 39])
        want = CacheReader(url).sequences([0, 7, 39])
        assert all(got[i].equals(w) for i, w in zip([0, 7, 39], want, strict=True))
        plain = collect(make_dataset(str(url), **OPTS))
        ds = make_dataset(server.url, cache="c", decode_threads=3, **OPTS)
        assert ds.source.reader.decode_threads == 3
        assert same_stream(collect(ds), plain)
        given = HttpSource(server.url, "c", max_gap_tokens=7)
        ds = make_dataset(given, decode_threads=2, **OPTS)
        assert ds.source.decode_threads == 2 and ds.source.max_gap_tokens == 7
        assert ds.source.reader.decode_threads == 2 and given.decode_threads == 1


def test_decode_threads_are_checked(tmp_path) -> None:
    url = str(tmp_path / "c")
    write_small_cache(url, SMALL)
    with pytest.raises(ConfigError, match="decode_threads"):
        CacheDataset(url, read=ReadOptions(decode_threads=0))

    class Other(LocalSource):  # a source of another type: its reader is not the dataset's to set
        pass

    with pytest.raises(ConfigError, match="decode_threads"):
        CacheDataset(Other(url), read=ReadOptions(decode_threads=2))

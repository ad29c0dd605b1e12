"""How a shuffled stream of large rows is read (``readahead.read_granularity``): hidden rows
of ``UNIT_READ_ROW_BYTES`` or more are read unit by unit, only the sequences each unit needs,
and the stream is the one whole-block reads give, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from client_support import build_cache, collect, make_dataset, make_sequences, same_stream
from format_support import hidden_manifest, make_head, make_hidden_records
from logitcache.cache_format import CacheReader, CacheWriter
from logitcache.client import StreamConfig, readahead
from logitcache.client.readahead import UNIT_READ_ROW_BYTES, read_granularity, row_bytes
from logitcache.client.sources import LocalSource

D = 1100  # 2,200 B bfloat16 rows: read unit by unit
SHUFFLE = {"shuffle_block_size": 4, "shuffle_window": 2, "lanes": 3}
SETTINGS = {"tokens_per_item": 48, "mode": "pack", "batch_size": 2, "seed": 3, **SHUFFLE}


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("hidden_reads")
    head = make_head(50, D, seed=2)
    with CacheWriter.open(root / "h", hidden_manifest(head), head=head) as w:
        w.append(make_hidden_records(40, 50, D, seed=5, max_len=60))
    return str(root / "h")


def test_granularity_by_row_size(url, tmp_path) -> None:
    big = row_bytes(CacheReader(url).manifest)
    assert big == 2 * D >= UNIT_READ_ROW_BYTES
    build_cache(tmp_path / "t", make_sequences(3))
    small = row_bytes(CacheReader(tmp_path / "t").manifest)
    assert small < UNIT_READ_ROW_BYTES
    shuffled = StreamConfig(batch_size=4, **SHUFFLE)
    assert read_granularity(shuffled, big) == (1, 1)
    assert read_granularity(shuffled, small) == (4, 1)
    uniform = StreamConfig(batch_size=4)
    assert read_granularity(uniform, small) == (1, readahead.FETCH_ITEMS // 4)
    assert read_granularity(StreamConfig(shuffle=False), big)[0] == readahead.SEQUENTIAL_BLOCK


def test_large_rows_read_each_units_sequences_once_and_the_stream_is_unchanged(
    url, monkeypatch
) -> None:
    fetched: list[list[int]] = []
    ranged: list[int] = []
    fetch, read_ranges = LocalSource.fetch, CacheReader.read_ranges

    def spy_fetch(self, indices):
        fetched.append(sorted(int(i) for i in indices))
        return fetch(self, indices)

    def spy_ranges(self, ranges, *args, **kwargs):
        ranged.extend(i for a, b in ranges for i in range(a, b))
        return read_ranges(self, ranges, *args, **kwargs)

    monkeypatch.setattr(LocalSource, "fetch", spy_fetch)
    monkeypatch.setattr(CacheReader, "read_ranges", spy_ranges)
    ds = make_dataset(url, read_threads=2, **SETTINGS)
    units = collect(ds)
    plan = ds.plan()
    seen: set[int] = set()
    firsts = []
    for u in range(len(units)):
        need = plan.sequences_of(range(2 * u, min(2 * u + 2, plan.num_items)))
        first = sorted(set(need.tolist()) - seen)
        seen |= set(first)
        if first:
            firsts.append(first)
    assert fetched == firsts  # one read per unit, of the sequences it is first to need
    assert sorted(ranged) == sorted(i for f in fetched for i in f)  # no unwanted sequence
    assert len(seen) == ds.num_sequences
    monkeypatch.setattr(readahead, "UNIT_READ_ROW_BYTES", 1 << 30)  # whole-block reads
    fetched.clear()
    blocks = collect(make_dataset(url, read_threads=2, **SETTINGS))
    assert all(len(f) == 4 or max(f) == 39 for f in fetched)
    assert same_stream(blocks, units)
    assert any(np.any(u["hidden"]) for u in units)

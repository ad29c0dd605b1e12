"""HttpSource's store transport against the real store route under real uvicorn (no engine).

The route module (``server/routes_store.py``) is served by uvicorn in a thread with a
``CacheRegistry`` over a temporary store root; caches are written with ``CacheWriter``. Checked:
the HTTP source gives the same records and items as the local store, it sees appends only after a
commit (the root ``zarr.json`` is the commit point) and after ``refresh()``, a corrupted shard byte
is reported as a checksum error instead of wrong data, and a wrong key is refused.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from client_support import build_cache, collect, make_sequences, manifest, record_for, same_stream
from logitcache.cache_format import CacheWriter
from logitcache.cache_format.errors import ChecksumError, CorruptStoreError, StoreNotFoundError
from logitcache.client import CacheDataLoader, CacheDataset, HttpSource, LocalSource
from server_support import StoreServer

NUM_SEQ = 60


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("store-http")
    records = build_cache(root / "c", make_sequences(NUM_SEQ, seed=11, max_len=50))
    with StoreServer(root) as server:
        yield server, root, records


def test_http_store_source_equals_the_local_store(served) -> None:
    server, root, records = served
    remote = HttpSource(server.url, "c")
    local = LocalSource(str(root / "c"))
    assert remote.num_sequences == NUM_SEQ
    assert np.array_equal(remote.lengths, local.lengths)
    got = remote.fetch([0, 5, 6, 59])
    assert all(got[i].equals(records[i]) for i in (0, 5, 6, 59))
    settings = {"tokens_per_item": 64, "batch_size": 3, "seed": 4, "shuffle_block_size": 4}
    expected = collect(CacheDataset(str(root / "c"), **settings))
    assert same_stream(collect(CacheDataset(remote, **settings)), expected)
    assert same_stream(
        collect(CacheDataLoader(CacheDataset(remote, **settings), num_workers=2)), expected
    )


def test_http_store_source_sees_appends_after_commit_and_refresh(tmp_path: Path) -> None:
    root = tmp_path / "caches"
    first = build_cache(root / "live", make_sequences(10, seed=1, max_len=30))
    with StoreServer(root) as server:
        src = HttpSource(server.url, "live")
        assert src.num_sequences == 10
        more = [record_for(s, key=f"more-{i}") for i, s in enumerate(make_sequences(7, seed=2))]
        with CacheWriter.open(str(root / "live"), manifest()) as writer:
            writer.append(more)
        assert src.num_sequences == 10  # a snapshot until refresh
        src.refresh()
        assert src.num_sequences == 17
        got = src.fetch(range(17))
        assert all(got[i].equals(r) for i, r in enumerate(first + more))


def test_http_store_source_reports_a_corrupt_shard(tmp_path: Path) -> None:
    root = tmp_path / "caches"
    build_cache(root / "bad", make_sequences(12, seed=3, max_len=30))
    shard = next(
        p for p in sorted((root / "bad" / "topk_ids").rglob("*")) if p.is_file() and p.name == "0"
    )
    raw = bytearray(shard.read_bytes())
    raw[40] ^= 0xFF  # inside the first chunk's compressed bytes
    shard.write_bytes(bytes(raw))
    with StoreServer(root) as server:
        src = HttpSource(server.url, "bad")
        with pytest.raises((ChecksumError, CorruptStoreError)):
            src.fetch([0])
        with pytest.raises(StoreNotFoundError):
            _ = HttpSource(server.url, "missing").num_sequences

"""CacheDataset straight from an object store: a real S3 server (moto, 127.0.0.1)."""

from __future__ import annotations

import pytest
from client_support import build_cache, collect, make_dataset, make_sequences, same_stream
from logitcache.client import CacheDataLoader, CacheDataset, StreamConfig, open_source
from logitcache.client.errors import SourceError
from logitcache.client.sources import LocalSource
from torch.utils.data import DataLoader


def test_s3_items_equal_local_items_and_forked_obstore_fails_loudly(s3_store, tmp_path) -> None:
    url, options = s3_store
    seqs = make_sequences(40, seed=5)
    build_cache(url, seqs, storage_options=options)
    build_cache(str(tmp_path / "local"), seqs)
    settings = {"tokens_per_item": 48, "mode": "pack", "seed": 3, "batch_size": 2}
    remote = make_dataset(url, storage_options=options, **settings)
    local = make_dataset(str(tmp_path / "local"), **settings)
    assert same_stream(collect(remote), collect(local))
    # obstore does not survive fork: a forked worker must raise, not hang
    assert not remote.source.fork_safe and LocalSource(str(tmp_path)).fork_safe
    with pytest.raises(SourceError, match="does not survive fork"):
        collect(DataLoader(remote, batch_size=None, num_workers=1, multiprocessing_context="fork"))
    # ... and CacheDataLoader starts its workers with spawn for such a source
    assert CacheDataLoader(remote, num_workers=2).multiprocessing_context is not None


@pytest.mark.slow  # ~20 s on 2 shared cores: s3fs sessions start slowly in forked workers
def test_s3_through_fsspec_survives_fork(s3_store) -> None:
    url, options = s3_store
    build_cache(url, make_sequences(12, seed=2), storage_options=options)
    ds = CacheDataset(
        open_source(url, storage_options={**options, "backend": "fsspec"}),
        StreamConfig(tokens_per_item=64),
    )
    assert ds.source.fork_safe
    forked = collect(CacheDataLoader(ds, num_workers=2, multiprocessing_context="fork"))
    assert same_stream(forked, collect(ds))

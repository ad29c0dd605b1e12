"""``hf_iterable``: a ``CacheDataset`` as a Hugging Face ``datasets.IterableDataset``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from client_support import build_cache, make_sequences


@pytest.mark.parametrize("batch_size", [None, 3])
def test_hf_iterable_yields_the_dataset_items(tmp_path: Path, batch_size: int | None) -> None:
    import datasets
    from logitcache.client import CacheDataset
    from logitcache.client.hf import hf_iterable

    url = tmp_path / "cache"
    build_cache(url, make_sequences(12, seed=1, max_len=30))
    ds = CacheDataset(url, tokens_per_item=32, batch_size=batch_size, seed=3)
    hf = hf_iterable(ds)
    assert isinstance(hf, datasets.IterableDataset)
    assert set(hf.features) == set(next(iter(ds)))
    want = [{k: v.numpy() for k, v in unit.items()} for unit in ds]
    got = list(hf.with_format("torch"))
    assert len(got) == len(want) >= 2
    for a, b in zip(want, got, strict=True):
        for name in a:
            assert b[name].shape == a[name].shape, name
            np.testing.assert_array_equal(b[name].numpy(), a[name], err_msg=name)
    # a datasets pipeline on top: count the supervised rows
    rows = sum(int(np.sum(ex["loss_mask"])) for ex in hf.map(lambda ex: ex))
    assert rows == sum(int(u["loss_mask"].sum()) for u in want)


def test_hf_sequences_yields_the_cached_sequences(tmp_path: Path) -> None:
    import datasets
    from logitcache.client.hf import hf_sequences

    url = tmp_path / "cache"
    records = build_cache(url, make_sequences(9, seed=2, max_len=25))
    seqs = hf_sequences(str(url))
    assert isinstance(seqs, datasets.IterableDataset)
    got = list(seqs)
    assert [g["key"] for g in got] == [r.key for r in records]
    for g, r in zip(got, records, strict=True):
        np.testing.assert_array_equal(g["input_ids"], r.input_ids)
        np.testing.assert_array_equal(np.asarray(g["topk_ids"]), r.topk_ids)
        np.testing.assert_allclose(np.asarray(g["topk_logprobs"]), r.topk_logprobs, atol=1e-3)
        np.testing.assert_allclose(g["tail_mass"], r.tail_mass, atol=1e-3)

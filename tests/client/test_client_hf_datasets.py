"""``hf_iterable``: a ``CacheDataset`` as a Hugging Face ``datasets.IterableDataset``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from client_support import build_cache, make_sequences
from logitcache.client import StreamConfig


@pytest.mark.parametrize("batch_size", [None, 3])
def test_hf_iterable_yields_the_dataset_items(tmp_path: Path, batch_size: int | None) -> None:
    import datasets
    from logitcache.client import CacheDataset
    from logitcache.client.hf import hf_iterable

    url = tmp_path / "cache"
    build_cache(url, make_sequences(12, seed=1, max_len=30))
    ds = CacheDataset(url, StreamConfig(tokens_per_item=32, batch_size=batch_size, seed=3))
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


@pytest.mark.parametrize("batch_size", [None, 2])
def test_hf_iterable_streams_a_hidden_cache(tmp_path: Path, batch_size: int | None) -> None:
    """A hidden cache's units (FORMAT.md 4.10): ``hidden`` in place of the top-k arrays, widened
    from bfloat16 to float32 exactly, with ``target_kind``; every other array as ``CacheDataset``
    yields it."""
    import torch
    from format_support import hidden_manifest, make_head, make_hidden_records
    from logitcache.cache_format import CacheWriter
    from logitcache.client import CacheDataset
    from logitcache.client.hf import hf_iterable

    d = 16
    head = make_head(50, d, seed=2)
    with CacheWriter.open(tmp_path / "h", hidden_manifest(head, "bfloat16"), head=head) as w:
        w.append(make_hidden_records(10, 50, d, seed=4, max_len=30))
    ds = CacheDataset(tmp_path / "h", StreamConfig(tokens_per_item=32, batch_size=batch_size))
    hf = hf_iterable(ds)
    assert set(hf.features) == set(next(iter(ds))) and "topk_ids" not in hf.features
    want = list(ds)
    got = list(hf.with_format("torch"))
    assert len(got) == len(want) >= 2
    rows = 0
    for a, b in zip(want, got, strict=True):
        assert a["target_kind"] == b["target_kind"] == "hidden"
        assert a["hidden"].dtype == torch.bfloat16 and b["hidden"].dtype == torch.float32
        assert a["hidden"].shape == b["hidden"].shape and a["hidden"].shape[-1] == d
        assert torch.equal(b["hidden"].bfloat16(), a["hidden"])  # the same rows, bit for bit
        for name in set(a) - {"hidden", "target_kind"}:
            np.testing.assert_array_equal(b[name].numpy(), a[name].numpy(), err_msg=name)
        rows += int(a["loss_mask"].sum())
    assert rows > 0 and bool((got[0]["hidden"] != 0).any())

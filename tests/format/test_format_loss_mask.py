"""The optional per-row loss mask (FORMAT.md 4.6): written, read by every path (sequence,
sequences, rows, read_ranges), carried by the wire codec, checked by ``validate``, and folded into
``CacheDataset``'s ``loss_mask``. Real zarr stores in ``tmp_path``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import zarr
from format_support import make_manifest, make_records, reseal, write_store
from logitcache.cache_format import (
    CacheReader,
    CacheWriter,
    SequenceRecord,
    decode_records,
    encode_records,
    validate,
)
from logitcache.cache_format.errors import RecordError
from logitcache.client import StreamConfig

K, V = 4, 50


def with_mask(rec: SequenceRecord, mask: np.ndarray | None) -> SequenceRecord:
    return SequenceRecord(
        rec.key, rec.input_ids, rec.topk_ids, rec.topk_logprobs, rec.tail_mass, mask
    )


def prompt_response(rec: SequenceRecord, prompt_tokens: int) -> np.ndarray:
    """Rows predicting tokens ``>= prompt_tokens`` are trained on (row j predicts token j+1)."""
    return (np.arange(1, rec.length) >= prompt_tokens).astype(np.uint8)


@pytest.fixture
def masked(tmp_path):
    """A loss-mask store: 6 records with masks, one without (stored as all 1)."""
    recs = make_records(7, k=K, vocab=V, seed=3, min_len=3, max_len=30)
    out = [with_mask(r, prompt_response(r, 2 + i % 3)) for i, r in enumerate(recs[:6])]
    out.append(recs[6])
    url = tmp_path / "m.zarr"
    write_store(url, out, k=K, vocab=V, split=4, loss_mask=True)
    return url, out


def test_round_trip_every_read_path(masked) -> None:
    url, recs = masked
    want = [r.loss_mask if r.loss_mask is not None else np.ones(r.num_rows, np.uint8) for r in recs]
    assert want[-1].all() and not want[0].all()
    r = CacheReader(url)
    assert r.manifest.loss_mask is True
    for i, m in enumerate(want):
        got = r.sequence(i).loss_mask
        assert got.dtype == np.uint8 and np.array_equal(got, m)
    for got, m in zip(r.sequences([5, 0, 2]), [want[5], want[0], want[2]], strict=True):
        assert np.array_equal(got.loss_mask, m)
    for got, m in zip(r.read_ranges([(1, 4), (6, 7)]), want[1:4] + want[6:], strict=True):
        assert np.array_equal(got.loss_mask, m)
    block = r.rows(0, r.num_rows)
    assert np.array_equal(block.loss_mask, np.concatenate(want))
    t = r.sequence(0)
    assert t.to_torch()["loss_mask"].dtype.is_floating_point is False
    assert validate(url).ok
    attrs = json.loads((url / "zarr.json").read_text())["attributes"]["logitcache"]
    assert attrs["loss_mask"] is True


def test_store_without_mask_reads_none_and_keeps_its_manifest(tmp_path) -> None:
    url = tmp_path / "plain.zarr"
    write_store(url, make_records(3, k=K, vocab=V, seed=1), k=K, vocab=V)
    r = CacheReader(url)
    assert r.sequence(0).loss_mask is None and r.rows(0, 2).loss_mask is None
    assert "loss_mask" not in r.sequence(0).to_torch()
    assert not (url / "loss_mask").exists()
    attrs = json.loads((url / "zarr.json").read_text())["attributes"]["logitcache"]
    assert "loss_mask" not in attrs  # stores without a mask keep the exact manifest they had
    # a masked record into it is refused and writes nothing
    bad = with_mask(make_records(1, k=K, vocab=V, seed=9, prefix="x")[0], None)
    bad = with_mask(bad, np.zeros(bad.num_rows, np.uint8))
    gen = r.manifest.generation
    with CacheWriter.open(url, make_manifest(k=K, vocab_size=V, loss_mask=True)) as w:
        assert w.manifest.loss_mask is False  # the store's value wins (not an identity field)
        with pytest.raises(RecordError, match="loss_mask"):
            w.append([bad])
    r.refresh()
    assert r.manifest.generation == gen and r.num_sequences == 3


def test_bad_masks_are_refused() -> None:
    rec = make_records(1, k=K, vocab=V, seed=2, min_len=5, max_len=5)[0]
    for bad, msg in [
        (np.ones(rec.length, np.uint8), r"\[L-1="),
        (np.full(rec.num_rows, 2), "0 or 1"),
        (np.full(rec.num_rows, 0.5), "dtype"),
    ]:
        with pytest.raises(RecordError, match=msg):
            with_mask(rec, bad)
    assert with_mask(rec, np.ones(rec.num_rows, bool)).loss_mask.dtype == np.uint8


def test_wire_carries_the_mask(masked) -> None:
    _, recs = masked
    got = decode_records(encode_records(recs, compression="zstd"))
    for a, b in zip(recs[:-1], got[:-1], strict=True):
        assert np.array_equal(a.loss_mask, b.loss_mask)
    assert got[-1].loss_mask.all()  # a record without a mask travels as all 1
    plain = [with_mask(r, None) for r in recs]
    assert all(r.loss_mask is None for r in decode_records(encode_records(plain)))


def test_validate_reports_bad_mask_values_and_a_missing_array(masked) -> None:
    url, _ = masked
    arr = zarr.open_array(str(url), path="loss_mask", mode="r+")
    arr[3] = 7
    reseal(url, "loss_mask")
    rep = validate(url)
    assert "loss_mask_value" in rep.codes() and "row 3" in str(rep)
    import shutil

    shutil.rmtree(url / "loss_mask")
    assert "array_missing" in validate(url).codes()


def test_cache_dataset_masks_prompt_rows(masked) -> None:
    from logitcache.client import CacheDataset

    url, recs = masked
    ds = CacheDataset(
        str(url), StreamConfig(tokens_per_item=32, mode="pad", shuffle=False, batch_size=None)
    )
    items = list(ds)
    assert len(items) == len(recs)
    for item, rec in zip(items, recs, strict=True):
        n = rec.num_rows
        want = np.ones(n, bool) if rec.loss_mask is None else rec.loss_mask.astype(bool)
        assert item["loss_mask"][:n].numpy().tolist() == want.tolist()
        assert not item["loss_mask"][n:].any()
        assert item["labels"][:n].tolist() == rec.input_ids[1:].tolist()  # labels keep tokens

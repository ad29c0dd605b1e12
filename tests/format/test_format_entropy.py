"""The optional per-row teacher entropy (FORMAT.md 4.9): written as float16, read by every path
(sequence, sequences, rows, read_ranges, torch), carried by the wire codec,
checked by ``validate``; stores without it read as before. Real zarr stores in ``tmp_path``.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

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
from logitcache.cache_format.errors import RecordError, WireFormatError
from logitcache.cache_format.spec import LAYOUTS

K, V = 4, 50


def with_entropy(rec: SequenceRecord, ent: np.ndarray | None) -> SequenceRecord:
    return replace(rec, entropy=ent)


def entropies(recs: list[SequenceRecord], seed: int = 5) -> list[SequenceRecord]:
    rng = np.random.default_rng(seed)
    return [with_entropy(r, rng.uniform(0, np.log(V), r.num_rows)) for r in recs]


@pytest.fixture(params=["default", "random_access_raw"])
def stored(tmp_path, request):
    recs = entropies(make_records(7, k=K, vocab=V, seed=3, min_len=2, max_len=30))
    url = tmp_path / "e.zarr"
    write_store(url, recs, k=K, vocab=V, split=4, layout=LAYOUTS[request.param], entropy=True)
    return url, recs


def f16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(np.float16)


def test_round_trip_every_read_path(stored) -> None:
    url, recs = stored
    want = [f16(r.entropy) for r in recs]
    with CacheReader(url) as r:
        assert r.manifest.entropy is True
        for i, e in enumerate(want):
            got = r.sequence(i).entropy
            assert got.dtype == np.float16 and np.array_equal(got, e)
        got_many = r.sequences([5, 0, 2, 6, 1])
        for got, e in zip(got_many, [want[5], want[0], want[2], want[6], want[1]], strict=True):
            assert np.array_equal(got.entropy, e)
        ranges = r.read_ranges([(1, 4), (6, 7), (0, 2)])
        for got, e in zip(ranges, want[1:4] + want[6:] + want[0:2], strict=True):
            assert np.array_equal(got.entropy, e)
        assert np.array_equal(r.rows(3, r.num_rows - 2).entropy, np.concatenate(want)[3:-2])
        t = r.sequence(2).to_torch()["entropy"]
        assert t.dtype.is_floating_point and np.array_equal(t.numpy(), want[2].astype(np.float32))
    assert validate(url).ok
    attrs = json.loads((url / "zarr.json").read_text())["attributes"]["logitcache"]
    assert attrs["entropy"] is True


def test_reader_pickles_records_with_entropy(stored) -> None:
    import pickle

    url, recs = stored
    rec = CacheReader(url).sequence(1)
    back = pickle.loads(pickle.dumps(rec))
    assert np.array_equal(back.entropy, f16(recs[1].entropy))


def test_store_without_entropy_reads_none_and_refuses_it(tmp_path) -> None:
    url = tmp_path / "plain.zarr"
    write_store(url, make_records(3, k=K, vocab=V, seed=1), k=K, vocab=V)
    r = CacheReader(url)
    assert r.sequence(0).entropy is None and r.rows(0, 2).entropy is None
    assert all(x.entropy is None for x in r.read_ranges([(0, 3)]))
    assert "entropy" not in r.sequence(0).to_torch()
    assert not (url / "entropy").exists()
    attrs = json.loads((url / "zarr.json").read_text())["attributes"]["logitcache"]
    assert "entropy" not in attrs  # old stores keep their exact manifest
    gen = r.manifest.generation
    bad = entropies(make_records(2, k=K, vocab=V, seed=9, prefix="x"))
    with CacheWriter.open(url, make_manifest(k=K, vocab_size=V, entropy=True)) as w:
        assert w.manifest.entropy is False  # the store's value wins
        with pytest.raises(RecordError, match="entropy"):
            w.append(bad)
    r.refresh()
    assert r.manifest.generation == gen and r.num_sequences == 3


def test_entropy_store_refuses_a_record_without_and_writes_nothing(stored) -> None:
    url, _ = stored
    gen = CacheReader(url).manifest.generation
    good = entropies(make_records(2, k=K, vocab=V, seed=8, prefix="y"))
    with CacheWriter.open(url, make_manifest(k=K, vocab_size=V, entropy=True)) as w:
        with pytest.raises(RecordError, match="entropy") as e:
            w.append([good[0], with_entropy(good[1], None)])
        assert e.value.index == 1
    r = CacheReader(url)
    assert r.manifest.generation == gen and "y0" not in r


def test_bad_entropy_is_refused() -> None:
    rec = make_records(1, k=K, vocab=V, seed=2, min_len=5, max_len=5)[0]
    for bad, msg in [
        (np.ones(rec.length), r"\[L-1="),
        (np.full(rec.num_rows, -0.5), ">= 0"),
        (np.full(rec.num_rows, np.nan), "finite"),
        (np.array(["a"] * rec.num_rows), "numbers"),
    ]:
        with pytest.raises(RecordError, match=msg):
            with_entropy(rec, bad)


def test_wire_carries_entropy(stored) -> None:
    _, recs = stored
    got = decode_records(encode_records(recs, compression="zstd"))
    for a, b in zip(recs, got, strict=True):
        assert np.array_equal(f16(a.entropy).astype(np.float32), b.entropy)
    plain = [with_entropy(r, None) for r in recs]
    assert all(r.entropy is None for r in decode_records(encode_records(plain)))
    with pytest.raises(WireFormatError, match="entropy"):
        encode_records([recs[0], plain[1]])


def test_validate_reports_bad_values_and_a_missing_array(stored) -> None:
    url, _ = stored
    arr = zarr.open_array(str(url), path="entropy", mode="r+")
    arr[3] = np.float16(np.log(V) + 1)
    arr[5] = np.float16(np.nan)
    reseal(url, "entropy")
    rep = validate(url)
    assert "entropy_value" in rep.codes() and "row 3" in str(rep) and "row 5" in str(rep)
    shutil.rmtree(url / "entropy")
    assert "array_missing" in validate(url).codes()

"""The optional per-row logprob of the actual next token (FORMAT.md 4.12): written as float32,
read bit-exact by every path (sequence, sequences, rows, read_ranges, torch,
pickling), carried by the wire codec, checked by ``validate``, listed by ``logitcache info``;
stores without it read as before. Real zarr stores in ``tmp_path``."""

from __future__ import annotations

import json
import pickle
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


def actuals(recs: list[SequenceRecord], seed: int = 5) -> list[SequenceRecord]:
    rng = np.random.default_rng(seed)
    out = []
    for r in recs:
        a = -rng.exponential(3.0, r.num_rows).astype(np.float32)
        a[0] = -np.inf  # a zero-probability token is a legal value
        out.append(replace(r, actual_logprob=a))
    return out


@pytest.fixture(params=["default", "random_access_raw"])
def stored(tmp_path, request):
    recs = actuals(make_records(7, k=K, vocab=V, seed=3, min_len=2, max_len=30))
    url = tmp_path / "a.zarr"
    recs = [replace(r, entropy=np.ones(r.num_rows)) for r in recs]  # both arrays side by side
    layout = LAYOUTS[request.param]
    write_store(url, recs, k=K, vocab=V, layout=layout, split=4, actual_logprob=True, entropy=True)
    return url, recs


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == np.float32 and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_round_trip_every_read_path(stored) -> None:
    url, recs = stored
    want = [r.actual_logprob for r in recs]
    with CacheReader(url) as r:
        assert r.manifest.actual_logprob is True
        for i, a in enumerate(want):
            assert same(r.sequence(i).actual_logprob, a)
        for got, i in zip(r.sequences([5, 0, 2, 6, 1]), [5, 0, 2, 6, 1], strict=True):
            assert same(got.actual_logprob, want[i]) and got.entropy is not None
        ranges = r.read_ranges([(1, 4), (6, 7), (0, 2)])
        for got, a in zip(ranges, want[1:4] + want[6:] + want[0:2], strict=True):
            assert same(got.actual_logprob, a)
        block = r.rows(3, r.num_rows - 2)
        assert same(block.actual_logprob, np.concatenate(want)[3:-2])
        assert block.entropy is not None
        t = r.sequence(2).to_torch()["actual_logprob"]
        assert np.array_equal(t.numpy(), want[2])
        back = pickle.loads(pickle.dumps(r.sequence(1)))
        assert same(back.actual_logprob, want[1])
    assert validate(url).ok
    attrs = json.loads((url / "zarr.json").read_text())["attributes"]["logitcache"]
    assert attrs["actual_logprob"] is True


def test_store_without_it_reads_none_and_refuses_it(tmp_path) -> None:
    url = tmp_path / "plain.zarr"
    with CacheWriter.open(url, make_manifest(k=K, vocab_size=V)) as w:
        w.append(make_records(3, k=K, vocab=V, seed=1))
    r = CacheReader(url)
    assert r.sequence(0).actual_logprob is None and r.rows(0, 2).actual_logprob is None
    assert "actual_logprob" not in r.sequence(0).to_torch()
    attrs = json.loads((url / "zarr.json").read_text())["attributes"]["logitcache"]
    assert "actual_logprob" not in attrs and not (url / "actual_logprob").exists()
    gen = r.manifest.generation
    bad = actuals(make_records(2, k=K, vocab=V, seed=9, prefix="x"))
    with CacheWriter.open(url, make_manifest(k=K, vocab_size=V, actual_logprob=True)) as w:
        assert w.manifest.actual_logprob is False  # the store's value wins
        with pytest.raises(RecordError, match="actual_logprob"):
            w.append(bad)
    r.refresh()
    assert r.manifest.generation == gen and r.num_sequences == 3


def test_store_with_it_refuses_a_record_without_and_writes_nothing(stored) -> None:
    url, _ = stored
    gen = CacheReader(url).manifest.generation
    good = actuals(make_records(2, k=K, vocab=V, seed=8, prefix="y"))
    good = [replace(r, entropy=np.ones(r.num_rows)) for r in good]
    m = make_manifest(k=K, vocab_size=V, actual_logprob=True, entropy=True)
    with CacheWriter.open(url, m) as w:
        with pytest.raises(RecordError, match="actual") as e:
            w.append([good[0], replace(good[1], actual_logprob=None)])
        assert e.value.index == 1
    r = CacheReader(url)
    assert r.manifest.generation == gen and "y0" not in r


def test_bad_values_are_refused() -> None:
    rec = make_records(1, k=K, vocab=V, seed=2, min_len=5, max_len=5)[0]
    for bad, msg in [
        (np.zeros(rec.length), r"\[L-1="),
        (np.full(rec.num_rows, 0.5), "<= 0"),
        (np.full(rec.num_rows, np.nan), "NaN"),
    ]:
        with pytest.raises(RecordError, match=msg):
            replace(rec, actual_logprob=bad)


def test_wire_carries_it(stored) -> None:
    _, recs = stored
    got = decode_records(encode_records(recs, compression="zstd"))
    for a, b in zip(recs, got, strict=True):
        assert same(b.actual_logprob, a.actual_logprob)
    plain = [replace(r, actual_logprob=None) for r in recs]
    assert all(r.actual_logprob is None for r in decode_records(encode_records(plain)))
    with pytest.raises(WireFormatError, match="actual_logprob"):
        encode_records([recs[0], plain[1]])


def test_validate_and_info(stored) -> None:
    import typer
    from logitcache.cache_format.cli import info
    from typer.testing import CliRunner

    url, _ = stored
    app = typer.Typer()
    app.command()(info)
    out = CliRunner().invoke(app, [str(url)]).output
    assert "per-row arrays" in out and "entropy, actual_logprob" in out
    arr = zarr.open_array(str(url), path="actual_logprob", mode="r+")
    arr[3] = np.float32(0.25)
    arr[5] = np.float32(np.nan)
    reseal(url, "actual_logprob")
    rep = validate(url)
    assert "actual_value" in rep.codes() and "row 3" in str(rep) and "row 5" in str(rep)
    shutil.rmtree(url / "actual_logprob")
    assert "array_missing" in validate(url).codes()

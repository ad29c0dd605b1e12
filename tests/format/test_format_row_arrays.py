"""The optional per-row arrays, each test run for both: the teacher entropy (FORMAT.md 4.9, kept
as float16) and the logprob of the actual next token (4.12, float32, bit-exact). Each is read by
every path (sequence, sequences, rows, read_ranges, torch, pickling), carried by the wire codec,
checked by ``validate``, listed by ``logitcache info``; stores without it read as before and
refuse records carrying it. Real zarr stores in ``tmp_path``."""

from __future__ import annotations

import json
import pickle
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace

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


def _entropy(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.uniform(0, np.log(V), n)


def _actual(rng: np.random.Generator, n: int) -> np.ndarray:
    a = -rng.exponential(3.0, n).astype(np.float32)
    a[0] = -np.inf  # a zero-probability token is a legal value
    return a


@dataclass(frozen=True)
class RowArray:
    """One optional per-row array: its name, stored dtype, how a test draws values, the values a
    record refuses (with the error's text) and two a corrupt store holds (``validate``'s code)."""

    name: str
    dtype: type
    draw: Callable[[np.random.Generator, int], np.ndarray]
    refused: tuple[tuple[Callable[[int, int], np.ndarray], str], ...]
    corrupt: tuple[float, float]
    code: str

    def stored(self, values: np.ndarray) -> np.ndarray:
        return np.asarray(values, np.float32).astype(self.dtype)


ENTROPY = RowArray(
    "entropy",
    np.float16,
    _entropy,
    (
        (lambda L, n: np.ones(L), r"\[L-1="),
        (lambda L, n: np.full(n, -0.5), ">= 0"),
        (lambda L, n: np.full(n, np.nan), "finite"),
        (lambda L, n: np.array(["a"] * n), "numbers"),
    ),
    (np.log(V) + 1, np.nan),
    "entropy_value",
)
ACTUAL = RowArray(
    "actual_logprob",
    np.float32,
    _actual,
    (
        (lambda L, n: np.zeros(L), r"\[L-1="),
        (lambda L, n: np.full(n, 0.5), "<= 0"),
        (lambda L, n: np.full(n, np.nan), "NaN"),
    ),
    (0.25, np.nan),
    "actual_value",
)
ARRAYS = pytest.mark.parametrize("arr", [ENTROPY, ACTUAL], ids=lambda a: a.name)


def filled(recs: list[SequenceRecord], *arrays: RowArray, seed: int = 5) -> list[SequenceRecord]:
    rng = np.random.default_rng(seed)
    return [replace(r, **{a.name: a.draw(rng, r.num_rows) for a in arrays}) for r in recs]


def same(got: np.ndarray, want: np.ndarray) -> bool:
    return got.dtype == want.dtype and np.array_equal(got, want)


@pytest.fixture(params=["default", "random_access_raw"])
def stored(tmp_path, request):
    """A store with both arrays side by side, in two appends."""
    recs = filled(make_records(7, k=K, vocab=V, seed=3, min_len=2, max_len=30), ENTROPY, ACTUAL)
    url = tmp_path / "a.zarr"
    layout = LAYOUTS[request.param]
    write_store(url, recs, k=K, vocab=V, layout=layout, split=4, actual_logprob=True, entropy=True)
    return url, recs


@ARRAYS
def test_round_trip_every_read_path(stored, arr: RowArray) -> None:
    url, recs = stored
    want = [arr.stored(getattr(r, arr.name)) for r in recs]
    with CacheReader(url) as r:
        assert getattr(r.manifest, arr.name) is True
        for i, a in enumerate(want):
            assert same(getattr(r.sequence(i), arr.name), a)
        for got, i in zip(r.sequences([5, 0, 2, 6, 1]), [5, 0, 2, 6, 1], strict=True):
            assert same(getattr(got, arr.name), want[i])
        ranges = r.read_ranges([(1, 4), (6, 7), (0, 2)])
        for got, a in zip(ranges, want[1:4] + want[6:] + want[0:2], strict=True):
            assert same(getattr(got, arr.name), a)
        assert same(getattr(r.rows(3, r.num_rows - 2), arr.name), np.concatenate(want)[3:-2])
        t = r.sequence(2).to_torch()[arr.name]
        assert t.dtype.is_floating_point and np.array_equal(t.numpy(), want[2].astype(np.float32))
        back = pickle.loads(pickle.dumps(r.sequence(1)))
        assert same(getattr(back, arr.name), want[1])
    assert validate(url).ok
    attrs = json.loads((url / "zarr.json").read_text())["attributes"]["logitcache"]
    assert attrs[arr.name] is True


@ARRAYS
def test_store_without_it_reads_none_and_refuses_it(tmp_path, arr: RowArray) -> None:
    url = tmp_path / "plain.zarr"
    write_store(url, make_records(3, k=K, vocab=V, seed=1), k=K, vocab=V)
    r = CacheReader(url)
    assert getattr(r.sequence(0), arr.name) is None and getattr(r.rows(0, 2), arr.name) is None
    assert all(getattr(x, arr.name) is None for x in r.read_ranges([(0, 3)]))
    assert arr.name not in r.sequence(0).to_torch()
    attrs = json.loads((url / "zarr.json").read_text())["attributes"]["logitcache"]
    assert arr.name not in attrs and not (url / arr.name).exists()  # old stores keep their manifest
    gen = r.manifest.generation
    bad = filled(make_records(2, k=K, vocab=V, seed=9, prefix="x"), arr)
    with CacheWriter.open(url, make_manifest(k=K, vocab_size=V, **{arr.name: True})) as w:
        assert getattr(w.manifest, arr.name) is False  # the store's value wins
        with pytest.raises(RecordError, match=arr.name):
            w.append(bad)
    r.refresh()
    assert r.manifest.generation == gen and r.num_sequences == 3


@ARRAYS
def test_store_with_it_refuses_a_record_without_and_writes_nothing(stored, arr: RowArray) -> None:
    url, _ = stored
    gen = CacheReader(url).manifest.generation
    good = filled(make_records(2, k=K, vocab=V, seed=8, prefix="y"), ENTROPY, ACTUAL)
    m = make_manifest(k=K, vocab_size=V, actual_logprob=True, entropy=True)
    with CacheWriter.open(url, m) as w:
        with pytest.raises(RecordError, match=arr.name.split("_")[0]) as e:
            w.append([good[0], replace(good[1], **{arr.name: None})])
        assert e.value.index == 1
    r = CacheReader(url)
    assert r.manifest.generation == gen and "y0" not in r


@ARRAYS
def test_bad_values_are_refused(arr: RowArray) -> None:
    rec = make_records(1, k=K, vocab=V, seed=2, min_len=5, max_len=5)[0]
    for bad, msg in arr.refused:
        with pytest.raises(RecordError, match=msg):
            replace(rec, **{arr.name: bad(rec.length, rec.num_rows)})


@ARRAYS
def test_wire_carries_it(stored, arr: RowArray) -> None:
    _, recs = stored
    got = decode_records(encode_records(recs, compression="zstd"))
    for a, b in zip(recs, got, strict=True):
        sent = arr.stored(getattr(a, arr.name)).astype(np.float32)
        assert same(getattr(b, arr.name), sent)
    plain = [replace(r, **{arr.name: None}) for r in recs]
    assert all(getattr(r, arr.name) is None for r in decode_records(encode_records(plain)))
    with pytest.raises(WireFormatError, match=arr.name):
        encode_records([recs[0], plain[1]])


@ARRAYS
def test_validate_reports_bad_values_and_a_missing_array(stored, arr: RowArray) -> None:
    url, _ = stored
    z = zarr.open_array(str(url), path=arr.name, mode="r+")
    z[3], z[5] = (arr.dtype(x) for x in arr.corrupt)
    reseal(url, arr.name)
    rep = validate(url)
    assert arr.code in rep.codes() and "row 3" in str(rep) and "row 5" in str(rep)
    shutil.rmtree(url / arr.name)
    assert "array_missing" in validate(url).codes()


def test_info_lists_the_arrays(stored) -> None:
    import typer
    from logitcache.cache_format.cli import info
    from typer.testing import CliRunner

    url, _ = stored
    app = typer.Typer()
    app.command()(info)
    out = CliRunner().invoke(app, [str(url)]).output
    assert "per-row arrays" in out and "entropy, actual_logprob" in out

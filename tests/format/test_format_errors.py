"""Bad input gets a typed error and writes nothing; validate() reports every damaged invariant."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import zarr
from format_support import make_manifest, make_records
from logitcache.cache_format import (
    CacheReader,
    CacheWriter,
    FormatError,
    ManifestError,
    RecordError,
    SequenceRecord,
    StoreNotFoundError,
    UnsupportedVersionError,
    validate,
)


def _bad(rec: SequenceRecord, **fields) -> SequenceRecord:
    d = dict(
        key=rec.key,
        input_ids=rec.input_ids,
        topk_ids=rec.topk_ids,
        topk_logprobs=rec.topk_logprobs,
        tail_mass=rec.tail_mass,
    )
    d.update(fields)
    return SequenceRecord(**d)


def _store_bytes(path: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


def test_construction_errors():
    rec = make_records(1, seed=1, min_len=5)[0]
    with pytest.raises(RecordError, match="L >= 2"):
        SequenceRecord("a", [1], np.zeros((0, 8)), np.zeros((0, 8)))
    with pytest.raises(RecordError, match="topk_ids must be"):
        _bad(rec, topk_ids=rec.topk_ids[:-1])
    with pytest.raises(RecordError, match="shape"):
        _bad(rec, topk_logprobs=rec.topk_logprobs[:, :-1])
    with pytest.raises(RecordError, match="tail_mass"):
        _bad(rec, tail_mass=rec.tail_mass[:-1])
    with pytest.raises(RecordError, match="integers"):
        _bad(rec, input_ids=rec.input_ids.astype(np.float32))
    with pytest.raises(RecordError, match="int32 range"):
        _bad(rec, input_ids=rec.input_ids.astype(np.int64) + 2**33)
    with pytest.raises(RecordError, match="key"):
        _bad(rec, key="")
    assert issubclass(RecordError, FormatError) and issubclass(FormatError, ValueError)


def _mutations(rec: SequenceRecord, vocab: int):
    lp = rec.topk_logprobs
    nan = lp.copy()
    nan[1, 2] = np.nan
    pos = lp.copy()
    pos[0, 0] = 0.5
    unsorted = lp.copy()
    unsorted[2, [0, 1]] = unsorted[2, [1, 0]] - [0, 1]
    dup = rec.topk_ids.copy()
    dup[1, 1] = dup[1, 0]
    oov = rec.topk_ids.copy()
    oov[0, 3] = vocab
    neg = rec.input_ids.copy()
    neg[0] = -1
    tail = rec.tail_mass.copy()
    tail[0] = 1.5
    return {
        "NaN": _bad(rec, topk_logprobs=nan),
        "> 0": _bad(rec, topk_logprobs=pos),
        "sorted": _bad(rec, topk_logprobs=unsorted),
        "repeated": _bad(rec, topk_ids=dup),
        "vocab": _bad(rec, topk_ids=oov),
        "input_ids outside": _bad(rec, input_ids=neg),
        "tail_mass outside": _bad(rec, tail_mass=tail),
        "k mismatch": make_records(1, k=5, seed=2)[0],
    }


def test_bad_batch_writes_nothing(tmp_path):
    url = tmp_path / "c"
    good = make_records(6, seed=3, min_len=5)
    with CacheWriter.open(url, make_manifest()) as w:
        w.append(good[:3])
        before = _store_bytes(url)
        for match, bad in _mutations(good[4], 1000).items():
            with pytest.raises(RecordError, match=match) as e:
                w.append([good[3], bad, good[5]])  # good records around the bad one
            assert e.value.index == 1
            assert _store_bytes(url) == before, match
        with pytest.raises(RecordError, match="SequenceRecord"):
            w.append([{"key": "x"}])
        assert _store_bytes(url) == before
    r = CacheReader(url)
    assert r.keys == ["s0", "s1", "s2"]


def test_store_errors(tmp_path):
    with pytest.raises(StoreNotFoundError):
        CacheReader(tmp_path / "missing")
    with pytest.raises(ManifestError):
        CacheWriter.open(tmp_path / "x", {"k": 3})  # type: ignore[arg-type]
    zarr.create_group(zarr.storage.LocalStore(tmp_path / "foreign"), attributes={"a": 1})
    with pytest.raises(FormatError, match="not a logitcache store"):
        CacheWriter.open(tmp_path / "foreign", make_manifest())
    url = tmp_path / "c"
    with CacheWriter.open(url, make_manifest()) as w:
        w.append(make_records(2))
    meta = json.loads((url / "zarr.json").read_text())
    meta["attributes"]["format_version"] = 99
    (url / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(UnsupportedVersionError):
        CacheReader(url)
    with pytest.raises(UnsupportedVersionError):
        CacheWriter.open(url, make_manifest())
    assert "manifest" in validate(url).codes()


def test_validate_reports_every_problem(tmp_path):
    url = tmp_path / "c"
    recs = make_records(12, seed=4, min_len=4)
    # version 3: stock zarr's writes below keep no shard seal, which a version-4 store refuses
    # before any value check (FORMAT.md 4.8); the value invariants are the same in both
    m = make_manifest(logprob_dtype="float32", id_remap=False, format_version=3)
    with CacheWriter.open(url, m) as w:
        w.append(recs)
    assert validate(url).ok
    store = zarr.storage.LocalStore(url)
    ids = zarr.open_array(store, path="topk_ids", mode="r+")
    ids[0, 0] = 5000  # out of vocab
    ids[3, 1] = ids[3, 0]  # repeated
    tail = zarr.open_array(store, path="tail_mass", mode="r+")
    tail[5] = 2.0
    lengths = zarr.open_array(store, path="seq_lengths", mode="r+")
    lengths[2] = 1
    keys = zarr.open_array(store, path="seq_keys", mode="r+")
    keys[7] = "s1"
    lp = zarr.open_array(store, path="topk_logprobs", mode="r+")
    row = lp[10]
    row[1:2] = np.array([0.5], np.float32).view(np.uint32) - row[0:1]  # decodes to +0.5
    lp[10] = row
    report = validate(url)
    want = {
        "id_out_of_vocab",
        "id_repeated",
        "tail_range",
        "seq_too_short",
        "key_duplicate",
        "token_offsets",
        "row_offsets",
        "count_tokens",
        "count_rows",
        "logprob_positive",
        "logprob_order",
    }
    assert want <= report.codes(), str(report)
    assert not report.ok
    # a damaged chunk is reported, not raised
    shard = next((url / "tail_mass" / "c").rglob("*"))
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert "unreadable" in validate(url).codes()


@pytest.mark.parametrize("ascii_keys", [True, False])
def test_validate_compares_keys_with_their_bytes(tmp_path, ascii_keys):
    """validate hashes the keys from ``seq_key_bytes`` when they hold exactly the keys, and
    names every sequence whose bytes differ (keys of 1-byte and multi-byte characters)."""
    url = tmp_path / "c"
    recs = [
        _bad(r, key=r.key if ascii_keys else f"ключ-{i}-λ")
        for i, r in enumerate(make_records(9, seed=3))
    ]
    m = make_manifest(format_version=3)  # stock zarr's writes below keep no shard seal
    with CacheWriter.open(url, m) as w:
        w.append(recs)
    assert validate(url).ok
    raw = zarr.open_array(zarr.storage.LocalStore(url), path="seq_key_bytes", mode="r+")
    ends = zarr.open_array(zarr.storage.LocalStore(url), path="seq_key_end", mode="r")[:]
    at = int(ends[3]) + 1  # a byte of sequence 4's key
    raw[at] = (int(raw[at]) + 1) % 256
    report = validate(url)
    assert "key_bytes" in report.codes(), str(report)
    where = next(p for p in report.problems if p.code == "key_bytes").where
    assert where == ["sequence 4"], where

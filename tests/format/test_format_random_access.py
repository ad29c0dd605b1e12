"""Random access: point reads and the ``random_access`` layout preset.

``CacheReader.sequence`` / ``sequences`` read only the inner chunks they need, each decoded once
per call (``_pointread.py``, FORMAT.md D4); they must return bit-identical values to stock
zarr reading the same store (``ZarrReader``) for every encoding, id remap, loss mask, repeated
and unsorted indices, ranges across chunk and shard edges, with and without decode threads, on a
local and an S3 store. The ``random_access`` preset (FORMAT.md 4.7) is chosen at write time,
recorded in the store, kept by a later writer given another layout, and validates.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from format_support import (
    CASES,
    SMALL,
    K,
    ZarrReader,
    assert_same_record,
    make_manifest,
    make_records,
    write_small_cache,
)
from logitcache.cache_format import CacheReader, CacheWriter, SequenceRecord, spec, validate
from logitcache.cache_format import _pointread as pointread
from logitcache.cache_format.errors import ChecksumError, CorruptStoreError


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: ",".join(kw) or "float16")
@pytest.mark.parametrize("threads", [1, 3])
def test_point_reads_equal_the_range_path(tmp_path, monkeypatch, kw, threads):
    monkeypatch.setattr(pointread, "PARALLEL_MIN_BYTES", 0)  # tiny chunks go to the threads too
    recs = write_small_cache(tmp_path / "c", SMALL, **kw)
    point = CacheReader(tmp_path / "c", decode_threads=threads)
    ranged = ZarrReader(tmp_path / "c")
    for i in range(len(recs)):
        assert_same_record(point.sequence(i), ranged.sequence(i))
        assert np.array_equal(point.sequence(i).topk_ids, recs[i].topk_ids)
    idx = [5, 3, 5, 39, 0, 22, 21, 22, 38, 1]  # unsorted, repeated, neighbours sharing chunks
    got = point.sequences(idx)
    assert [g.key for g in got] == [recs[i].key for i in idx]
    for g, want in zip(got, ranged.sequences(idx), strict=True):
        assert_same_record(g, want)
    assert point.sequences([]) == []
    # the whole store in one call: every chunk is shared by several sequences
    for g, want in zip(point.sequences(range(len(recs))), recs, strict=True):
        assert np.array_equal(g.topk_ids, want.topk_ids)
        assert np.array_equal(g.input_ids, want.input_ids)


@pytest.mark.parametrize(
    "kw",
    [*CASES, {"logprob_dtype": "float32", "tail_mass_dtype": "float16"}],
    ids=lambda kw: ",".join(kw) or "float16",
)
def test_records_hold_the_dtypes_asked_for(tmp_path, kw):
    """A reader builds its records without the constructor's checks (``SequenceRecord.trusted``):
    every array has the dtype and shape the constructor would give it, on both paths, and the
    logprobs are the ``logprob_dtype`` asked for (float16 stays float16)."""
    write_small_cache(tmp_path / "c", SMALL, **kw)
    for decoder in ("numba", "numpy"):
        r = CacheReader(tmp_path / "c", decoder=decoder)
        for dtype in ("float32", "float16"):
            for rec in r.sequences([3, 0, 39, 3], logprob_dtype=dtype):
                checked = SequenceRecord(
                    rec.key, rec.input_ids, rec.topk_ids, rec.topk_logprobs, rec.tail_mass,
                    rec.loss_mask,
                )  # fmt: skip
                # the constructor keeps a record's logprobs float32: same bits, or same values
                assert rec.equals(checked) if dtype == "float32" else rec.key == checked.key
                assert np.array_equal(rec.topk_logprobs, checked.topk_logprobs)
                assert rec.input_ids.dtype == rec.topk_ids.dtype == np.int32
                assert rec.topk_logprobs.dtype == np.dtype(dtype)
                assert rec.tail_mass.dtype == np.float32
                assert rec.tail_mass.shape == (rec.length - 1,)
                assert rec.loss_mask is None or rec.loss_mask.dtype == np.uint8


def test_point_reads_torch_output_and_float16_request(tmp_path):
    write_small_cache(tmp_path / "c", SMALL)
    r = CacheReader(tmp_path / "c", as_torch=True, decode_threads=2)
    ranged = CacheReader(tmp_path / "c", as_torch=True, decoder="numpy")
    a, b = r.sequence(7, logprob_dtype="float16"), ranged.sequence(7, logprob_dtype="float16")
    assert set(a) == set(b)
    for name in a:
        if hasattr(a[name], "dtype"):
            assert a[name].dtype == b[name].dtype and bool((a[name] == b[name]).all()), name


def test_point_read_of_a_damaged_chunk_is_a_checksum_error(tmp_path, monkeypatch):
    monkeypatch.setattr(pointread, "PARALLEL_MIN_BYTES", 0)  # the error comes from a thread
    url = tmp_path / "c"
    write_small_cache(url, SMALL)
    shard = url / "topk_ids" / "c" / "0" / "0"
    raw = bytearray(shard.read_bytes())
    raw[10] ^= 0xFF  # inside chunk 0 (the index is at the end)
    shard.write_bytes(bytes(raw))
    r = CacheReader(url, decode_threads=2)
    with pytest.raises(ChecksumError, match="topk_ids"):
        r.sequence(0)
    with pytest.raises(CorruptStoreError):
        r.sequences([30, 0])
    assert r.sequence(r.num_sequences - 1).key  # later shards still read


def test_point_read_of_a_truncated_shard_is_a_checksum_error(tmp_path):
    url = tmp_path / "c"
    write_small_cache(url, SMALL)
    shard = url / "topk_logprobs" / "c" / "0" / "0"
    shard.write_bytes(shard.read_bytes()[:5])  # shorter than its index
    with pytest.raises(ChecksumError, match="topk_logprobs"):
        CacheReader(url).sequence(0)


def test_random_access_preset_is_recorded_kept_and_validates(tmp_path):
    url = tmp_path / "c"
    preset = spec.layout_named("random_access")
    assert preset is spec.LAYOUTS["random_access"] is spec.RANDOM_ACCESS_LAYOUT
    recs = write_small_cache(url, preset)
    meta = json.loads((url / "topk_ids" / "zarr.json").read_text())
    assert meta["attributes"][spec.LAYOUT_ATTR] == "random_access"
    sharding = meta["codecs"][0]["configuration"]
    assert sharding["chunk_shape"] == [256, K]
    blosc = sharding["codecs"][1]["configuration"]
    assert blosc["cname"] == "lz4"
    tok = json.loads((url / "input_ids" / "zarr.json").read_text())
    assert tok["codecs"][0]["configuration"]["chunk_shape"] == [8192]
    # a later writer given another layout appends with the store's own
    more = make_records(5, k=K, vocab=300, seed=12, prefix="t")
    with CacheWriter.open(url, make_manifest(k=K, vocab_size=300), layout=SMALL) as w:
        w.append(more)
    r = CacheReader(url)
    assert r.layout_name == "random_access"
    assert json.loads((url / "topk_ids" / "zarr.json").read_text()) == meta | {
        "shape": [r.num_rows, K]
    }
    for i, want in enumerate([*recs, *more]):
        assert np.array_equal(r.sequence(i).topk_ids, want.topk_ids)
    assert validate(url).ok


def test_layout_names_of_other_stores(tmp_path):
    write_small_cache(tmp_path / "d", spec.DEFAULT_LAYOUT)
    assert CacheReader(tmp_path / "d").layout_name == "default"
    meta = json.loads((tmp_path / "d" / "topk_ids" / "zarr.json").read_text())
    assert spec.LAYOUT_ATTR not in meta["attributes"]  # default stores are unchanged
    write_small_cache(tmp_path / "s", SMALL)
    assert CacheReader(tmp_path / "s").layout_name == "custom"
    with pytest.raises(ValueError, match="random_access"):
        spec.layout_named("fast")


def test_point_reads_on_s3_equal_local(tmp_path, s3_store):
    url, opts = s3_store
    recs = write_small_cache(url, SMALL, opts)
    r = CacheReader(url, opts, decode_threads=2)
    idx = [3, 0, 3, 39, 17]
    for g, i in zip(r.sequences(idx), idx, strict=True):
        assert g.equals(CacheReader(url, opts).sequence(i))
        assert np.array_equal(g.topk_ids, recs[i].topk_ids)
        assert np.array_equal(g.input_ids, recs[i].input_ids)


def test_point_reads_see_only_the_snapshot(tmp_path):
    url = Path(tmp_path / "c")
    recs = write_small_cache(url, SMALL)
    r = CacheReader(url)
    more = make_records(6, k=K, vocab=300, seed=13, prefix="u")
    with CacheWriter.open(url, make_manifest(k=K, vocab_size=300)) as w:
        w.append(more)  # rewrites the last, partly filled shards
    with pytest.raises(IndexError):
        r.sequence(len(recs))
    assert np.array_equal(r.sequence(len(recs) - 1).topk_ids, recs[-1].topk_ids)
    r.refresh()
    got = r.sequences([len(recs) + 5, len(recs) - 1])
    assert np.array_equal(got[0].topk_ids, more[5].topk_ids)
    assert np.array_equal(got[1].topk_ids, recs[-1].topk_ids)


def test_spec_reader_decodes_the_random_access_preset(tmp_path):
    """FORMAT.md alone (tests/spec_reader.py) decodes a ``random_access`` store to the reader's
    values: the preset is a layout the spec describes, nothing more."""
    from spec_reader import SpecStore

    url = tmp_path / "c"
    write_small_cache(url, spec.RANDOM_ACCESS_LAYOUT)
    got = SpecStore(url).decode()
    r = CacheReader(url)
    block = r.rows(0, r.num_rows)
    assert np.array_equal(got["topk_ids"], block.topk_ids)
    assert np.array_equal(got["topk_logprobs"].view(np.uint32), block.topk_logprobs.view(np.uint32))
    assert np.array_equal(got["input_ids"], r.tokens(0, r.num_tokens))


def test_point_read_never_reads_past_the_committed_count(tmp_path):
    write_small_cache(tmp_path / "c", SMALL)
    r = CacheReader(tmp_path / "c")
    n = r.num_rows
    with pytest.raises(CorruptStoreError, match="past the committed"):
        pointread.read(r._opened.direct, [("topk_ids", n - 2, n + 1)])
    (got,) = pointread.read(r._opened.direct, [("topk_ids", n - 2, n)])
    assert np.array_equal(got, r.rows(n - 2, n).topk_ids)

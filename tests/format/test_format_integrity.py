"""No silent wrong data (issue #11): float16 output clipping, committed-count bounds, missing
objects as typed errors, and the writer lock invisible to stock zarr."""

from __future__ import annotations

import numpy as np
import pytest
from format_support import make_manifest, make_records
from logitcache.cache_format import CacheReader, CacheWriter, SequenceRecord


@pytest.mark.parametrize("dtype", ["float32", "uint8", "uint16", "float16"])
def test_float16_output_clips_to_finite_range(tmp_path, dtype):
    """rows/sequence(logprob_dtype="float16") never return -inf (FORMAT.md D3): values below
    -65504 come back as -65504, the others as the float32 decode rounded to float16."""
    rec = make_records(1, seed=3, min_len=6, max_len=6)[0]
    lp = rec.topk_logprobs.copy()
    lp[:, -1] = -1.0e5
    lp[2, -2:] = [-7.0e4, -9.0e4]
    rec = SequenceRecord("x", rec.input_ids, rec.topk_ids, lp, rec.tail_mass)
    with CacheWriter.open(tmp_path / "c", make_manifest(logprob_dtype=dtype), fsync=False) as w:
        w.append([rec])
    r = CacheReader(tmp_path / "c")
    f32 = r.rows(0, 5).topk_logprobs
    assert r.rows(0, 5, logprob_dtype="float16").topk_logprobs.dtype == np.float16
    for got in (
        r.rows(0, 5, logprob_dtype="float16").topk_logprobs,
        r.sequence(0, logprob_dtype="float16").topk_logprobs,  # float16 as asked
    ):
        assert np.isfinite(got).all()
        assert got[:, -1].tolist() == [-65504.0] * 5
        want = np.clip(f32, -65504, 0).astype(np.float16)
        assert np.array_equal(got, want)


def _set_counts(url, **counts) -> None:
    import json

    root = url / "zarr.json"
    doc = json.loads(root.read_text())
    doc["attributes"]["logitcache"].update(counts)
    root.write_text(json.dumps(doc))


@pytest.mark.parametrize(
    "delta",
    [
        dict(num_rows=-1),
        dict(num_tokens=-1),
        dict(num_rows=-1, num_tokens=-1),
        dict(num_sequences=-1),
        dict(num_rows=+1, num_tokens=+1),
    ],
)
def test_reader_never_reads_past_committed_counts(tmp_path, delta):
    """R6: counts that disagree with the sequence index are a CorruptStoreError at open, never a
    read of the last sequence past the committed rows (issue #11: num_rows - 1 used to return it
    whole). validate reports count_rows/count_tokens."""
    from logitcache.cache_format import CorruptStoreError, validate

    url = tmp_path / "c"
    recs = make_records(5, seed=2, min_len=4, max_len=9)
    with CacheWriter.open(url, make_manifest(), fsync=False) as w:
        w.append(recs)
    m = CacheReader(url).manifest
    _set_counts(url, **{n: getattr(m, n) + d for n, d in delta.items()})
    with pytest.raises(CorruptStoreError):
        CacheReader(url)
    assert not validate(url).ok


def test_direct_layout_is_bounded_by_the_commit(tmp_path):
    """Entries past the commit (a killed writer's leftovers) are outside every read."""
    from logitcache.cache_format import CorruptStoreError

    url = tmp_path / "c"
    with CacheWriter.open(url, make_manifest(), fsync=False) as w:
        w.append(make_records(3, seed=4))
    r = CacheReader(url)
    n = r.num_rows
    assert r._opened.direct["topk_ids"].length == n
    with pytest.raises(CorruptStoreError, match="past the committed"):
        r.read_spans([(slice(0, n + 1), None)])
    with pytest.raises(IndexError):
        r.rows(0, n + 1)


def test_stock_zarr_lists_a_closed_store_without_warnings(tmp_path):
    """The writer lock file is deleted on release (FORMAT.md 5.1), so stock zarr-python (the
    pinned 3.1.x; zarr >= 3.2 needs Python >= 3.12) walks a closed store with no "not recognized
    as a component of a Zarr hierarchy" warning."""
    import warnings

    import zarr
    from logitcache.cache_format._lock import LocalLock

    url = tmp_path / "c"
    with CacheWriter.open(url, make_manifest(), fsync=False) as w:
        w.append(make_records(3, seed=1))
        w.append(make_records(2, seed=2, prefix="t"))
    assert not (url / ".logitcache.lock").exists()
    assert not list(url.rglob("*.partial"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g = zarr.open_group(url, mode="r")
        names = {n for n, _ in g.members()}
        assert {"topk_ids", "seq_keys", "seq_key_bytes"} <= names
        assert sorted(g.array_keys()) == sorted(names)
        assert g.tree() is not None
    # a lock file left by a killed writer does not block the next one, which removes it
    (url / ".logitcache.lock").touch()
    a, b = LocalLock(url / ".logitcache.lock"), LocalLock(url / ".logitcache.lock")
    a.acquire(1.0)
    from logitcache.cache_format import WriterLockedError

    with pytest.raises(WriterLockedError):
        b.acquire(0.1)
    a.release()
    b.acquire(1.0)  # the file a locked is gone; b locks a fresh one
    b.release()
    assert not (url / ".logitcache.lock").exists()


@pytest.mark.parametrize(
    "name", ["seq_keys", "seq_lengths", "seq_row_start", "seq_token_start", "id_order"]
)
def test_bit_flip_in_index_arrays_is_a_finding_not_a_crash(tmp_path, name):
    """issue #11: a flipped bit in the sequence index or id_order made validate crash with a
    ValueError; now it is an `unreadable` finding naming the array and entries, and the reader
    raises a typed error."""
    from logitcache.cache_format import FormatError, validate
    from logitcache.cache_format import _reader as reader_mod

    url = tmp_path / "c"
    recs = make_records(6, seed=8)
    with CacheWriter.open(url, make_manifest(id_remap=True), fsync=False) as w:
        w.append(recs)
    obj = url / name / "c" / "0"
    data = bytearray(obj.read_bytes())
    data[5] ^= 0x10
    obj.write_bytes(bytes(data))
    report = validate(url)
    assert "unreadable" in report.codes(), str(report)
    where = next(p for p in report.problems if p.code == "unreadable").where
    assert any(w.startswith(f"{name} ") for w in where), where
    import unittest.mock as mock

    if name == "seq_token_start":  # token starts are row starts plus i: not read (D1)
        assert CacheReader(url).index.token_start(5) == sum(r.length for r in recs[:5])
        return
    with mock.patch.object(reader_mod, "_RETRIES", 1), pytest.raises(FormatError):
        if name == "seq_keys":  # keys are read when used
            _ = CacheReader(url).keys
        else:
            CacheReader(url)

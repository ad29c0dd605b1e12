"""Round trips through a real local store: writer -> reader, every logprob dtype, dedupe, resume."""

from __future__ import annotations

import numpy as np
import pytest
from format_support import make_manifest, make_records, reseal
from logitcache.cache_format import (
    CacheReader,
    CacheWriter,
    ManifestMismatchError,
    SequenceRecord,
    validate,
)


def error_bound(lp: np.ndarray, dtype: str) -> np.ndarray:
    """Per-row worst-case absolute error of encoding ``lp`` as ``dtype`` (the bounds of
    FORMAT.md's logprob encodings)."""
    lp = np.asarray(lp, dtype=np.float64)
    if dtype == "float32":
        return np.zeros(lp.shape[0])
    if dtype == "float16":
        return np.abs(lp).max(axis=1) * 2.0**-11 + 2.0**-25
    qmax = {"uint8": 255, "uint16": 65535}[dtype]
    spread = (lp.max(axis=1) - lp.min(axis=1)) / (2 * qmax)
    return spread * (1 + 1e-6) + np.abs(lp).max(axis=1) * 2e-7


def _same_exact(a: SequenceRecord, b: SequenceRecord) -> None:
    assert a.key == b.key
    np.testing.assert_array_equal(a.input_ids, b.input_ids)
    np.testing.assert_array_equal(a.topk_ids, b.topk_ids)


@pytest.mark.parametrize("dtype", ["float16", "float32", "uint8", "uint16"])
def test_roundtrip_dtypes(tmp_path, dtype):
    recs = make_records(25, k=6, seed=1)
    url = tmp_path / "c"
    with CacheWriter.open(url, make_manifest(k=6, logprob_dtype=dtype)) as w:
        assert w.append(recs) == 25
    r = CacheReader(url)
    assert r.num_sequences == 25
    assert r.num_rows == sum(x.num_rows for x in recs)
    assert r.num_tokens == sum(x.length for x in recs)
    for i, want in enumerate(recs):
        got = r.sequence(i)
        _same_exact(got, want)
        np.testing.assert_array_equal(got.tail_mass, want.tail_mass)
        err = np.abs(got.topk_logprobs - want.topk_logprobs).max(axis=1)
        assert (err <= error_bound(want.topk_logprobs, dtype)).all()
        if dtype == "float32":
            np.testing.assert_array_equal(got.topk_logprobs, want.topk_logprobs)
        if dtype == "float16":
            np.testing.assert_array_equal(
                got.topk_logprobs, want.topk_logprobs.astype(np.float16).astype(np.float32)
            )
        assert (np.diff(got.topk_logprobs, axis=1) <= 0).all()
    assert validate(url).ok


def test_get_sequences_rows_consistent(tmp_path):
    recs = make_records(40, k=4, seed=2)
    url = tmp_path / "c"
    with CacheWriter.open(url, make_manifest(k=4, logprob_dtype="float32")) as w:
        w.append(recs[:17])
        w.append(recs[17:])
    r = CacheReader(url)
    assert r.keys == [x.key for x in recs]
    np.testing.assert_array_equal(r.lengths, [x.length for x in recs])
    for want, got in zip(
        [recs[i] for i in (39, 0, 17, 5)], r.sequences([39, 0, 17, 5]), strict=True
    ):
        _same_exact(got, want)
        np.testing.assert_array_equal(got.topk_logprobs, want.topk_logprobs)
    _same_exact(r.get("s23"), recs[23])
    with pytest.raises(KeyError):
        r.get("nope")
    with pytest.raises(IndexError):
        r.sequence(40)
    starts = r.row_starts
    block = r.rows(int(starts[3]), int(starts[6]))
    want = np.concatenate([x.topk_ids for x in recs[3:6]])
    np.testing.assert_array_equal(block.topk_ids, want)
    assert block.stop == int(starts[6])


def test_dedupe_and_resume(tmp_path):
    recs = make_records(30, seed=3)
    url = tmp_path / "c"
    m = make_manifest()
    with CacheWriter.open(url, m) as w:
        assert w.append(recs[:10]) == 10
        assert w.append(recs[5:15] + recs[5:7]) == 5  # overlap + in-batch repeats skipped
        assert w.contains("s3") and not w.contains("s20")
    with CacheWriter.open(url, m) as w:  # resume
        assert w.num_sequences == 15
        assert w.append(recs) == 15
    r = CacheReader(url)
    assert r.keys == [x.key for x in recs]
    assert r.manifest.generation == 3
    assert validate(url).ok


def test_resume_identity_mismatch(tmp_path):
    url = tmp_path / "c"
    with CacheWriter.open(url, make_manifest()) as w:
        w.append(make_records(2))
    for change in (
        {"tokenizer_fingerprint": "sha256:other"},
        {"k": 9},
        {"vocab_size": 2000},
        {"teacher_model": "other"},
        {"logprob_dtype": "float32"},
    ):
        with pytest.raises(ManifestMismatchError) as e:
            CacheWriter.open(url, make_manifest(**change))
        assert set(change) <= set(e.value.fields)
    # description fields may differ: resume keeps the stored description
    with CacheWriter.open(url, make_manifest(dataset="another")) as w:
        assert w.manifest.dataset == "synthetic"


def test_content_key_and_no_tail(tmp_path):
    rec = make_records(1, seed=4)[0]
    anon = SequenceRecord(None, rec.input_ids, rec.topk_ids, rec.topk_logprobs, None)
    assert anon.key.startswith("sha256:") and len(anon.key) == 7 + 64
    url = tmp_path / "c"
    with CacheWriter.open(url, make_manifest()) as w:
        assert w.append([anon]) == 1
        assert w.append([anon]) == 0
    got = CacheReader(url).get(anon.key)
    want = np.clip(1 - np.exp(rec.topk_logprobs.astype(np.float64)).sum(1), 0, 1)
    np.testing.assert_allclose(got.tail_mass, want, atol=1e-6)


def test_torch_output(tmp_path):
    torch = pytest.importorskip("torch")
    recs = make_records(3, seed=5)
    url = tmp_path / "c"
    with CacheWriter.open(url, make_manifest()) as w:
        w.append(recs)
    t = CacheReader(url, as_torch=True).sequence(1)
    assert t["topk_ids"].dtype == torch.int64 and t["topk_logprobs"].dtype == torch.float32
    assert torch.equal(t["labels"], torch.from_numpy(recs[1].input_ids[1:].astype(np.int64)))
    assert t["topk_ids"].shape == (recs[1].num_rows, 8)


def test_id_remap_roundtrip_resume_and_validate(tmp_path):
    import zarr

    recs = make_records(30, seed=6)
    url = tmp_path / "c"
    m = make_manifest(id_remap=True)
    with CacheWriter.open(url, m) as w:
        w.append(recs[:10])  # defines id_order
    with CacheWriter.open(url, m) as w:  # resume: loads id_order, remaps with it
        w.append(recs[10:])
    order = zarr.open_array(zarr.storage.LocalStore(url), path="id_order", mode="r")[:]
    assert sorted(order.tolist()) == list(range(1000))
    stored = zarr.open_array(zarr.storage.LocalStore(url), path="topk_ids", mode="r")[:]
    r = CacheReader(url)
    want = np.concatenate([x.topk_ids for x in recs])
    assert not np.array_equal(stored, want)  # really remapped on disk
    np.testing.assert_array_equal(order[stored], want)
    for i in (0, 15, 29):
        _same_exact(r.sequence(i), recs[i])
    assert validate(url).ok
    arr = zarr.open_array(zarr.storage.LocalStore(url), path="id_order", mode="r+")
    arr[0] = arr[1]
    reseal(url, "id_order")
    assert "id_order" in validate(url).codes()


def test_float16_tail_and_local_lock_timeout(tmp_path):
    from logitcache.cache_format import WriterLockedError
    from logitcache.cache_format._lock import LocalLock

    recs = make_records(4, seed=8)
    url = tmp_path / "c"
    with CacheWriter.open(url, make_manifest(tail_mass_dtype="float16")) as w:
        w.append(recs[:2])
        holder = LocalLock(url / ".logitcache.lock")  # another open file: conflicts like a process
        holder.acquire(timeout=1)
        try:
            w._lock_timeout = 0.2
            with pytest.raises(WriterLockedError):
                w.append(recs[2:])
        finally:
            holder.release()
        assert w.append(recs[2:]) == 2
    got = CacheReader(url).sequence(3)
    np.testing.assert_array_equal(got.tail_mass, recs[3].tail_mass.astype(np.float16))

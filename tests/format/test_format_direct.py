"""The reader (cache_format/shardread.py, the decoders) against stock zarr's array API, on real
local and S3 (moto) stores: bit-identical values for every logprob dtype and for ranges that cross
inner-chunk and shard boundaries, fill values of unwritten chunks, fallback for layouts it does not
handle, and typed errors (never wrong data) on a damaged shard."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from format_support import ZarrReader, make_manifest, make_records, s3_client
from logitcache.cache_format import (
    CacheReader,
    CacheWriter,
    Layout,
    SequenceRecord,
)
from logitcache.cache_format import _reader as reader_mod
from logitcache.cache_format.errors import ChecksumError

# 16-row chunks, 64-row shards: a few hundred rows cross many chunk and shard boundaries.
SMALL = Layout(
    row_chunk=16, row_shard=64, token_chunk=32, token_shard=128, seq_chunk=8, seq_shard=16
)
K = 5


def _write(url, dtype="float16", options=None, layout=SMALL, n=30, **manifest_kw):
    recs = make_records(n, k=K, seed=7, max_len=30)
    with CacheWriter.open(
        url, make_manifest(k=K, logprob_dtype=dtype, **manifest_kw), options, layout=layout
    ) as w:
        w.append(recs[: n // 2])
        w.append(recs[n // 2 :])  # second append rewrites the partly filled shards
    return recs


def _ranges(n: int) -> list[tuple[int, int]]:
    """Row ranges: whole, empty, single rows, within a chunk, across chunks, across shards,
    ending in the last partial chunk, and shard-aligned."""
    out = [
        (0, n),
        (0, 0),
        (n, n),
        (0, 1),
        (n - 1, n),
        (3, 9),
        (10, 40),
        (60, 70),
        (63, 65),
        (64, 128),
        (1, n - 1),
        (n - 5, n),
        (100, 300),
    ]
    return [(a, min(b, n)) for a, b in out if a <= min(b, n)]


def _assert_same(fast: CacheReader, slow: ZarrReader, logprob_dtype: str = "float32") -> None:
    n = fast.num_rows
    assert n > 300
    for a, b in _ranges(n):
        x = fast.rows(a, b, logprob_dtype=logprob_dtype)
        y = slow.rows(a, b, logprob_dtype=logprob_dtype)
        assert x.topk_ids.dtype == y.topk_ids.dtype == np.int32
        assert x.topk_logprobs.dtype == y.topk_logprobs.dtype == np.dtype(logprob_dtype)
        np.testing.assert_array_equal(x.topk_ids, y.topk_ids)
        # bit patterns, not values: -0.0 == 0.0 would hide a difference
        np.testing.assert_array_equal(
            x.topk_logprobs.view(f"u{x.topk_logprobs.itemsize}"),
            y.topk_logprobs.view(f"u{y.topk_logprobs.itemsize}"),
        )
        np.testing.assert_array_equal(x.tail_mass.view(np.uint32), y.tail_mass.view(np.uint32))
    t = fast.num_tokens
    for a, b in [(0, t), (31, 33), (127, 260), (t - 3, t)]:
        np.testing.assert_array_equal(fast.tokens(a, b), slow.tokens(a, b))
    for g, h in zip(
        fast.sequences([0, 7, len(fast) - 1]), slow.sequences([0, 7, len(fast) - 1]), strict=True
    ):
        np.testing.assert_array_equal(g.input_ids, h.input_ids)
        np.testing.assert_array_equal(g.topk_logprobs, h.topk_logprobs)


@pytest.mark.parametrize("dtype", ["float16", "float32", "uint8", "uint16"])
def test_direct_equals_zarr_local(tmp_path, dtype):
    recs = _write(tmp_path / "c", dtype)
    fast, slow = CacheReader(tmp_path / "c"), ZarrReader(tmp_path / "c")
    want = {"topk_ids", "topk_logprobs", "tail_mass", "input_ids"}
    if dtype in ("uint8", "uint16"):
        want |= {"logprob_max", "logprob_step"}
    assert want <= set(fast._opened.direct)
    _assert_same(fast, slow)
    _assert_same(fast, slow, "float16")
    # and both are the written data
    rows = fast.rows(0, fast.num_rows)
    np.testing.assert_array_equal(rows.topk_ids, np.concatenate([r.topk_ids for r in recs]))
    if dtype == "float16":
        lp16 = np.concatenate([r.topk_logprobs for r in recs]).astype(np.float16)
        np.testing.assert_array_equal(
            fast.rows(0, fast.num_rows, logprob_dtype="float16").topk_logprobs, lp16
        )
        np.testing.assert_array_equal(rows.topk_logprobs, lp16.astype(np.float32))


def test_direct_id_remap_and_auto_blocks(tmp_path):
    """The id remap gather, and stores written with blosc's automatic block size (the
    pre-'chunk' default) read the same through both paths."""
    for name, layout, remap in (
        ("remap", SMALL, True),
        ("auto", dataclasses.replace(SMALL, blosc_blocks="auto"), False),
    ):
        _write(tmp_path / name, layout=layout, id_remap=remap)
        _assert_same(CacheReader(tmp_path / name), ZarrReader(tmp_path / name))
    import zarr

    meta = zarr.open_array(tmp_path / "auto", path="topk_ids", mode="r").metadata
    assert meta.codecs[0].codecs[1].blocksize == 0
    meta = zarr.open_array(tmp_path / "remap", path="topk_ids", mode="r").metadata
    assert meta.codecs[0].codecs[1].blocksize == 16 * K * 4  # one blosc block per inner chunk


def test_direct_reads_unwritten_chunks_as_fill_value(tmp_path):
    """Format version 1: zarr did not store chunks that equal the fill value: an all-zero tail
    mass leaves empty index entries and missing shard objects, which must read as zeros. Version
    2 stores every chunk (R9)."""
    recs = make_records(1, k=K, seed=99, min_len=40, max_len=40, prefix="nz")
    for i in range(29):
        r = make_records(1, k=K, seed=i, min_len=40, max_len=40, prefix=f"z{i}")[0]
        zero = np.zeros(r.num_rows, np.float32)
        recs.append(SequenceRecord(r.key, r.input_ids, r.topk_ids, r.topk_logprobs, zero))
    with CacheWriter.open(tmp_path / "v2", make_manifest(k=K), layout=SMALL) as w:
        w.append(recs)
    assert sorted(p.name for p in (tmp_path / "v2" / "tail_mass" / "c").iterdir()) == [
        "0",
        "1",
        "2",
    ]
    url = tmp_path / "c"
    with CacheWriter.open(url, make_manifest(k=K, format_version=1), layout=SMALL) as w:
        w.append(recs)
    # 1170 rows = 3 tail shards of 512 rows (4 chunks of 128): only the first holds non-zeros
    assert sorted(p.name for p in (url / "tail_mass" / "c").iterdir()) == ["0"]
    index = np.frombuffer((url / "tail_mass" / "c" / "0").read_bytes()[-68:-4], "<u8")
    assert (index == 2**64 - 1).any()  # and its later chunks are empty entries
    fast, slow = CacheReader(url), ZarrReader(url)
    _assert_same(fast, slow)
    got = fast.rows(0, fast.num_rows).tail_mass
    np.testing.assert_array_equal(got, np.concatenate([r.tail_or_computed() for r in recs]))
    assert got[:39].any() and not got[39:].any()


def test_direct_falls_back_for_other_codecs(tmp_path):
    """A zstd inner codec (no blosc) is read through zarr; values stay identical."""
    layout = dataclasses.replace(SMALL, id_codec="zstd3")
    _write(tmp_path / "c", layout=layout)
    fast = CacheReader(tmp_path / "c")
    assert "topk_ids" not in fast._opened.direct and "input_ids" not in fast._opened.direct
    assert "topk_logprobs" in fast._opened.direct
    _assert_same(fast, ZarrReader(tmp_path / "c"))


def _flip(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["chunk", "index"])
def test_corrupt_shard_raises_typed_error(tmp_path, monkeypatch, where):
    monkeypatch.setattr(reader_mod, "_RETRIES", 2)  # a persistent error: do not wait 2.5 s
    _write(tmp_path / "c")
    shard = tmp_path / "c" / "topk_ids" / "c" / "1" / "0"
    size = shard.stat().st_size
    _flip(shard, 40 if where == "chunk" else size - 30)
    fast, slow = CacheReader(tmp_path / "c"), ZarrReader(tmp_path / "c")
    with pytest.raises(ChecksumError, match="CRC32C"):
        fast.rows(64, 70)
    with pytest.raises(ChecksumError):
        fast.rows(0, fast.num_rows)
    with pytest.raises(Exception):  # noqa: B017  (stock zarr refuses the bytes too)
        slow.rows(64, 70)
    np.testing.assert_array_equal(fast.rows(0, 64).topk_ids, slow.rows(0, 64).topk_ids)


def test_direct_equals_zarr_s3(s3_store, monkeypatch):
    """On S3 through obstore and s3fs, both paths give the same bits; a damaged shard object is
    a ChecksumError."""
    url, opts = s3_store
    _write(url, "uint8", opts)
    for backend in ("obstore", "fsspec"):
        o = dict(opts, backend=backend)
        fast, slow = CacheReader(url, o), ZarrReader(url, o)
        assert "topk_ids" in fast._opened.direct
        _assert_same(fast, slow)
    bucket, prefix = url.split("/")[2], url.split("/", 3)[3]
    s3 = s3_client(opts["endpoint_url"])
    key = f"{prefix}/topk_logprobs/c/2/0"
    data = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[20] ^= 0x01
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    monkeypatch.setattr(reader_mod, "_RETRIES", 2)
    with pytest.raises(ChecksumError):
        CacheReader(url, opts).rows(128, 192)  # whole shard: one get
    with pytest.raises(ChecksumError):  # a partial read: suffix index + one range request
        CacheReader(url, opts).rows(130, 131)

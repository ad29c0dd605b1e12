"""A lost object inside the committed range is never read as zeros (FORMAT.md R9, issue #11).

For every array of a version-2 store, one shard object is deleted (locally and on the moto S3
server); every read that needs it (with either decoder: ``sequence``,
``sequences``, ``get``, ``read_ranges``, ``rows``, ``tokens``, opening the reader for the index
arrays) raises :class:`MissingDataError` naming the array, and ``validate`` reports
``object_missing`` with the array and the entry range. Reads that do not touch the lost object
still succeed.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import google_crc32c
import numpy as np
import pytest
from format_support import make_manifest, make_records, s3_client
from logitcache.cache_format import (
    CacheReader,
    CacheWriter,
    Layout,
    MissingDataError,
    validate,
)

SMALL = Layout(row_chunk=8, row_shard=32, token_chunk=16, token_shard=64, seq_chunk=4, seq_shard=8)
K = 4
ROW_ARRAYS = ["topk_ids", "topk_logprobs", "tail_mass", "logprob_max", "logprob_step"]
# the store is one index block (FORMAT.md D1): opening reads its lengths and first row
INDEX_ARRAYS = ["seq_keys", "seq_lengths", "seq_row_start", "id_order"]
# not read by readers (token starts are row starts plus i, D1; key lookups use the key index)
KEY_ARRAYS = ["seq_key_end", "seq_key_bytes", "seq_token_start"]
ALL = [*ROW_ARRAYS, "input_ids", *INDEX_ARRAYS, *KEY_ARRAYS]


def _write(url, options=None):
    recs = make_records(12, k=K, vocab=200, seed=5, min_len=3, max_len=12)
    m = make_manifest(k=K, vocab_size=200, logprob_dtype="uint8", id_remap=True)
    with CacheWriter.open(url, m, options, layout=SMALL) as w:
        w.append(recs[:7])
        w.append(recs[7:])
    return recs


def _shard0(name: str) -> str:
    return f"{name}/c/0/0" if name in ("topk_ids", "topk_logprobs") else f"{name}/c/0"


def _check_lost(url, options, name: str, recs, decoders: tuple[str, ...]) -> None:
    """With shard 0 of ``name`` gone, every read that needs it raises MissingDataError."""
    if name == "seq_keys":  # keys are read when used: the reader opens, every key read fails
        for decoder in decoders:
            r = CacheReader(url, options, decoder=decoder)
            key_reads = [
                lambda r=r: r.keys,
                lambda r=r: r.index_of(recs[0].key),
                lambda r=r: recs[0].key in r,
                lambda r=r: r.sequence(0).key,
                lambda r=r: r.get(recs[0].key),
            ]
            for read in key_reads:
                with pytest.raises(MissingDataError, match=name):
                    read()
            assert np.array_equal(r.sequence(0).topk_ids, recs[0].topk_ids)  # rows still read
        with pytest.raises(MissingDataError, match=name):  # a writer's duplicate check
            with CacheWriter.open(
                url,
                make_manifest(k=K, vocab_size=200, logprob_dtype="uint8", id_remap=True),
                options,
                layout=SMALL,
            ) as w:
                w.contains(recs[0].key)
    elif name in INDEX_ARRAYS:
        for decoder in decoders:
            with pytest.raises(MissingDataError, match=name):
                CacheReader(url, options, decoder=decoder)
    else:
        for decoder in decoders:
            r = CacheReader(url, options, decoder=decoder)
            if name in KEY_ARRAYS:  # the reader does not use them; they still read
                assert r.sequence(0).key == recs[0].key
                continue
            reads: list[tuple[str, tuple, dict]] = [("sequence", (0,), {})]
            if len(decoders) > 1:  # local: every method; S3: the same code over another store
                reads += [
                    ("sequences", ([1, 0],), {}),
                    ("get", (recs[0].key,), {}),
                    ("read_ranges", ([(0, 2)],), {}),
                ]
            if name == "input_ids":
                reads.append(("tokens", (0, 3), {}))
            else:
                reads.append(("rows", (0, 2), {}))
                reads.append(("rows", (0, 1), {"logprob_dtype": "float16"}))
            for method, args, kw in reads:
                with pytest.raises(MissingDataError, match=name):
                    getattr(r, method)(*args, **kw)
            last = r.num_sequences - 1  # in a later shard of every array with several
            if name in ("topk_ids", "topk_logprobs", "input_ids"):
                got = r.sequence(last)
                assert np.array_equal(got.topk_ids, recs[last].topk_ids)
    report = validate(url, options)
    assert not report.ok and "object_missing" in report.codes(), str(report)
    where = next(p for p in report.problems if p.code == "object_missing").where
    assert any(w.startswith(f"{name} ") and ":" in w for w in where), where


def _run_all(
    url, options, get: Callable, delete: Callable, put: Callable, recs, decoders=("numba", "numpy")
) -> None:
    assert validate(url, options).ok
    for name in ALL:
        key = _shard0(name)
        data = get(key)
        delete(key)
        try:
            _check_lost(url, options, name, recs, decoders)
        finally:
            put(key, data)
    assert validate(url, options).ok  # restored: nothing else was touched


def test_lost_shard_of_every_array_local(tmp_path):
    url = tmp_path / "c"
    recs = _write(url)
    assert sum(1 for _ in (url / "topk_ids" / "c").iterdir()) >= 2  # several shards

    def put(key: str, data: bytes) -> None:
        (url / key).write_bytes(data)

    _run_all(url, None, lambda k: (url / k).read_bytes(), lambda k: os.unlink(url / k), put, recs)


def test_lost_shard_of_every_array_s3(s3_store):
    url, opts = s3_store
    recs = _write(url, opts)
    bucket, prefix = url.split("/")[2], url.split("/", 3)[3]
    s3 = s3_client(opts["endpoint_url"])

    def get(key: str) -> bytes:
        return s3.get_object(Bucket=bucket, Key=f"{prefix}/{key}")["Body"].read()

    def delete(key: str) -> None:
        s3.delete_object(Bucket=bucket, Key=f"{prefix}/{key}")

    def put(key: str, data: bytes) -> None:
        s3.put_object(Bucket=bucket, Key=f"{prefix}/{key}", Body=data)

    _run_all(url, opts, get, delete, put, recs, decoders=("numba",))  # both decoders: local test


def _empty_index_entry(path: Path, chunks_per_shard: int, chunk: int) -> None:
    """Mark inner chunk ``chunk`` of the shard object at ``path`` as not stored, with a valid
    index CRC32C: what a shard written without that chunk looks like."""
    raw = bytearray(path.read_bytes())
    n = 16 * chunks_per_shard
    table = np.frombuffer(bytes(raw[-(n + 4) : -4]), "<u8").copy().reshape(-1, 2)
    table[chunk] = 2**64 - 1
    body = table.tobytes()
    raw[-(n + 4) :] = body + google_crc32c.value(body).to_bytes(4, "little")
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("decoder", ["numba", "numpy"])
def test_lost_chunk_inside_a_shard(tmp_path, decoder):
    url = tmp_path / "c"
    recs = _write(url)
    _empty_index_entry(url / "topk_logprobs" / "c" / "0" / "0", 32 // 8, 1)  # rows 8..15
    r = CacheReader(url, decoder=decoder)
    assert np.array_equal(r.rows(0, 8).topk_ids, np.concatenate([x.topk_ids for x in recs])[:8])
    with pytest.raises(MissingDataError, match=r"topk_logprobs.*8:1[0-6]"):
        r.rows(6, 10)
    report = validate(url)
    assert "topk_logprobs rows 8:16" in report.problems[0].where, str(report)

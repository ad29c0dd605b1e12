"""cache_format/shardwrite.py: the writer's direct shard writes give the bytes zarr gives.

The reference is the same writer inside ``format_support.zarr_writes()`` (every array through
zarr's ``setitem``). Small layouts make every case cheap: appends that start and end inside inner
chunks and shards, a batch spanning several shards, leftovers of a writer killed before its
commit, and a damaged committed shard (typed error, nothing committed).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from format_support import make_manifest, make_records, zarr_writes
from format_support import store_objects as files
from logitcache.cache_format import CacheReader, CacheWriter, spec, validate
from logitcache.cache_format import _writer as writer
from logitcache.cache_format.errors import ChecksumError, MissingDataError
from logitcache.cache_format.spec import DEFAULT_LAYOUT

#: Small chunks and shards, so that every case spans many of them.
SMALL = dict(row_chunk=16, row_shard=64, token_chunk=32, token_shard=128, seq_chunk=4, seq_shard=16)
LAYOUT = replace(DEFAULT_LAYOUT, **SMALL)
RAW = replace(spec.RANDOM_ACCESS_RAW_LAYOUT, **SMALL)  # no compressor: bytes, then CRC32C
K, VOCAB = 8, 1000


def write(url: Path, recs, cuts: list[int], *, direct: bool, layout=LAYOUT) -> None:
    m = make_manifest(k=K, vocab_size=VOCAB)
    with nullcontext() if direct else zarr_writes(), CacheWriter.open(url, m, layout=layout) as w:
        for a, b in zip([0, *cuts], [*cuts, len(recs)], strict=True):
            w.append(recs[a:b])


@pytest.mark.parametrize("layout", [LAYOUT, RAW], ids=["blosc", "raw"])
@pytest.mark.parametrize("cuts", [[3, 4, 9, 15], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])
def test_same_bytes_as_zarr(tmp_path: Path, monkeypatch, cuts: list[int], layout) -> None:
    recs = make_records(16, k=K, vocab=VOCAB, seed=3)  # ~20 rows each: many shards of 64 rows
    direct_layouts = []
    real = writer.shardwrite.supported

    def spy(lay):  # every numeric array takes the direct path (raw ones too)
        ok = real(lay)
        direct_layouts.append((lay.name, ok))
        return ok

    monkeypatch.setattr(writer.shardwrite, "supported", spy)
    write(tmp_path / "zarr", recs, cuts, direct=False, layout=layout)
    write(tmp_path / "direct", recs, cuts, direct=True, layout=layout)
    refused = {n for n, ok in direct_layouts if not ok}
    assert not refused & {"topk_ids", "topk_logprobs", "tail_mass", "input_ids"}, refused
    a, b = files(tmp_path / "zarr"), files(tmp_path / "direct")
    assert a.keys() == b.keys() and len(a) > 20
    assert [n for n in a if a[n] != b[n]] == []
    r = CacheReader(tmp_path / "direct")
    assert r.num_sequences == 16
    for got, want in zip(r.sequences(range(16)), recs, strict=True):
        assert np.array_equal(got.topk_ids, want.topk_ids)
        assert np.array_equal(got.input_ids, want.input_ids)
    assert validate(tmp_path / "direct").ok


def test_leftovers_of_a_killed_writer_are_overwritten(tmp_path: Path, monkeypatch) -> None:
    """Rows written past the commit (a writer killed before step 5) never reach readers, and
    the next append writes over them with the same result as zarr's path."""
    recs = make_records(12, k=K, vocab=VOCAB, seed=4)
    stray = make_records(5, k=K, vocab=VOCAB, seed=5, prefix="x")
    for direct in (False, True):
        url = tmp_path / f"store-{direct}"
        m = make_manifest(k=K, vocab_size=VOCAB)
        with nullcontext() if direct else zarr_writes():
            with CacheWriter.open(url, m, layout=LAYOUT) as w:
                w.append(recs[:5])
                fresh = writer.encode_batch(stray, w.manifest)
                w._write(w.manifest, fresh)  # step 4 only: data past the commit, no commit
            with CacheWriter.open(url, m) as w:
                assert w.num_sequences == 5
                w.append(recs[5:])
        r = CacheReader(url)
        assert r.keys == [x.key for x in recs]
        got = r.rows(0, r.manifest.num_rows)
        want = np.concatenate([x.topk_ids for x in recs])
        assert np.array_equal(got.topk_ids, want)
        assert validate(url).ok


def test_damaged_committed_shard_is_a_typed_error(tmp_path: Path, monkeypatch) -> None:
    recs = make_records(6, k=K, vocab=VOCAB, seed=6)
    url = tmp_path / "s"
    m = make_manifest(k=K, vocab_size=VOCAB)
    with CacheWriter.open(url, m, layout=LAYOUT) as w:
        w.append(recs[:3])
    rows = CacheReader(url).manifest.num_rows
    assert rows % LAYOUT.row_shard  # the next append starts inside this shard: it is read
    shard = url / "topk_ids" / "c" / str(rows // LAYOUT.row_shard) / "0"
    raw = bytearray(shard.read_bytes())
    raw[-10] ^= 0xFF  # inside the shard index
    shard.write_bytes(bytes(raw))
    with CacheWriter.open(url, m) as w, pytest.raises(ChecksumError):
        w.append(recs[3:])
    shard.unlink()
    with CacheWriter.open(url, m) as w, pytest.raises(MissingDataError):
        w.append(recs[3:])
    assert CacheReader(url).num_sequences == 3


@pytest.mark.parametrize("layout", [LAYOUT, RAW], ids=["blosc", "raw"])
def test_two_writers_taking_turns(tmp_path: Path, monkeypatch, layout) -> None:
    """Each writer keeps its opened arrays between appends; after the other writer has appended
    (or a writer died past the commit) they are read again (a partial chunk decoded back: blosc,
    or a raw chunk checked and copied): same bytes as one writer through zarr, and after
    leftover rows the same values."""
    recs = make_records(12, k=K, vocab=VOCAB, seed=8)
    ref = tmp_path / "ref"
    write(ref, recs[:10], [2, 4, 6, 8], direct=False, layout=layout)
    url, m = tmp_path / "two", make_manifest(k=K, vocab_size=VOCAB)
    with CacheWriter.open(url, m, layout=layout) as a, CacheWriter.open(url, m) as b:
        for i, w in enumerate([a, b, a, a, b]):
            w.append(recs[2 * i : 2 * i + 2])
        assert files(ref) == files(url)
        a.append(recs[10:11])  # a's kept arrays end at the commit ...
        b._refresh_manifest()
        stray = writer.encode_batch(make_records(3, prefix="x"), b.manifest)
        b._write(b.manifest, stray)  # ... and b leaves rows past it, as a dead writer would
        a.append(recs[11:])  # reuses its arrays (they still end at the commit)
    r = CacheReader(url)
    assert r.keys == [x.key for x in recs]
    got = r.rows(0, r.manifest.num_rows).topk_ids
    assert np.array_equal(got, np.concatenate([x.topk_ids for x in recs]))
    assert validate(url).ok


def test_the_stored_bytes_do_not_depend_on_how_appends_are_grouped(
    tmp_path: Path, monkeypatch
) -> None:
    """The job writer's grouping of batches into appends (merged, lingering:
    server/batch/pipeline.py) changes which appends write which rows, never the arrays' objects
    the store ends with (the key index's runs follow the commits, FORMAT.md 4.11)."""
    recs = make_records(16, k=K, vocab=VOCAB, seed=4)
    groupings = {"one": [], "each": list(range(1, 16)), "some": [2, 7, 8, 13]}
    for name, cuts in groupings.items():
        write(tmp_path / name, recs, cuts, direct=True)

    def arrays(root: Path) -> dict[str, bytes]:
        return {n: b for n, b in files(root).items() if not n.startswith("seq_keys/index/")}

    one = arrays(tmp_path / "one")
    assert len(one) > 20
    for name in ("each", "some"):
        other = arrays(tmp_path / name)
        assert other.keys() == one.keys() and [n for n in one if one[n] != other[n]] == []


def test_seq_keys_are_written_directly_with_zarrs_bytes(tmp_path: Path, monkeypatch) -> None:
    """``seq_keys`` (vlen-utf8 -> zstd -> crc32c inner chunks) goes through shardwrite too
    (issue #19: zarr's setitem of one append's keys cost ~5 ms of CPU); non-ASCII keys, keys
    read back from a shard this writer did not write (a new writer), the same objects as zarr's."""
    recs = [
        replace(r, key=f"clé-{i}-{'ü' * (i % 3)}")
        for i, r in enumerate(make_records(16, k=K, vocab=VOCAB, seed=8))
    ]
    cuts = [3, 4, 9, 15]
    write(tmp_path / "zarr", recs, cuts, direct=False)
    m = make_manifest(k=K, vocab_size=VOCAB)
    for a, b in zip([0, *cuts], [*cuts, len(recs)], strict=True):
        with CacheWriter.open(tmp_path / "direct", m, layout=LAYOUT) as w:  # a new writer each
            w.append(recs[a:b])
            assert spec.SEQ_KEYS in w._direct and spec.SEQ_KEYS not in w._opened
    a, b = files(tmp_path / "zarr"), files(tmp_path / "direct")
    assert a.keys() == b.keys() and [n for n in a if a[n] != b[n]] == []
    assert CacheReader(tmp_path / "direct").keys == [r.key for r in recs]
    assert validate(tmp_path / "direct").ok

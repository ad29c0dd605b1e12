"""cache_format/shardwrite.py: the writer's direct shard writes give the bytes zarr gives.

The reference is the same writer with ``writer.DIRECT_WRITES = False`` (every array through
zarr's ``setitem``). Small layouts make every case cheap: appends that start and end inside inner
chunks and shards, a batch spanning several shards, leftovers of a writer killed before its
commit, and a damaged committed shard (typed error, nothing committed).
"""

from __future__ import annotations

import weakref
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from format_support import make_manifest, make_records
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


def write(url: Path, recs, cuts: list[int], *, direct: bool, monkeypatch, layout=LAYOUT) -> None:
    monkeypatch.setattr(writer, "DIRECT_WRITES", direct)
    with CacheWriter.open(url, make_manifest(k=K, vocab_size=VOCAB), layout=layout) as w:
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
    write(tmp_path / "zarr", recs, cuts, direct=False, monkeypatch=monkeypatch, layout=layout)
    write(tmp_path / "direct", recs, cuts, direct=True, monkeypatch=monkeypatch, layout=layout)
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
        monkeypatch.setattr(writer, "DIRECT_WRITES", direct)
        url = tmp_path / f"store-{direct}"
        m = make_manifest(k=K, vocab_size=VOCAB)
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
    monkeypatch.setattr(writer, "DIRECT_WRITES", True)
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
    write(ref, recs[:10], [2, 4, 6, 8], direct=False, monkeypatch=monkeypatch, layout=layout)
    monkeypatch.setattr(writer, "DIRECT_WRITES", True)
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
        write(tmp_path / name, recs, cuts, direct=True, monkeypatch=monkeypatch)

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
    write(tmp_path / "zarr", recs, cuts, direct=False, monkeypatch=monkeypatch)
    monkeypatch.setattr(writer, "DIRECT_WRITES", True)
    m = make_manifest(k=K, vocab_size=VOCAB)
    for a, b in zip([0, *cuts], [*cuts, len(recs)], strict=True):
        with CacheWriter.open(tmp_path / "direct", m, layout=LAYOUT) as w:  # a new writer each
            w.append(recs[a:b])
            assert spec.SEQ_KEYS in w._direct and spec.SEQ_KEYS not in w._opened
    a, b = files(tmp_path / "zarr"), files(tmp_path / "direct")
    assert a.keys() == b.keys() and [n for n in a if a[n] != b[n]] == []
    assert CacheReader(tmp_path / "direct").keys == [r.key for r in recs]
    assert validate(tmp_path / "direct").ok


def test_kept_payload_buffers_give_the_same_bytes(tmp_path: Path, monkeypatch) -> None:
    """Every shard object assembled in a kept buffer (``KEEP_MIN`` 0), few of them kept: a
    buffer still holding a :class:`~._shardwrite.LastShard`'s committed chunks (views of it)
    is never handed out again, so the stores equal zarr's; ones nothing refers to are reused."""
    sw = writer.shardwrite
    monkeypatch.setattr(sw, "KEEP_MIN", 0)
    monkeypatch.setattr(sw, "KEEP_PAYLOADS", 16)
    monkeypatch.setattr(sw, "_payloads", [])
    given: list[weakref.ref] = []
    reused = []
    real = sw._kept

    def spy(need: int) -> np.ndarray:
        raw = real(need)
        reused.append(any(r() is raw for r in given))
        given.append(weakref.ref(raw))
        return raw

    monkeypatch.setattr(sw, "_kept", spy)
    recs = make_records(16, k=K, vocab=VOCAB, seed=5)
    cuts = [1, 2, 3, 5, 8, 9, 12, 13]
    write(tmp_path / "zarr", recs, cuts, direct=False, monkeypatch=monkeypatch)
    write(tmp_path / "direct", recs, cuts, direct=True, monkeypatch=monkeypatch)
    a, b = files(tmp_path / "zarr"), files(tmp_path / "direct")
    assert a.keys() == b.keys() and [n for n in a if a[n] != b[n]] == []
    assert any(reused) and not all(reused)
    assert len(sw._payloads) <= 16


def test_a_kept_payload_is_reused_only_once_nothing_refers_to_it(monkeypatch) -> None:
    sw = writer.shardwrite
    monkeypatch.setattr(sw, "_payloads", [])
    monkeypatch.setattr(sw, "KEEP_MIN", 8192)
    size = 1 << 20
    first = sw._aligned(size)
    assert first.ctypes.data % 4096 == 0 and len(sw._payloads) == 1
    view = first[100:200]  # e.g. a committed chunk a LastShard keeps
    del first
    second = sw._aligned(size)  # the first buffer is still referred to: a new one
    assert second.base is not view.base and len(sw._payloads) == 2
    del view, second
    third = sw._aligned(size)  # both free now: one of them again
    assert any(third.base is b for b in sw._payloads) and len(sw._payloads) == 2
    quarter = sw._aligned(size // 4)  # one kept buffer is free, but over twice too big: new
    assert len(sw._payloads) == 3 and quarter.base is sw._payloads[2]
    small = sw._aligned(4000)  # below KEEP_MIN: never kept
    assert len(sw._payloads) == 3 and all(small.base is not b for b in sw._payloads)


def test_a_chunk_is_one_blosc_block_so_its_bytes_do_not_depend_on_threads(monkeypatch) -> None:
    """zarr's import turns numcodecs' blosc threads off (``numcodecs.blosc.use_threads =
    False``), so every chunk is compressed in a single-threaded blosc context, on any thread.
    Were they on (a user's setting; numcodecs' default uses them on the main thread, with
    ``set_nthreads`` threads: 8 on a 16-core box), a format chunk's frame would still be the
    same every time: it is one blosc block (``blosc_blocks="chunk"``), and blosc splits only a
    chunk of several blocks among threads (storing the blocks in the order they finish)."""

    import numcodecs.blosc
    from logitcache.cache_format import _codecs
    from logitcache.cache_format._zarr_adapter import blosc_codec

    assert numcodecs.blosc.use_threads is False
    rng = np.random.default_rng(0)
    rows = DEFAULT_LAYOUT.row_chunk
    ids = rng.integers(0, 128_256, (rows, 100)).astype("<i4")
    deltas = rng.integers(0, 1 << 16, (rows, 100)).astype("<u2")
    before = numcodecs.blosc.get_nthreads()
    monkeypatch.setattr(numcodecs.blosc, "use_threads", True)
    numcodecs.blosc.set_nthreads(8)
    try:
        for name, a in (("blosc-zstd1-bitshuffle", ids), ("blosc-zstd1-shuffle", deltas)):
            comp = _codecs.compressors(name, a.itemsize, blocksize=a.nbytes)[0]
            codec = blosc_codec(comp)
            flat = a.view(np.uint8).reshape(-1)
            threaded = {codec.encode(flat) for _ in range(40)}  # blosc's global context
            monkeypatch.setattr(numcodecs.blosc, "use_threads", False)
            alone = codec.encode(flat)
            monkeypatch.setattr(numcodecs.blosc, "use_threads", True)
            assert threaded == {alone}
    finally:
        numcodecs.blosc.set_nthreads(before)

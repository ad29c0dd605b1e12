"""Keys read on demand and looked up through sorted 64-bit hashes (cache_format/_keyindex.py):
the reader's open reads no key, lookups and the writer's duplicate check stay exact when hashes
collide, and a snapshot sees only its own keys."""

from __future__ import annotations

import pickle
from dataclasses import replace

import numpy as np
import pytest
from format_support import make_manifest, make_records
from logitcache.cache_format import CacheReader, CacheWriter, Layout, SequenceRecord
from logitcache.cache_format import _keyindex as keyindex

SMALL = Layout(row_chunk=8, row_shard=32, token_chunk=16, token_shard=64, seq_chunk=4, seq_shard=8)


def _table(
    keys: list[str], as_bytes: bool = False
) -> tuple[keyindex.KeyTable, list[tuple[int, int]]]:
    reads: list[tuple[int, int]] = []

    def read(a: int, b: int) -> np.ndarray:
        reads.append((a, b))
        return np.array(keys[a:b], dtype=object)

    def read_bytes(a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        raw = [k.encode() for k in keys[a:b]]
        return np.frombuffer(b"".join(raw), np.uint8), np.cumsum([len(r) for r in raw])

    return keyindex.KeyTable(read, read_bytes if as_bytes else None), reads


def _collide(monkeypatch) -> None:
    """Three hash values for every key: each lookup confirms against stored keys."""
    monkeypatch.setattr(
        keyindex, "byte_hashes", lambda buf, ends: (np.diff(ends, prepend=0) % 3).astype(np.int64)
    )


def test_hashes_of_stored_bytes_and_of_keys_agree():
    keys = ["a", "ab", "ba", "doc-0000000001", "doc-0000000010", "ключ", "键🙂", "x" * 300]
    raw = [k.encode() for k in keys]
    stored = keyindex.byte_hashes(
        np.frombuffer(b"".join(raw), np.uint8), np.cumsum([len(r) for r in raw])
    )
    assert np.array_equal(stored, keyindex.hashes_of(keys))
    assert len(set(stored.tolist())) == len(keys)


@pytest.mark.parametrize("as_bytes", [False, True])
@pytest.mark.parametrize("collide", [False, True])
def test_lookups_are_exact(monkeypatch, collide, as_bytes):
    if collide:
        _collide(monkeypatch)
    monkeypatch.setattr(keyindex, "BLOCK", 5)
    monkeypatch.setattr(keyindex, "HASH_BLOCK", 7)
    rng = np.random.default_rng(0)
    keys = [f"k{int(x)}" for x in rng.integers(0, 10**6, 60)]
    keys[40] = keys[3]  # a repeated key: the first sequence is found
    table, reads = _table(keys, as_bytes)
    assert table.hashed == 0 and reads == []
    first = {}
    for i, k in enumerate(keys):
        first.setdefault(k, i)
    for n in (0, 25, 60):  # snapshots: only sequences [0, n) count
        for k in [*keys, "absent", "k"]:
            want = first.get(k)
            got = table.find(k, n)
            assert got == (want if want is not None and want < n else None), (k, n)
        probe = [*keys[:30], "absent"]
        want_many = [first.get(k, n) < n for k in probe]
        assert table.find_many(probe, n).tolist() == want_many
        assert [table.key(i, n) for i in range(n)] == keys[:n]
    assert table.hashed == 60
    assert list(table.keys(60)) == keys


@pytest.mark.parametrize("recent", [3, 1000])  # merged into the arrays, or still in the dict
def test_added_keys_are_found_without_a_read(monkeypatch, recent):
    monkeypatch.setattr(keyindex, "RECENT", recent)
    keys = [f"a{i}" for i in range(20)]
    table, reads = _table(keys)
    assert table.find("a3", 10) == 3
    before = len(reads)
    table.add(keys[10:14], 10)
    table.add(keys[14:20], 14)
    assert table.hashed == 20
    assert table.find_many(["a15", "a3", "zz", "a19"], 20).tolist() == [True, True, False, True]
    assert table.find_many(["a15", "a3"], 15).tolist() == [False, True]  # an older snapshot
    assert [table.find(k, 20) for k in ("a11", "a19", "zz")] == [11, 19, None]
    assert table.find("a11", 11) is None
    assert (10, 20) not in reads[before:]  # confirmations read blocks; nothing is hashed again
    table.add(["late"], 5)  # not where the table ends: ignored, hashed at the next lookup
    assert table.hashed == 20


def test_reader_open_reads_no_key_and_records_read_theirs_when_used(tmp_path):
    url = tmp_path / "c"
    recs = make_records(40, k=4, vocab=200, seed=3, min_len=2, max_len=7)
    with CacheWriter.open(url, make_manifest(k=4, vocab_size=200), layout=SMALL) as w:
        w.append(recs)
    r = CacheReader(url)
    table = r.index.table
    assert table.hashed == 0 and not table._blocks  # open read no key
    got = r.sequences([7, 30])
    assert all("key" not in g.__dict__ for g in got)  # read: still no key
    assert not table._blocks
    assert [g.key for g in got] == [recs[7].key, recs[30].key]
    assert table.hashed == 0  # reading a record's key hashes nothing
    assert r.read_ranges([(5, 9)])[2].key == recs[7].key
    copy = pickle.loads(pickle.dumps(r.sequence(11)))
    assert type(copy) is SequenceRecord and copy.key == recs[11].key
    assert replace(r.sequence(12)).key == recs[12].key
    assert r.index_of(recs[33].key) == 33 and recs[0].key in r and "nope" not in r
    assert table.hashed == 0 and table.runs is not None  # looked up in the on-disk index
    assert r.keys == [x.key for x in recs]
    assert np.array_equal(r.row_starts, np.cumsum([0] + [x.length - 1 for x in recs])[:-1])


def test_a_snapshot_sees_only_its_keys(tmp_path):
    url = tmp_path / "c"
    recs = make_records(30, k=4, vocab=200, seed=4, min_len=2, max_len=6)
    m = make_manifest(k=4, vocab_size=200)
    with CacheWriter.open(url, m, layout=SMALL) as w:
        w.append(recs[:12])
    r = CacheReader(url)
    old = r.index
    assert recs[20].key not in r
    with CacheWriter.open(url, m) as w:
        w.append(recs[12:])
    assert r.refresh()
    assert r.index_of(recs[20].key) == 20  # the shared table grows
    assert recs[20].key not in old and old.index_of(recs[5].key) == 5
    with pytest.raises(KeyError):
        old.index_of(recs[20].key)


def test_writer_skips_known_keys_when_hashes_collide(tmp_path, monkeypatch):
    _collide(monkeypatch)
    url = tmp_path / "c"
    recs = make_records(20, k=4, vocab=200, seed=5, min_len=2, max_len=6)
    m = make_manifest(k=4, vocab_size=200)
    with CacheWriter.open(url, m, layout=SMALL) as w:
        assert w.append(recs[:10]) == 10
        assert w.append([*recs[5:15], recs[12]]) == 5  # 5 known, one repeated in the batch
    with CacheWriter.open(url, m) as w:  # a new writer: its table is built at the first check
        assert w.contains(recs[14].key) and not w.contains(recs[15].key)
        assert w.append(recs) == 5
    r = CacheReader(url)
    assert r.keys == [x.key for x in recs]


@pytest.mark.parametrize("long", [False, True])
def test_snapshot_spans_from_index_blocks(long, monkeypatch):
    """The snapshot reads index blocks on demand (lengths and the block's first row) and keeps
    at most KEEP_BLOCKS; every span equals the running sums, across blocks and commits; a
    commit reads only its last block; R8 breaks are refused where the block is read."""
    from logitcache.cache_format import CorruptStoreError, IndexSnapshot
    from logitcache.cache_format import _snapshot as snap

    monkeypatch.setattr(snap, "BLOCK", 64)
    monkeypatch.setattr(snap, "KEEP_BLOCKS", 3)
    monkeypatch.setattr(snap, "WHOLE_BLOCK", 100)
    rng = np.random.default_rng(1)
    lengths = rng.integers(2, 50, 500).astype(np.int32)
    if long:
        lengths[300] = 70_000
    rows = np.concatenate([[0], np.cumsum(lengths - 1)]).astype(np.int64)
    toks = rows + np.arange(len(rows))
    table = keyindex.KeyTable(lambda a, b: np.array([], dtype=object))
    reads: list[tuple[int, int]] = []

    def read_block(a: int, b: int, upto: bool):
        reads.append((a, b))
        return lengths[a:b], int(rows[a]), int(rows[b]) if upto else None

    def manifest(n: int, **kw):
        return make_manifest().model_copy(
            update={"num_sequences": n, "num_rows": int(rows[n]), "num_tokens": int(toks[n]), **kw}
        )

    blocks = snap.IndexBlocks(read_block, lambda a, b: lengths[a:b])
    one = IndexSnapshot.empty(table, blocks).at(manifest(1))
    assert one.row_start(0) == 0 and one.length(0) == lengths[0] and reads == [(0, 1)]
    first = one.at(manifest(130))
    assert reads[-1] == (128, 130)  # a commit reads its last block only
    full = first.at(manifest(500))
    assert first.span(129) == full.span(129)
    assert full.lengths.dtype == (np.int32 if long else np.uint16)
    assert np.array_equal(full.lengths, lengths)
    assert np.array_equal(full.lengths_of(60, 300), lengths[60:300])
    assert np.array_equal(full.row_starts, rows[:-1]) and np.array_equal(
        full.token_starts, toks[:-1]
    )
    for i in range(500):
        assert full.span(i) == (slice(rows[i], rows[i + 1]), slice(toks[i], toks[i + 1]))
    assert full.range_span(7, 450) == (slice(rows[7], rows[450]), slice(toks[7], toks[450]))
    assert full.range_span(450, 500) == (slice(rows[450], rows[500]), slice(toks[450], toks[500]))
    for row in (0, 1, int(rows[1]), int(rows[200]) - 1, int(rows[200]), int(rows[499]) + 1):
        assert full.first_from_row(row) == int(np.searchsorted(rows[:-1], row, side="left"))
    assert full.first_from_row(int(rows[500])) == 500
    assert len(blocks) == 3  # KEEP_BLOCKS
    bad = lengths.copy()
    bad[53] = 1
    blocks = snap.IndexBlocks(lambda a, b, u: (bad[a:b], int(rows[a]), None), lambda a, b: bad)
    wrong = IndexSnapshot.empty(table, blocks).at(manifest(500))  # reads [448, 500) only
    with pytest.raises(CorruptStoreError, match="sequence 53 has a length < 2"):
        wrong.span(60)
    with pytest.raises(CorruptStoreError, match="commit counts"):
        IndexSnapshot.empty(table, snap.IndexBlocks(read_block, bad.__getitem__)).at(
            manifest(500, num_rows=int(rows[500]) + 1, num_tokens=int(toks[500]) + 1)
        )
    shifted = snap.IndexBlocks(lambda a, b, u: (lengths[a:b], int(rows[a]) + 1, None), bad.take)
    with pytest.raises(CorruptStoreError, match="seq_row_start"):
        IndexSnapshot.empty(table, shifted).at(manifest(500))


def test_refresh_keeps_arrays_whose_metadata_changed_only_in_shape(tmp_path, monkeypatch):
    """A refresh opens no array again when a commit changed only the shapes (the arrays kept at
    their new shapes read the new rows, through the direct and zarr paths); an array whose
    metadata changed otherwise is opened again."""
    import json

    from zarr.api import asynchronous

    url = tmp_path / "c"
    recs = make_records(9, seed=2)
    w = CacheWriter.open(url, make_manifest(), layout=SMALL)
    w.append(recs[:4])
    r = CacheReader(url)
    opened: list[str] = []
    real = asynchronous.open_array

    async def counted(*a, **kw):
        opened.append(kw["path"])
        return await real(*a, **kw)

    monkeypatch.setattr(asynchronous, "open_array", counted)
    w.append(recs[4:])
    assert r.refresh() and opened == []
    assert r.index.index_of(recs[8].key) == 8
    assert np.array_equal(r.sequence(8).topk_ids, recs[8].topk_ids)
    tail = r._opened.arrays["tail_mass"]
    assert tail.shape[0] == r.num_rows
    assert np.array_equal(tail[r.num_rows - 2 :], r.rows(r.num_rows - 2, r.num_rows).tail_mass)
    w.append([replace(recs[0], key="another")])
    w.close()
    doc_path = url / "tail_mass" / "zarr.json"  # after the commit: its shape is the new one
    doc = json.loads(doc_path.read_text())
    doc["attributes"]["note"] = "changed"
    doc_path.write_text(json.dumps(doc))
    assert r.refresh() and opened == ["tail_mass"]
    assert r._opened.arrays["tail_mass"].attrs["note"] == "changed"


def test_compiled_key_sums_hash_as_numpy_does(monkeypatch):
    """The writer's compiled key sums (loaded by ``fastencode.ready``) give byte_hashes the
    bits of its numpy form, for keys of every length and any bytes."""
    from logitcache.cache_format import fastencode

    if not fastencode.ready() or fastencode._sums is None:
        pytest.skip("numba is not available")
    rng = np.random.default_rng(4)
    keys = ["a", "ключ", "键🙂", "x" * 700, *(f"doc-{i:010d}" for i in range(500))]
    keys += ["".join(map(chr, rng.integers(1, 0x2FF, int(n)))) for n in rng.integers(1, 90, 300)]
    got = keyindex.hashes_of(keys)
    monkeypatch.setattr(fastencode, "_sums", None)
    assert keyindex.hashes_of(keys).tobytes() == got.tobytes()


@pytest.mark.parametrize("width", [1, 14, 300])
def test_numpy_key_sums_of_keys_of_one_length(width):
    """Keys of one length (a matrix product) sum as the general form and as Python's integers
    do, modulo 2**64, for any bytes; keys of two lengths take the general form."""
    rng = np.random.default_rng(width)
    n = 200
    lens = np.full(n, width, np.int64)
    starts = np.arange(n, dtype=np.int64) * width
    buf = rng.integers(0, 256, n * width).astype(np.uint8)
    buf[:width] = 255
    weights = keyindex._mix(np.arange(301, dtype=np.uint64) + keyindex._SEED) | np.uint64(1)
    got = keyindex.key_sums_numpy(buf, starts, lens, weights)
    w = [int(x) for x in weights]
    want = [
        sum((int(b) + 1) * w[j] for j, b in enumerate(buf[s : s + width])) % 2**64 for s in starts
    ]
    assert got.dtype == np.uint64 and got.tolist() == want
    mixed = np.append(lens[: n - 1], width + 1)  # the last key one byte longer: general form
    more = np.append(buf, np.uint8(7))
    assert keyindex.key_sums_numpy(more, starts, mixed, weights)[: n - 1].tolist() == want[:-1]

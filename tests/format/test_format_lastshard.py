"""The writer's memory of the last shard it wrote (shardwrite.LastShard): later appends of the
same writer take the committed chunks from it instead of reading the shard back, and the store
still holds zarr's bytes; another writer's append in between makes it read again."""

from __future__ import annotations

from pathlib import Path

from format_support import make_manifest, make_records, zarr_writes
from logitcache.cache_format import CacheWriter, validate
from logitcache.cache_format import _shardwrite as shardwrite
from test_format_shardwrite import LAYOUT, VOCAB, K, files, write


def _count_reads(monkeypatch) -> list[int]:
    reads = [0]
    real = shardwrite._existing

    def counted(*a, **kw):
        reads[0] += 1
        return real(*a, **kw)

    monkeypatch.setattr(shardwrite, "_existing", counted)
    return reads


def test_one_writer_never_reads_its_shards_back(tmp_path: Path, monkeypatch) -> None:
    recs = make_records(16, k=K, vocab=VOCAB, seed=5)
    cuts = [1, 2, 3, 5, 8, 9, 12, 15]  # appends starting and ending inside chunks and shards
    write(tmp_path / "zarr", recs, cuts, direct=False)
    reads = _count_reads(monkeypatch)
    write(tmp_path / "direct", recs, cuts, direct=True)
    assert reads[0] == 0
    a, b = files(tmp_path / "zarr"), files(tmp_path / "direct")
    assert a.keys() == b.keys() and [n for n in a if a[n] != b[n]] == []
    assert validate(tmp_path / "direct").ok


def test_another_writers_append_makes_it_read_again(tmp_path: Path, monkeypatch) -> None:
    recs = make_records(12, k=K, vocab=VOCAB, seed=6)
    m = make_manifest(k=K, vocab_size=VOCAB)
    with zarr_writes(), CacheWriter.open(tmp_path / "zarr", m, layout=LAYOUT) as w:
        for a, b in ((0, 3), (3, 5), (5, 9), (9, 12)):
            w.append(recs[a:b])
    reads = _count_reads(monkeypatch)
    url = tmp_path / "direct"
    with (
        CacheWriter.open(url, m, layout=LAYOUT) as w1,
        CacheWriter.open(url, m, layout=LAYOUT) as w2,
    ):
        w1.append(recs[0:3])
        w1.append(recs[3:5])  # continues its own shards: no read
        assert reads[0] == 0
        w2.append(recs[5:9])  # a writer that has not written here: reads the shards back
        after_w2 = reads[0]
        assert after_w2 > 0
        w1.append(recs[9:12])  # the store moved on under w1: it reads again
        assert reads[0] > after_w2
    a, b = files(tmp_path / "zarr"), files(url)
    assert a.keys() == b.keys() and [n for n in a if a[n] != b[n]] == []
    assert validate(url).ok

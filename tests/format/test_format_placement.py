"""Shard seals bind every shard object to its array, its place and its fill (FORMAT.md 4.8).

Small multi-shard caches (compressed and raw layouts, id remap, loss mask) get one intact shard
object put where it does not belong: two shards of one array swapped, one array's shard copied
over another array's of the same shape, the last shard replaced by its copy from before the last
append (a stale copy). Every read path (point reads, range reads, zarr's API, the reader's open)
raises a typed :class:`PlacementError` or :class:`ChecksumError`, ``validate`` reports it, and the
spec reader refuses it. Version-3 stores (no seals) still read and append.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from format_support import SMALL, make_manifest, make_records, write_small_cache
from logitcache.cache_format import (
    CacheReader,
    CacheWriter,
    ChecksumError,
    CorruptStoreError,
    validate,
)
from logitcache.cache_format import _shardread as shardread
from spec_reader import SpecError, SpecStore

RAW = replace(
    SMALL,
    id_codec="none",
    logprob_codec="none",
    other_codec="none",
    tail_codec="none",
    name="custom",
)
LAYOUTS = {"compressed": SMALL, "raw": RAW}
ARRAYS = ["input_ids", "topk_ids", "topk_logprobs", "tail_mass", "seq_lengths", "seq_keys"]


@pytest.fixture(scope="module", params=list(LAYOUTS))
def store(request, tmp_path_factory) -> Path:
    url = tmp_path_factory.mktemp(request.param) / "c"
    write_small_cache(str(url), LAYOUTS[request.param], id_remap=True, loss_mask=True)
    assert validate(str(url)).ok
    return url


def _shards(root: Path, name: str) -> list[Path]:
    c = root / name / "c"
    return sorted(
        (p for p in c.rglob("*") if p.is_file()), key=lambda p: int(p.relative_to(c).parts[0])
    )


def _read_all(url: Path, **kw) -> None:
    r = CacheReader(str(url), **kw)
    r.keys  # noqa: B018 (keys are read when used)
    r.sequences(range(r.num_sequences))
    r.rows(0, r.num_rows)
    r.tokens(0, r.num_tokens)


def _reads_fail(url: Path, monkeypatch) -> None:
    """Every read path over the whole store is a typed error: point reads (one and three
    threads), and zarr's array API (the path of layouts the direct reader does not take)."""
    for kw in ({}, {"decode_threads": 3}):
        with pytest.raises(CorruptStoreError):
            _read_all(url, **kw)
    with monkeypatch.context() as mp:
        mp.setattr(shardread, "direct_layout", lambda *a, **k: None)
        with pytest.raises(CorruptStoreError):
            _read_all(url)
    with pytest.raises(SpecError):
        SpecStore(url).decode()


@pytest.mark.parametrize("name", ARRAYS)
def test_swapped_shards_of_one_array_are_found(store, tmp_path, monkeypatch, name):
    work = tmp_path / "w"
    shutil.copytree(store, work)
    shards = _shards(work, name)
    assert len(shards) >= 2, name
    a, b = shards[0].read_bytes(), shards[1].read_bytes()
    shards[0].write_bytes(b)
    shards[1].write_bytes(a)
    report = validate(str(work))
    assert "placement" in report.codes(), str(report)
    _reads_fail(work, monkeypatch)


def test_shard_of_another_array_is_found(store, tmp_path, monkeypatch):
    """``seq_token_start`` and ``seq_row_start`` share dtype and shape: a copy of one over the
    other passes every CRC32C but not the seal's array name."""
    work = tmp_path / "w"
    shutil.copytree(store, work)
    src, dst = _shards(work, "seq_row_start")[1], _shards(work, "seq_token_start")[1]
    dst.write_bytes(src.read_bytes())
    assert "placement" in validate(str(work)).codes()
    # readers do not read seq_token_start (token starts are row starts plus i, FORMAT.md D1)
    r = CacheReader(str(work))
    last = r.num_sequences - 1
    assert r.index.row_start(last) == int(r.lengths[:last].astype(int).sum()) - last


def test_stale_copy_of_the_last_shard_is_found(tmp_path, monkeypatch):
    """The last ``input_ids`` shard restored from before the last append (a rolled-back copy):
    fewer entries than the commit needs."""
    url = tmp_path / "c"
    recs = make_records(12, k=6, vocab=300, seed=2, min_len=2, max_len=9)
    with CacheWriter.open(str(url), make_manifest(k=6, vocab_size=300), layout=SMALL) as w:
        w.append(recs[:8])
        old = {p: p.read_bytes() for p in _shards(url, "input_ids")}
        w.append(recs[8:])
    last = max(old, key=lambda p: int(p.name))
    assert last.read_bytes() != old[last]
    last.write_bytes(old[last])
    report = validate(str(url))
    assert "placement" in report.codes(), str(report)
    _reads_fail(url, monkeypatch)


def test_damaged_seal_is_a_checksum_error(store, tmp_path):
    work = tmp_path / "w"
    shutil.copytree(store, work)
    shard = _shards(work, "topk_ids")[0]
    data = bytearray(shard.read_bytes())
    n = 32 // 8  # SMALL: 4 chunks per row shard
    data[-(16 * n + 4) - 20] ^= 1  # a byte of the seal's shard coordinate
    shard.write_bytes(bytes(data))
    with pytest.raises(ChecksumError):
        CacheReader(str(work)).rows(0, 8)
    assert "unreadable" in validate(str(work)).codes()


def test_version_3_store_reads_and_appends_without_seals(tmp_path):
    url = tmp_path / "v3"
    recs = make_records(30, k=6, vocab=300, seed=5, min_len=2, max_len=30)
    m = make_manifest(k=6, vocab_size=300, format_version=3)
    with CacheWriter.open(str(url), m, layout=SMALL) as w:
        w.append(recs[:20])
    with CacheWriter.open(str(url), m, layout=SMALL) as w:
        w.append(recs[20:])
    assert validate(str(url)).ok
    r = CacheReader(str(url))
    assert r.manifest.format_version == 3
    for i, rec in enumerate(recs):
        got = r.sequence(i)
        assert got.key == rec.key and np.array_equal(got.input_ids, rec.input_ids)
        assert np.array_equal(got.topk_ids, rec.topk_ids)
    tail = _shards(url, "input_ids")[0].read_bytes()[-(16 * 4 + 4) - 28 :][:4]
    assert tail != b"LCS1"  # no seal in a version-3 store
    assert len(SpecStore(url).decode()["keys"]) == 30

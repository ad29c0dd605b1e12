"""The on-disk key index (FORMAT.md 4.11, cache_format/_keyruns.py) and ``logitcache repair``.

Every commit writes one run of sorted (hash, sequence) pairs, merged as a binary counter; lookups
and the writer's duplicate check read runs, not every key; the manifest lists the runs under the
root digest; ``validate`` checks them against the keys; a writer killed around the run loses
nothing committed; ``repair`` rebuilds a lost root from the newest run's commit record (locally
and on the moto S3 server), and writes nothing when no record passes."""

from __future__ import annotations

import json
import math
import signal
from pathlib import Path

import numpy as np
import pytest
from format_support import KILL_AFTER_RUN, make_manifest, make_records
from logitcache.cache_format import (
    CacheReader,
    CacheWriter,
    ChecksumError,
    SequenceBatch,
    StoreNeedsRepairError,
    validate,
)
from logitcache.cache_format import _keyruns as keyruns
from logitcache.client.cli import app
from test_format_crash import check_prefix, expected, resume_and_check, run_child
from test_format_root_damage import EDITS, WHERE, _Objects, _where
from typer.testing import CliRunner

K, VOCAB = 8, 1000


def _index_objects(objs: _Objects) -> set[str]:
    return {k for k in objs.listing() if k.startswith(keyruns.PREFIX)}


def test_runs_stay_few_and_lookups_exact(tmp_path):
    url = str(tmp_path / "c")
    recs = make_records(70, k=K, vocab=VOCAB, seed=1)
    m = make_manifest(K, VOCAB)
    with CacheWriter.open(url, m) as w:
        at = 0
        for size in [1, 1, 1, 5, 2, 1, 9, 1, 20, 3, 1, 25]:  # 12 commits
            assert w.append(recs[at : at + size]) == size
            at += size
            runs = w.manifest.runs()
            assert runs is not None and sum(r.count for r in runs) == at
            assert len(runs) <= math.log2(at) + 1  # binary counter: O(log S) runs
            assert [r.count for r in runs] == sorted((r.count for r in runs), reverse=True)
        assert w.append([recs[4], recs[69], recs[30]]) == 0  # known keys: nothing written
        assert w.contains(recs[0].key) and not w.contains("absent")
    objs = _Objects(url, {})
    listed = {r.key for r in CacheReader(url).manifest.runs() or []}
    assert _index_objects(objs) == listed  # merged runs are deleted after their commit
    r = CacheReader(url)
    assert r.index.table.runs is not None
    for i in (0, 3, 17, 44, 69):
        assert r.index_of(recs[i].key) == i
    assert "absent" not in r and r.index.table.hashed == 0  # no key hashed, none loaded


def test_writer_keeps_what_it_committed_as_stored(tmp_path, monkeypatch):
    """What a writer keeps of the runs it committed (fence, small runs' entries) is what a
    fresh read of the stored objects gives, and its lookups and merges read no run object."""
    url = str(tmp_path / "c")
    recs = make_records(40, k=K, vocab=VOCAB, seed=3)
    reads: list[str] = []
    real = keyruns._get

    def counting(store, key, byte_range=None):
        reads.append(key)
        return real(store, key, byte_range)

    monkeypatch.setattr(keyruns, "_get", counting)
    with CacheWriter.open(url, make_manifest(K, VOCAB)) as w:
        at = 0
        for size in [1, 1, 2, 1, 5, 1]:
            assert w.append(recs[at : at + size]) == size  # merges the runs it wrote
            at += size
            assert w.append(recs[:at]) == 0  # every key known: found in the kept runs
        assert reads == []
        table = w._keys.runs
        assert table is not None and len(w.manifest.runs() or []) > 1
        for ref in w.manifest.runs() or []:
            kept, stored = table._fence(ref), keyruns.read_fence(w._store, ref)
            assert all((a == b).all() for a, b in zip(kept[:2], stored[:2], strict=True))
            assert kept[2:] == stored[2:]
            assert table.entries(ref).tobytes() == keyruns.read_run(w._store, ref).tobytes()
    assert reads  # the fresh reads above did read the objects
    assert validate(url).ok


def test_store_without_index_uses_the_lazy_path(tmp_path):
    """A version-3 store (written before the index) has none: keys are hashed at the first
    lookup, as before; appending keeps it without one."""
    url = str(tmp_path / "c")
    recs = make_records(12, k=K, vocab=VOCAB, seed=2)
    m = make_manifest(K, VOCAB, format_version=3)
    with CacheWriter.open(url, m) as w:
        w.append(recs[:6])
    with CacheWriter.open(url, m) as w:
        assert w.append(recs) == 6 and w.manifest.key_index is None
    r = CacheReader(url)
    assert r.index_of(recs[9].key) == 9 and r.index.table.runs is None
    assert r.index.table.hashed == 12
    assert not (Path(url) / keyruns.PREFIX).exists() and validate(url).ok


def test_old_snapshot_finds_keys_after_its_runs_are_merged_away(tmp_path):
    url = str(tmp_path / "c")
    recs = make_records(8, k=K, vocab=VOCAB, seed=3)
    m = make_manifest(K, VOCAB)
    with CacheWriter.open(url, m) as w:
        w.append(recs[:4])
    r = CacheReader(url)
    with CacheWriter.open(url, m) as w:
        w.append(recs[4:])  # merges the reader's run into a new one and deletes it
    assert not (Path(url) / (r.manifest.runs() or [])[0].key).exists()
    assert r.index_of(recs[2].key) == 2 and recs[6].key not in r  # its snapshot's keys only


def test_damaged_run_is_a_typed_error_and_a_validate_finding(tmp_path):
    url = str(tmp_path / "c")
    recs = make_records(10, k=K, vocab=VOCAB, seed=4)
    with CacheWriter.open(url, make_manifest(K, VOCAB)) as w:
        w.append(recs)
    (run,) = CacheReader(url).manifest.runs() or []
    path = Path(url) / run.key
    data = bytearray(path.read_bytes())
    data[20] ^= 0x40  # an entry's bytes: its block fails its CRC32C
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="block 0"):
        CacheReader(url).index_of(recs[3].key)
    report = validate(url)
    assert "key_index" in report.codes(), str(report)
    data[20] ^= 0x40
    data[-10] ^= 0x01  # the footer
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="footer"):
        CacheWriter.open(url, make_manifest(K, VOCAB)).contains(recs[0].key)


@pytest.mark.subprocess
def test_sigkill_after_the_run_before_the_commit(tmp_path):
    url = tmp_path / "c"
    proc = run_child(url, 30, 5, 7, 2, KILL_AFTER_RUN)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert proc.stdout.split() == ["COMMITTED", "5", "COMMITTED", "10"]
    recs = expected()
    assert check_prefix(url, recs) == 10  # the run of the killed append is no commit's
    listed = {r.key for r in CacheReader(url).manifest.runs() or []}
    assert len(_index_objects(_Objects(str(url), {})) - listed) == 1  # its orphan run
    resume_and_check(url, recs, 10)  # the next writer deletes it and goes on
    listed = {r.key for r in CacheReader(url).manifest.runs() or []}
    assert _index_objects(_Objects(str(url), {})) == listed


@pytest.mark.subprocess
def test_repair_after_a_kill_between_run_and_commit_restores_that_append(tmp_path):
    """The killed append's arrays were all written (and made durable) before its run: the run's
    record is a complete commit, so the repair restores it."""
    url = tmp_path / "c"
    proc = run_child(url, 30, 5, 7, 2, KILL_AFTER_RUN)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    (url / "zarr.json").unlink()
    res = CliRunner().invoke(app, ["repair", str(url)])
    assert res.exit_code == 0, res.output
    assert "generation 3, 15 sequences" in res.output
    assert check_prefix(url, expected()) == 15


def _cli_options(opts: dict) -> list[str]:
    return [x for n, v in opts.items() for x in ("-o", f"{n}={v}")]


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("edit", ["deleted", "garbage", "creation_marker", "truncated"])
def test_repair_rebuilds_a_lost_root(request, tmp_path, where, edit):
    url, opts = _where(request, tmp_path, where)
    recs = make_records(9, k=K, vocab=VOCAB, seed=5)
    m = make_manifest(K, VOCAB)
    with CacheWriter.open(url, m, opts) as w:
        for a in range(0, 9, 3):
            w.append(recs[a : a + 3])
    objs = _Objects(url, opts)
    good = objs.get("zarr.json")
    objs.put("zarr.json", EDITS[edit](good))
    with pytest.raises(StoreNeedsRepairError, match="logitcache repair"):
        CacheWriter.open(url, m, opts)
    res = CliRunner().invoke(app, ["repair", url, *_cli_options(opts)])
    assert res.exit_code == 0, res.output
    assert "root rebuilt" in res.output and "9 sequences" in res.output
    assert (
        json.loads(objs.get("zarr.json") or b"")["attributes"]
        == json.loads(good or b"")["attributes"]
    )
    assert CacheReader(url, opts).keys == [r.key for r in recs]
    assert validate(url, opts).ok
    with CacheWriter.open(url, m, opts) as w:
        assert w.append(make_records(12, k=K, vocab=VOCAB, seed=5)) == 3
    again = CliRunner().invoke(app, ["repair", url, *_cli_options(opts)])
    assert again.exit_code == 0 and "nothing to repair" in again.output


def test_repair_without_a_record_writes_nothing(tmp_path):
    """A store without a key index (version 3) holds no commit record: ``repair`` says so,
    exits 2 and writes nothing; so does one whose only run is damaged."""
    for version, damage_run in ((3, False), (4, True)):
        url = str(tmp_path / f"v{version}")
        with CacheWriter.open(url, make_manifest(K, VOCAB, format_version=version)) as w:
            w.append(make_records(4, k=K, vocab=VOCAB, seed=6))
        objs = _Objects(url, {})
        if damage_run:
            (key,) = _index_objects(objs)
            data = bytearray(objs.get(key) or b"")
            data[-5] ^= 0xFF
            objs.put(key, bytes(data))
        objs.put("zarr.json", None)
        before = objs.listing()
        res = CliRunner().invoke(app, ["repair", url])
        assert res.exit_code == 2 and "no commit record" in res.output, res.output
        assert objs.listing() == before


def test_reindex_gives_an_old_store_its_key_index(tmp_path):
    url = str(tmp_path / "c")
    recs = make_records(10, k=K, vocab=VOCAB, seed=7)
    m = make_manifest(K, VOCAB, format_version=3)
    with CacheWriter.open(url, m) as w:
        w.append(recs[:7])
    res = CliRunner().invoke(app, ["reindex", url])
    assert res.exit_code == 0 and "key index of 7 sequences written" in res.output, res.output
    r = CacheReader(url)
    assert r.manifest.generation == 2 and r.index.table.runs is not None
    assert r.index_of(recs[5].key) == 5 and r.index.table.hashed == 0
    with CacheWriter.open(url, m) as w:
        assert w.append(recs) == 3 and [r.count for r in w.manifest.runs() or []] == [7, 3]
    assert validate(url).ok
    assert "has a key index already" in CliRunner().invoke(app, ["reindex", url]).output
    (Path(url) / "zarr.json").unlink()
    assert CliRunner().invoke(app, ["repair", url]).exit_code == 0
    assert CacheReader(url).keys == [x.key for x in recs]


def _count_block_reads(monkeypatch) -> list[tuple[int, int]]:
    """The ``(first, stop)`` block ranges of every key-index run read from now on."""
    reads: list[tuple[int, int]] = []
    real = keyruns._blocks

    def counted(store, ref, crcs, a, b):
        reads.append((a, b))
        return real(store, ref, crcs, a, b)

    monkeypatch.setattr(keyruns, "_blocks", counted)
    return reads


def test_run_blocks_are_kept_bounded_and_checked_once(tmp_path, monkeypatch):
    """A lookup keeps the run blocks it read (at most KEEP_BLOCKS): the next lookup in them
    reads no run object; a writer checks a group's keys together (``missing``)."""
    url = str(tmp_path / "c")
    recs = make_records(12, k=K, vocab=VOCAB, seed=6)
    with CacheWriter.open(url, make_manifest(K, VOCAB)) as w:
        for a in range(0, 12, 3):
            w.append(recs[a : a + 3])
        assert w.missing([recs[0].key, "absent", recs[11].key]) == ["absent"]
        assert w.missing([]) == []
    monkeypatch.setattr(keyruns, "KEEP_BLOCKS", 1)
    reads = _count_block_reads(monkeypatch)
    r = CacheReader(url)
    runs = r.manifest.runs() or []
    assert len(runs) == 1  # 4 commits of 3: one merged run
    assert r.index_of(recs[5].key) == 5 and len(reads) == 1
    assert r.index_of(recs[7].key) == 7 and "absent" not in r and len(reads) == 1
    assert len(r.index.table.runs._kept) == 1


def _short_batch(keys: list[str]) -> SequenceBatch:
    """2-token sequences under ``keys``, k=K."""
    n = len(keys)
    ids = (np.arange(K)[None, :] + np.arange(n)[:, None] % (VOCAB - K)).astype(np.int32)
    lp = np.tile(-0.5 * np.arange(1, K + 1, dtype=np.float32), (n, 1))
    toks = (np.arange(2 * n) % VOCAB).astype(np.int32)
    return SequenceBatch(toks, np.arange(0, 2 * n + 1, 2), ids, lp, keys)


def test_many_key_lookups_read_only_the_blocks_holding_their_hashes(tmp_path, monkeypatch):
    """A writer keeps the hashes of the runs it commits: looking up many new keys reads no run
    block, a known key reads the one block that holds it; a reader that read a run whole keeps
    its hashes (at most KEEP_HASHES entries); lookups stay exact when every hash collides."""
    url = str(tmp_path / "c")
    keys = [f"k{i:06d}" for i in range(20000)]
    reads = _count_block_reads(monkeypatch)
    monkeypatch.setattr(keyruns, "KEEP_BLOCKS", 4)  # no run's blocks kept whole
    with CacheWriter.open(url, make_manifest(K, VOCAB)) as w:
        assert w.append(_short_batch(keys[:10000])) == 10000
        assert w.append(_short_batch(keys[10000:15000])) == 5000
        assert [r.count for r in w.manifest.runs() or []] == [10000, 5000]  # 3 + 2 blocks
        reads.clear()
        assert w.missing(keys[15000:]) == keys[15000:] and reads == []
        assert w.missing([keys[15000], keys[7], keys[12000]]) == [keys[15000]]
        assert len(reads) == 2 and all(b == a + 1 for a, b in reads)  # one block per run
        assert w.append(_short_batch(keys[14990:16000])) == 1000
    reads.clear()
    monkeypatch.setattr(keyruns, "KEEP_HASHES", 12000)
    r = CacheReader(url)
    table = r.index.table
    assert table.find_many(keys[16000:], 16000).tolist() == [False] * 4000
    assert sum(b - a for a, b in reads) == 3 + 2 + 1  # every block of the 3 runs, once
    reads.clear()
    assert table.find_many(keys[16000:] + keys[:3], 16000).tolist() == [False] * 4000 + [True] * 3
    assert reads and sum(b - a for a, b in reads) < 3 + 2 + 1  # the kept runs' candidates only
    assert table.runs is not None and table.runs._held <= 12000


def test_lookups_through_kept_hashes_are_exact_when_hashes_collide(tmp_path, monkeypatch):
    """Keys whose hashes collide (three hash values for all keys) are told apart by their
    stored keys, through kept hashes as through the fence."""
    from logitcache.cache_format import _keyindex as keyindex

    monkeypatch.setattr(
        keyindex, "byte_hashes", lambda buf, ends: (np.diff(ends, prepend=0) % 3).astype(np.int64)
    )
    url = str(tmp_path / "c")
    keys = [f"k{i}" for i in range(300)]  # lengths 2, 3, 4: three hashes
    with CacheWriter.open(url, make_manifest(K, VOCAB)) as w:
        assert w.append(_short_batch(keys[:200])) == 200
        assert w.append(_short_batch(keys[150:250])) == 50
        assert w.missing(keys[240:300]) == keys[250:300]
    table = CacheReader(url).index.table
    for _ in range(2):  # the fence, then the hashes kept
        assert table.find_many(keys[240:300], 250).tolist() == [True] * 10 + [False] * 50


def test_hash_order_is_the_stable_order():
    rng = np.random.default_rng(0)
    for h in (rng.integers(-(2**63), 2**63 - 1, 1000), rng.integers(0, 50, 1000), np.zeros(0)):
        h = h.astype(np.int64)
        assert keyruns.hash_order(h).tolist() == np.argsort(h, kind="stable").tolist()


def test_compiled_merge_writes_the_runs_numpy_writes(monkeypatch):
    """A commit's run merged by the compiled kernel (loaded by ``fastencode.ready``) is, byte
    for byte, the stable sort's, equal hashes across runs included."""
    from logitcache.cache_format import fastencode

    if not fastencode.ready() or fastencode._merge is None:
        pytest.skip("numba is not available")
    stored: dict[str, np.ndarray] = {}

    def commits() -> list[bytes]:
        runs: list[keyruns.RunRef] = []
        objs = []
        for g, n in enumerate([700, 300, 200, 100, 100, 4500, 1]):  # merges of 5 and 2 runs
            h = rng.integers(-50, 50, n) * (2**40)  # hashes repeat, within and across runs
            first = sum(r.count for r in runs)
            runs, ref, obj, _ = keyruns.next_runs(
                lambda r: stored[r.key], runs, h, first, g + 1, lambda rs: b"{}"
            )
            stored[ref.key] = np.frombuffer(obj, keyruns.ENTRY, ref.count)
            objs.append(obj)
        return objs

    rng = np.random.default_rng(5)
    fast = commits()
    monkeypatch.setattr(fastencode, "_merge", None)
    rng = np.random.default_rng(5)
    assert commits() == fast

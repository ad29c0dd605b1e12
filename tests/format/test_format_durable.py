"""Durability of local appends (FORMAT.md W5): every object an append writes is fsynced before its
rename, every changed directory is fsynced before the commit, and the commit (root zarr.json)
and its directory are fsynced before append() returns. Observed with a spy around the real
os.fsync (which still runs)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import zarr.storage
from format_support import make_manifest, make_records
from logitcache.cache_format import CacheReader, CacheWriter
from logitcache.cache_format.store import DurableLocalStore


def _spy(monkeypatch) -> list[str]:
    events: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        events.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return events


def test_append_fsyncs_data_then_commit(tmp_path, monkeypatch):
    url = tmp_path / "c"
    recs = make_records(30, seed=4)
    with CacheWriter.open(url, make_manifest()) as w:
        assert isinstance(w._store, DurableLocalStore)
        w.append(recs[:10])
        events = _spy(monkeypatch)
        before = {p: p.stat().st_mtime_ns for p in url.rglob("*") if p.is_file()}
        w.append(recs[10:])
    root = str(url.resolve())
    changed = [p for p in url.rglob("*") if p.is_file() and before.get(p) != p.stat().st_mtime_ns]
    data = [p for p in changed if p.name != "zarr.json" and ".logitcache" not in p.name]
    assert len(data) >= 8  # the shards of every array
    # each written object was fsynced under its temporary name, before the rename
    synced_files = {Path(e).name.split(".")[0] for e in events if e.endswith(".partial")}
    assert {p.name for p in data} <= synced_files
    commit = max(
        i
        for i, e in enumerate(events)
        if Path(e).name.startswith("zarr.") and Path(e).parent == Path(root)
    )
    # the shard directories are synced before the commit is written, the root dir after it
    for p in data:
        assert str(p.parent.resolve()) in events[:commit], p
    assert root in events[commit + 1 :]
    assert not list(url.rglob("*.partial"))
    r = CacheReader(url)
    assert r.keys == [x.key for x in recs]
    np.testing.assert_array_equal(r.sequence(29).topk_ids, recs[29].topk_ids)


def test_new_shard_directory_entries_are_synced(tmp_path, monkeypatch):
    """A shard in a new directory (c/1/) makes its parent (c/) change: both get fsynced."""
    from logitcache.cache_format import Layout

    url = tmp_path / "c"
    layout = Layout(row_chunk=8, row_shard=16, token_chunk=8, token_shard=16)
    with CacheWriter.open(url, make_manifest(), layout=layout) as w:
        w.append(make_records(2, seed=1, min_len=5, max_len=5))
        events = _spy(monkeypatch)
        w.append(make_records(6, seed=2, min_len=9, max_len=9, prefix="b"))
    ids_c = (url / "topk_ids" / "c").resolve()
    assert (ids_c / "2").is_dir()
    assert str(ids_c / "2") in events and str(ids_c) in events


def test_fsync_false_writes_plain_localstore(tmp_path, monkeypatch):
    url = tmp_path / "c"
    events = _spy(monkeypatch)
    with CacheWriter.open(url, make_manifest(), fsync=False) as w:
        assert type(w._store) is zarr.storage.LocalStore
        w.append(make_records(5))
    assert events == []
    assert CacheReader(url).num_sequences == 5


def test_fsync_false_writes_each_object_by_rename_on_the_calling_thread(tmp_path, monkeypatch):
    """Without fsync an append's objects are still written as zarr writes them (a ``*.partial``
    file renamed over the key: never a torn object), on the appending thread, none left over."""
    url = tmp_path / "c"
    renames: list[tuple[str, str, int]] = []
    real = os.replace

    def spy(src, dst, *a, **kw):
        renames.append((str(src), str(dst), threading.get_ident()))
        return real(src, dst, *a, **kw)

    with CacheWriter.open(url, make_manifest(), fsync=False) as w:
        monkeypatch.setattr(os, "replace", spy)
        w.append(make_records(5))
    shards = [r for r in renames if "c" in Path(r[1]).relative_to(url).parts]
    assert {Path(d).relative_to(url).parts[0] for _, d, _ in shards} >= {"topk_ids", "input_ids"}
    assert all(s.endswith(".partial") and s.startswith(d + ".") for s, d, _ in shards)
    assert {t for _, _, t in shards} == {threading.get_ident()}
    assert not list(url.rglob("*.partial"))


def test_temporary_names_differ_across_writes_and_forked_children():
    """The ``*.partial`` name part is unique per write, and a forked child (a server worker, a
    DataLoader worker) draws a prefix of its own rather than repeating its parent's names."""
    from logitcache.cache_format import store

    a, b = store._temporary_tag(), store._temporary_tag()
    assert a != b and a[:16] == b[:16]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its tag, then leave without running the test session's exit
        os.write(write, store._temporary_tag().encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 100).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert child[:16] != a[:16] and len(child) > 16

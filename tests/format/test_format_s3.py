"""Object storage: the format on a real S3-compatible server (moto, 127.0.0.1) through zarr's
ObjectStore (obstore) and FsspecStore (s3fs): round trip, writer lease lock, SIGKILL + resume,
and two appender processes plus a reader process working on one cache at once."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from format_support import (
    CHILD_K,
    CHILD_VOCAB,
    KILL_AFTER_RUN,
    make_manifest,
    make_records,
    s3_client,
)
from logitcache.cache_format import CacheReader, CacheWriter, WriterLockedError, validate
from logitcache.cache_format._lock import ObjectLock
from logitcache.cache_format.store import open_store
from test_format_crash import SUPPORT, check_prefix, expected, resume_and_check, run_child


def test_s3_roundtrip_obstore_and_fsspec(s3_store):
    url, opts = s3_store
    recs = make_records(20, seed=11)
    with CacheWriter.open(url, make_manifest(), opts) as w:
        assert w.append(recs[:12]) == 12
    with CacheWriter.open(url, make_manifest(), dict(opts, backend="fsspec")) as w:  # s3fs
        assert type(w._lock).__name__ == "ObjectLock"  # cross-process lease even via s3fs
        assert w.append(recs) == 8
    for backend in ("obstore", "fsspec"):
        r = CacheReader(url, dict(opts, backend=backend))
        assert r.keys == [x.key for x in recs]
        got = r.get("s13")
        assert np.array_equal(got.topk_ids, recs[13].topk_ids)
    assert validate(url, opts).ok
    bucket = url.split("/")[2]
    s3 = s3_client(opts["endpoint_url"])
    names = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]}
    assert "cache/zarr.json" in names and "cache/topk_ids/c/0/0" in names
    assert "cache/.logitcache.lock" not in names  # released after each append


def test_s3_lock_excludes_second_writer_and_expires(s3_store):
    url, opts = s3_store
    with CacheWriter.open(url, make_manifest(), opts) as w:
        w.append(make_records(2))
    handle = open_store(url, opts, read_only=False)
    holder = ObjectLock(handle.objstore, ttl=30)
    holder.acquire(timeout=1)
    try:
        with pytest.raises(WriterLockedError):
            CacheWriter.open(url, make_manifest(), opts, lock_timeout=0.5)
    finally:
        holder.release()
    # a dead holder's lease is taken over once it expires
    dead = ObjectLock(handle.objstore, ttl=1.0)
    dead.acquire(timeout=1)
    dead._stop.set()  # simulate a crash: no more heartbeats, never released
    t0 = time.monotonic()
    with CacheWriter.open(url, make_manifest(), opts, lock_timeout=10) as w2:
        assert w2.append(make_records(4)) == 2
    assert time.monotonic() - t0 >= 0.5


@pytest.mark.parametrize("crash_after", [3, KILL_AFTER_RUN])  # inside the arrays; after the run
def test_s3_sigkill_and_resume(s3_store, crash_after):
    url, opts = s3_store
    proc = run_child(url, 30, 5, 7, 2, crash_after, 1.5, options=opts)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    recs = expected()
    assert check_prefix(url, recs, opts) == 10
    resume_and_check(url, recs, 10, opts, lock_timeout=30)  # waits out the dead writer's lease
    bucket, prefix = url[len("s3://") :].split("/", 1)
    listing = s3_client(opts["endpoint_url"]).list_objects_v2(
        Bucket=bucket, Prefix=f"{prefix}/seq_keys/index/"
    )
    stored = {o["Key"][len(prefix) + 1 :] for o in listing.get("Contents", [])}
    assert stored == {r.key for r in CacheReader(url, opts).manifest.runs() or []}  # no orphan


def _spawn(kind: str, url: str, opts: dict, *args: object) -> subprocess.Popen:
    cmd = [sys.executable, SUPPORT, kind, url, json.dumps(opts), *map(str, args)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("where", ["s3", "local"])
def test_two_appenders_and_a_reader(s3_store, tmp_path, where):
    url, opts = s3_store if where == "s3" else (str(tmp_path / "c"), {})
    n = 12
    with CacheWriter.open(url, make_manifest(k=CHILD_K, vocab_size=CHILD_VOCAB), opts):
        pass
    reader = _spawn("read", url, opts, 90, f"a:1:{n},b:2:{n}", 2 * n)
    assert reader.stdout.readline().strip() == "READY"  # reading before the writers start
    writers = [
        _spawn("append", url, opts, n, 3, seed, -1, 0, 10, p) for seed, p in ((1, "a"), (2, "b"))
    ]
    for w in writers:
        out, err = w.communicate(timeout=180)
        assert w.returncode == 0, err
    out, err = reader.communicate(timeout=180)  # ends once it has seen all 2n sequences
    assert reader.returncode == 0, err
    distinct = int(out.split("distinct=")[1].split()[0])
    assert distinct >= 2, out  # the reader saw the store grow while the writers appended
    r = CacheReader(url, opts)
    assert r.num_sequences == 2 * n and len(set(r.keys)) == 2 * n
    want = {
        x.key: x
        for p, s in (("a", 1), ("b", 2))
        for x in make_records(n, k=CHILD_K, vocab=CHILD_VOCAB, seed=s, prefix=p)
    }
    for rec in r.sequences(range(2 * n)):
        assert np.array_equal(rec.topk_ids, want[rec.key].topk_ids)
        assert np.array_equal(rec.input_ids, want[rec.key].input_ids)
    assert [k for k in r.keys if k.startswith("a")] == [f"a{i}" for i in range(n)]
    assert validate(url, opts).ok


@pytest.mark.parametrize("backend", ["obstore", "fsspec"])
def test_s3_store_made_from_creation_templates(s3_store, monkeypatch, backend):
    """issue #19: the second store of a layout in a process gets its arrays' ``zarr.json``
    written from templates (no zarr ``create_array``) on S3 too: the same objects as the first
    store, which zarr created, and both read back and validate."""
    from logitcache.cache_format import _templates as templates
    from logitcache.cache_format import _writer as writer

    monkeypatch.setattr(templates, "CREATED", {})
    made: list[str] = []
    real = writer.create_array
    monkeypatch.setattr(writer, "create_array", lambda *a: made.append(a[1].name) or real(*a))
    url, opts = s3_store
    opts = dict(opts, backend=backend)
    recs = make_records(9, seed=12)
    for name in ("first", "second"):
        with CacheWriter.open(f"{url}/{name}", make_manifest(), opts) as w:
            assert w.append(recs[:4]) == 4 and w.append(recs[4:]) == 5
        if name == "first":
            assert len(made) >= 8
            made.clear()
    assert made == []  # the second store: no zarr create_array
    bucket = url.split("/")[2]
    s3 = s3_client(opts["endpoint_url"])

    def objects(prefix: str) -> dict[str, bytes]:
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]]
        out = {
            k[len(prefix) :]: s3.get_object(Bucket=bucket, Key=k)["Body"].read()
            for k in keys
            if k != prefix + "zarr.json"  # the root holds timestamps
        }
        for k, data in out.items():  # a key index run: its entries (its record: the root's)
            if k.startswith("seq_keys/index/"):
                first, end, _ = map(int, k.rsplit("/", 1)[1].split("-"))
                out[k] = data[: 16 * (end - first)]
        return out

    a, b = objects("cache/first/"), objects("cache/second/")
    assert len(a) > 10 and a.keys() == b.keys() and [k for k in a if a[k] != b[k]] == []
    for name in ("first", "second"):
        r = CacheReader(f"{url}/{name}", opts)
        assert r.keys == [x.key for x in recs]
        assert np.array_equal(r.get("s7").topk_ids, recs[7].topk_ids)
        assert validate(f"{url}/{name}", opts).ok

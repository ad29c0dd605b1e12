"""O_DIRECT object writes of the durable local store (issue #19, FORMAT.md W5a): the same bytes as
the buffered write, really written with O_DIRECT (its fd's flags, read at the fsync that still
comes before the rename), a filesystem refusing O_DIRECT falling back to the buffered write and
remembered, the opt-out (the argument), and a writer killed mid-append while every
object goes through O_DIRECT leaving its committed prefix readable."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zarr.storage
from format_support import make_manifest, make_records, store_objects
from logitcache.cache_format import CacheReader, CacheWriter, store
from logitcache.cache_format import _shardwrite as shardwrite
from logitcache.cache_format.store import DurableLocalStore, open_store
from zarr.core.buffer import default_buffer_prototype

PROTO = default_buffer_prototype().buffer
O_DIRECT = getattr(os, "O_DIRECT", 0)
pytestmark = pytest.mark.skipif(not O_DIRECT, reason="no O_DIRECT on this platform")


def _direct_fd(fd: int) -> bool:
    """Whether ``fd`` was opened with O_DIRECT (its flags in /proc/self/fdinfo, octal)."""
    text = Path(f"/proc/self/fdinfo/{fd}").read_text()
    flags = next(int(line.split()[1], 8) for line in text.splitlines() if line.startswith("flags"))
    return bool(flags & O_DIRECT)


def _spy_fsync(monkeypatch) -> list[tuple[str, bool]]:
    """Every fsync as (file name, opened with O_DIRECT); the real fsync still runs."""
    seen: list[tuple[str, bool]] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        seen.append((Path(os.readlink(f"/proc/self/fd/{fd}")).name, _direct_fd(fd)))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return seen


def _payloads() -> dict[str, np.ndarray]:
    """Objects below and above the threshold, from page-aligned memory (as shardwrite assembles
    its shards) and from memory one byte off, some larger than the bounce buffer."""
    rng = np.random.default_rng(0)
    big = rng.integers(0, 256, 2 * store.DIRECT_IO_BUFFER + 9_000, dtype=np.uint8)
    aligned = shardwrite._aligned(big.size)
    aligned[:] = big
    out = {}
    for n in (store.DIRECT_IO_MIN - 1, store.DIRECT_IO_MIN, 20 * 4096, 200_003, big.size):
        out[f"aligned_{n}"] = aligned[:n]
        out[f"offset_{n}"] = big[1 : n + 1]
    return out


def test_direct_writes_the_buffered_bytes(tmp_path, monkeypatch):
    direct = DurableLocalStore(tmp_path / "d")
    buffered = DurableLocalStore(tmp_path / "b", direct_io=False)
    assert direct.direct_io and not buffered.direct_io
    seen = _spy_fsync(monkeypatch)
    for name, data in _payloads().items():
        for s in (direct, buffered):
            seen.clear()
            s._put_durable(s.root / "a" / "c" / name, PROTO.from_array_like(data), False)
            # fsynced under its temporary name, before the rename; O_DIRECT iff large and asked
            assert [n.endswith(".partial") for n, _ in seen] == [True]
            assert seen[0][1] == (s is direct and len(data) >= store.DIRECT_IO_MIN), name
        got = (direct.root / "a" / "c" / name).read_bytes()
        assert got == (buffered.root / "a" / "c" / name).read_bytes() == data.tobytes(), name
    assert direct.direct_io  # nothing refused on this filesystem
    assert {direct.root, direct.root / "a", direct.root / "a" / "c"} <= direct._dirty
    assert not list(tmp_path.rglob("*.partial"))


def test_direct_exclusive_write_refuses_an_existing_key(tmp_path):
    s = DurableLocalStore(tmp_path)
    data = PROTO.from_array_like(np.arange(store.DIRECT_IO_MIN, dtype=np.uint8))
    s._put_durable(tmp_path / "x", data, True)
    with pytest.raises(FileExistsError):
        s._put_durable(tmp_path / "x", data, True)
    assert (tmp_path / "x").read_bytes() == bytes(data.as_buffer_like())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]


def _refuse_direct_open(monkeypatch) -> list[int]:
    """os.open refusing O_DIRECT as tmpfs before Linux 6.6 and ramfs do: the file is created,
    then EINVAL. Returns the flags of every open asking for O_DIRECT."""
    asked: list[int] = []
    real = os.open

    def fake(path, flags, mode=0o777, **kw):
        if flags & O_DIRECT:
            asked.append(flags)
            os.close(real(path, flags & ~O_DIRECT, mode, **kw))
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real(path, flags, mode, **kw)

    monkeypatch.setattr(os, "open", fake)
    return asked


def test_refused_open_falls_back_and_is_remembered(tmp_path, monkeypatch):
    asked = _refuse_direct_open(monkeypatch)
    s = DurableLocalStore(tmp_path)
    data = _payloads()["offset_200003"]
    for name in ("x", "y"):
        s._put_durable(tmp_path / name, PROTO.from_array_like(data), False)
        assert (tmp_path / name).read_bytes() == data.tobytes()
    assert len(asked) == 1 and not s.direct_io  # asked once, then buffered
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x", "y"]


def test_refused_write_falls_back(tmp_path, monkeypatch):
    """A filesystem whose open takes the flag but whose write refuses it (EINVAL) after part of
    the object went out: the temporary file is dropped, the object written buffered."""
    real = store._write_direct

    def half_then_refuse(fd: int, data: memoryview) -> None:
        real(fd, data[:8192])
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(store, "_write_direct", half_then_refuse)
    s = DurableLocalStore(tmp_path)
    data = _payloads()["aligned_200003"]
    s._put_durable(tmp_path / "x", PROTO.from_array_like(data), False)
    assert (tmp_path / "x").read_bytes() == data.tobytes()
    assert not s.direct_io
    assert [p.name for p in tmp_path.iterdir()] == ["x"]


def test_other_errors_are_raised_not_hidden(tmp_path, monkeypatch):
    def full(fd: int, data: memoryview) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store, "_write_direct", full)
    s = DurableLocalStore(tmp_path)
    with pytest.raises(OSError, match="No space"):
        s._put_durable(tmp_path / "x", PROTO.from_array_like(_payloads()["aligned_200003"]), False)
    assert s.direct_io and not list(tmp_path.iterdir())


def test_dev_shm_writes_the_same_bytes(monkeypatch):
    """tmpfs: O_DIRECT is refused before Linux 6.6 (the fallback) and accepted since: either way
    the same bytes, and the store's flag says which it took."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm")
    import tempfile

    root = Path(tempfile.mkdtemp(dir=shm, prefix="logitcache-test-"))
    try:
        probe = root / "probe"
        try:
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | O_DIRECT, 0o644))
            accepts = True
        except OSError as e:
            assert e.errno == errno.EINVAL
            accepts = False
        s = DurableLocalStore(root)
        for name, data in _payloads().items():
            s._put_durable(root / "c" / name, PROTO.from_array_like(data), False)
            assert (root / "c" / name).read_bytes() == data.tobytes(), name
        assert s.direct_io == accepts
        assert not list(root.rglob("*.partial"))
    finally:
        import shutil

        shutil.rmtree(root)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting ramfs needs root")
def test_ramfs_refuses_o_direct_and_falls_back(tmp_path):
    """A real filesystem without O_DIRECT (ramfs has no direct I/O): EINVAL at open, then the
    buffered write, remembered."""
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "ramfs", "ramfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount ramfs here")
    try:
        s = DurableLocalStore(mnt)
        data = _payloads()["aligned_200003"]
        s._put_durable(mnt / "c" / "x", PROTO.from_array_like(data), False)
        assert (mnt / "c" / "x").read_bytes() == data.tobytes()
        assert not s.direct_io
        assert [p.name for p in (mnt / "c").iterdir()] == ["x"]
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_opt_outs(tmp_path, monkeypatch):
    assert DurableLocalStore(tmp_path / "a").direct_io
    assert not DurableLocalStore(tmp_path / "a", direct_io=False).direct_io
    assert not open_store(tmp_path / "b", read_only=False, direct_io=False).zstore.direct_io
    assert type(open_store(tmp_path / "b", read_only=False, fsync=False).zstore) is (
        zarr.storage.LocalStore
    )
    assert DurableLocalStore(tmp_path / "a", direct_io=True).direct_io
    with CacheWriter.open(tmp_path / "d", make_manifest(), direct_io=False) as w:
        assert not w._store.direct_io


def test_writer_stores_the_same_objects_through_o_direct(tmp_path, monkeypatch):
    """Every object of a cache written with O_DIRECT (all of them: threshold 1 byte) equals the
    buffered writer's, across appends that rewrite partly filled shards; it reads back."""
    from logitcache.cache_format import Layout

    monkeypatch.setattr(store, "DIRECT_IO_MIN", 1)
    layout = Layout(row_chunk=8, row_shard=32, token_chunk=8, token_shard=32)
    recs = make_records(24, seed=5)
    seen = _spy_fsync(monkeypatch)
    for name, direct in (("d", True), ("b", False)):
        with CacheWriter.open(
            tmp_path / name, make_manifest(), layout=layout, direct_io=direct
        ) as w:
            for i in range(0, 24, 5):
                w.append(recs[i : i + 5])
            assert w._store.direct_io == direct
        if direct:
            assert any(d for n, d in seen if n.endswith(".partial"))
    d_objs, b_objs = store_objects(tmp_path / "d"), store_objects(tmp_path / "b")
    assert d_objs.keys() == b_objs.keys()
    for rel, data in d_objs.items():  # the root and key-index commit records hold timestamps
        assert data == b_objs[rel], rel
    r = CacheReader(tmp_path / "d")
    assert r.keys == [x.key for x in recs]
    np.testing.assert_array_equal(r.sequence(23).topk_ids, recs[23].topk_ids)


SUPPORT = str(Path(__file__).resolve().parents[1] / "format_support.py")


@pytest.mark.parametrize("crash_after", [0, 3, 8])
def test_sigkill_inside_an_o_direct_append(tmp_path, crash_after):
    """test_format_crash's SIGKILL inside the third append, with every object written through
    O_DIRECT (threshold 1 byte in the child): the committed prefix reads back, a new writer
    resumes without duplicates or holes."""
    from test_format_crash import check_prefix, expected, resume_and_check

    url = tmp_path / "c"
    child = (
        "import runpy, sys; from logitcache.cache_format import store; store.DIRECT_IO_MIN = 1; "
        f"sys.argv = sys.argv[1:]; sys.path.insert(0, {str(Path(SUPPORT).parent)!r}); "
        f"runpy.run_path({SUPPORT!r}, run_name='__main__')"
    )
    args = [SUPPORT, "append", str(url), json.dumps({}), "30", "5", "7", "2", str(crash_after)]
    proc = subprocess.run(
        [sys.executable, "-c", child, *args], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert proc.stdout.split() == ["COMMITTED", "5", "COMMITTED", "10"]
    recs = expected()
    assert check_prefix(url, recs) == 10
    resume_and_check(url, recs, 10)

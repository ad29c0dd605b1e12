"""Opening a zarr store from a URL (local directory, s3://, gs://, az://, any fsspec URL).

A path or ``file://`` URL opens :class:`zarr.storage.LocalStore` (for writing
:class:`DurableLocalStore`, which also fsyncs, FORMAT.md W5a); ``s3://``, ``gs://``, ``az://``
open :class:`zarr.storage.ObjectStore` over obstore (conditional puts for the writer lock), or
:class:`zarr.storage.FsspecStore` with ``{"backend": "fsspec"}``; anything else FsspecStore.
``storage_options`` are fsspec's names, normalised once by :func:`normalize_storage_options`
(obstore spellings still accepted, with a ``DeprecationWarning``) and translated one way for
obstore; listing goes through the same opened store (:func:`list_children`)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import mmap
import os
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlparse

import zarr.abc.store
import zarr.storage
from zarr.abc.store import ByteRequest

if TYPE_CHECKING:
    from obstore.store import ClientConfig

from ._zarr_adapter import Buffer, sync
from .errors import FormatError

OBJECT_SCHEMES = frozenset({"s3", "s3a", "gs", "gcs", "az", "azure", "abfs", "abfss"})

#: s3fs name -> obstore S3 config name (the one translation, applied by :func:`_obstore_options`).
_S3FS_TO_OBSTORE = {
    "endpoint_url": "endpoint",
    "key": "access_key_id",
    "secret": "secret_access_key",
    "token": "session_token",
}
#: obstore spellings accepted at the edge (deprecated) -> the dialect's name.
_DEPRECATED_NAMES = {v: k for k, v in _S3FS_TO_OBSTORE.items()}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_FSYNC_THREADS = 8
_pool: dict[int, ThreadPoolExecutor] = {}
_pool_lock = threading.Lock()


def _fsync_pool() -> ThreadPoolExecutor:
    """The threads that fsync a barrier's directories concurrently (started once per process:
    a forked child starts its own)."""
    with _pool_lock:
        pid = os.getpid()
        if pid not in _pool:
            _pool.clear()
            _pool[pid] = ThreadPoolExecutor(_FSYNC_THREADS, thread_name_prefix="logitcache-fsync")
        return _pool[pid]


#: Objects of at least this many bytes are written with ``O_DIRECT`` (:class:`DurableLocalStore`).
DIRECT_IO_MIN = 1 << 16
#: Alignment of ``O_DIRECT`` transfers (memory address, file offset, length): a page, a multiple
#: of every logical block size Linux filesystems use.
DIRECT_IO_ALIGN = 4096
#: The page-aligned bounce buffer (one per thread, kept) through which an object whose memory is
#: not page-aligned, and the last partial page of any object, are written.
DIRECT_IO_BUFFER = 4 << 20
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_bounce = threading.local()


def _address(data: memoryview) -> int:
    import numpy as np

    return int(np.frombuffer(data, dtype=np.uint8).ctypes.data)


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data) :]


def _write_direct(fd: int, data: memoryview) -> None:
    """Write ``data`` to ``fd`` (opened with ``O_DIRECT``, at offset 0) and cut the file to its
    size: the page-aligned whole pages of ``data`` straight from its memory, everything else
    (memory not page-aligned, the last partial page) through this thread's bounce buffer, zero
    padded to a page (the padding is truncated away)."""
    n, a = len(data), DIRECT_IO_ALIGN
    pos = 0
    if _address(data) % a == 0:
        pos = n - n % a
        _write_all(fd, data[:pos])
    buf: mmap.mmap | None = getattr(_bounce, "buf", None)
    while pos < n:
        if buf is None:
            buf = _bounce.buf = mmap.mmap(-1, DIRECT_IO_BUFFER)  # page-aligned
        m = min(DIRECT_IO_BUFFER, n - pos)
        padded = -(-m // a) * a
        buf[:m] = data[pos : pos + m]
        buf[m:padded] = bytes(padded - m)
        _write_all(fd, memoryview(buf)[:padded])
        pos += m
    if n % a:
        os.ftruncate(fd, n)


_tag_prefix = uuid.uuid4().hex[:16]
_tag_count = itertools.count()


def _new_tag_prefix() -> None:
    global _tag_prefix
    _tag_prefix = uuid.uuid4().hex[:16]


os.register_at_fork(after_in_child=_new_tag_prefix)


def _temporary_tag() -> str:
    """A name part no other temporary file gets: this process's random prefix (new in a forked
    child) and a counter (one ``getrandom`` per process, not per object write)."""
    return f"{_tag_prefix}{next(_tag_count):x}"


def _write_file(path: Path, data: memoryview, *, fsync: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
    try:
        _write_all(fd, data)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _write_object(
    path: Path, data: memoryview, exclusive: bool, write: Callable[[Path, memoryview], None]
) -> list[Path]:
    """Write object ``path`` as zarr's LocalStore does: ``write(tmp, data)`` into a ``*.partial``
    temporary file, then renamed over ``path`` (a reader sees the old object or the new one,
    never a torn one; ``exclusive``: fail if ``path`` exists). Returns the directories whose
    entries changed."""
    parent = path.parent
    changed = [parent]
    if not os.path.isdir(parent):  # new directories: their parents' entries change too
        missing = parent
        while not missing.exists():
            changed.append(missing.parent)
            missing = missing.parent
        parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{_temporary_tag()}.partial")
    try:
        write(tmp, data)
        if exclusive:  # like zarr: fails if the key exists
            os.link(tmp, path)
            os.unlink(tmp)
        else:
            tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return changed


class DurableLocalStore(zarr.storage.LocalStore):
    """A :class:`zarr.storage.LocalStore` whose object writes survive power loss once
    :meth:`sync_dirs` has returned (FORMAT.md W3-W5).

    Each object is written as LocalStore writes it (a ``*.partial`` file renamed over the key) and
    fsynced before the rename; the directories whose entries changed are fsynced by
    :meth:`sync_dirs`. Objects of :data:`DIRECT_IO_MIN` bytes or more (the shards) are written with
    ``O_DIRECT`` (the same bytes, no copy into the page cache) unless ``direct_io=False`` or the
    filesystem refuses it (tmpfs, some FUSE mounts: then buffered, and :attr:`direct_io` turns
    False)."""

    def __init__(
        self, root: Path | str, *, read_only: bool = False, direct_io: bool | None = None
    ) -> None:
        super().__init__(root, read_only=read_only)
        self._dirty: set[Path] = set()
        self._dirty_lock = threading.Lock()
        # objects of DIRECT_IO_MIN bytes or more written with O_DIRECT wherever the platform has
        # it, unless told not to (False once refused)
        self.direct_io = bool(_O_DIRECT) and direct_io is not False

    def _put_durable(self, path: Path, value: Buffer, exclusive: bool) -> None:
        changed = self._write_durable(path, memoryview(value.as_buffer_like()).cast("B"), exclusive)
        with self._dirty_lock:
            self._dirty.update(changed)

    def _write_durable(self, path: Path, data: memoryview, exclusive: bool) -> list[Path]:
        """Write object ``path`` (temporary file fsynced, then renamed over it); returns the
        directories whose entries changed (not yet fsynced)."""
        return _write_object(path, data, exclusive, self._write_synced)

    def _write_synced(self, tmp: Path, data: memoryview) -> None:
        if not (self.direct_io and len(data) >= DIRECT_IO_MIN and self._put_direct(tmp, data)):
            _write_file(tmp, data, fsync=True)

    def put_many(self, items: Sequence[tuple[str, Any]]) -> None:
        """Write the objects ``items`` (key, bytes-like) durably before returning: each written as
        :meth:`_put_durable` writes it (one round of the store's threads), then every changed
        directory fsynced (one more round), every rename done before the first directory fsync."""
        self._ensure_open_sync()
        self._check_writable()
        objects = [(self.root / key, memoryview(data).cast("B")) for key, data in items]

        def one(obj: tuple[Path, memoryview]) -> list[Path]:
            return self._write_durable(obj[0], obj[1], False)

        if len(objects) == 1:
            changed = one(objects[0])
        else:
            changed = [d for dirs in _fsync_pool().map(one, objects) for d in dirs]
        dirs = list(dict.fromkeys(changed))
        if len(dirs) == 1:
            _fsync_dir(dirs[0])
        elif dirs:
            list(_fsync_pool().map(_fsync_dir, dirs))

    def _put_direct(self, tmp: Path, data: memoryview) -> bool:
        """Write ``data`` to the new file ``tmp`` with ``O_DIRECT`` and fsync it; False (nothing
        left at ``tmp``, :attr:`direct_io` now False) if the filesystem refuses ``O_DIRECT``."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | _O_DIRECT
        try:
            fd = os.open(tmp, flags, 0o666)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self.direct_io = False
            tmp.unlink(missing_ok=True)  # the file may have been created before the refusal
            return False
        try:
            try:
                _write_direct(fd, data)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.direct_io = False  # open took the flag, the filesystem refused the write
                os.close(fd)
                fd = -1
                tmp.unlink()
                return False
            os.fsync(fd)
        finally:
            if fd >= 0:
                os.close(fd)
        return True

    async def _set(self, key: str, value: Buffer, exclusive: bool = False) -> None:
        if not self._is_open:
            await self._open()
        self._check_writable()
        if not isinstance(value, Buffer):
            raise TypeError(f"value must be a zarr Buffer, got {type(value).__name__}")
        await asyncio.to_thread(self._put_durable, self.root / key, value, exclusive)

    def sync_dirs(self) -> None:
        """fsync every directory whose entries changed since the last call."""
        with self._dirty_lock:
            dirty, self._dirty = self._dirty, set()
        dirs = [d for d in dirty if d.exists()]
        if len(dirs) == 1:
            _fsync_dir(dirs[0])
        elif dirs:  # concurrently: the file system commits them together
            list(_fsync_pool().map(_fsync_dir, dirs))


def put_objects(zstore: Any, items: Sequence[tuple[str, Any]]) -> None:
    """Write the objects ``items`` (key, ``bytes`` or a contiguous uint8 array) into ``zstore``
    together: durably through :meth:`DurableLocalStore.put_many`, on the calling thread for a plain
    ``LocalStore`` (:func:`_write_object`), in one gather on zarr's event loop for other stores."""
    if not items:
        return
    if isinstance(zstore, DurableLocalStore):
        zstore.put_many(items)
        return
    if isinstance(zstore, zarr.storage.LocalStore):
        zstore._ensure_open_sync()
        zstore._check_writable()
        plain = partial(_write_file, fsync=False)
        for key, data in items:
            _write_object(zstore.root / key, memoryview(data).cast("B"), False, plain)
        return
    from ._zarr_adapter import default_buffer_prototype

    proto = default_buffer_prototype().buffer

    def buf(d: Any) -> Buffer:
        return proto.from_bytes(d) if isinstance(d, bytes) else proto.from_array_like(d)

    async def put_all() -> None:
        await asyncio.gather(*(zstore.set(k, buf(d)) for k, d in items))

    sync(put_all())


@dataclass
class StoreHandle:
    """An opened zarr store plus what the writer lock needs to know about it."""

    url: str
    zstore: Any  # zarr.abc.store.Store
    kind: str  # "local" | "object" | "fsspec"
    local_path: Path | None = None
    objstore: Any = None  # obstore store, for kind == "object"

    def barrier(self) -> None:
        """Make every object written so far durable: on a :class:`DurableLocalStore` fsync the
        changed directories; elsewhere a no-op."""
        if isinstance(self.zstore, DurableLocalStore):
            self.zstore.sync_dirs()

    def remove_partials(self) -> int:
        """Delete every ``*.partial`` temporary under a local store (:func:`remove_partials`; only
        while holding the writer lock) and return how many; other stores: 0."""
        return 0 if self.local_path is None else remove_partials(self.local_path)


def remove_partials(root: str | Path, older_than_s: float = 0.0) -> int:
    """Delete the ``*.partial`` temporary files under ``root`` (left by a writer killed between
    writing an object and renaming it; never part of a store) last modified more than
    ``older_than_s`` seconds ago, and return how many. A file that vanishes or cannot be removed
    meanwhile is skipped."""
    now, n = time.time(), 0
    for p in Path(root).rglob("*.partial"):
        with contextlib.suppress(OSError):
            if older_than_s > 0 and now - p.stat().st_mtime <= older_than_s:
                continue
            p.unlink()
            n += 1
    return n


def _scheme(url: str) -> str:
    if "://" not in url:
        return ""
    return urlparse(url).scheme.lower()


def _flag(name: str, value: Any) -> bool:
    """A boolean option given as a bool or as ``true``/``false``/``1``/``0`` text
    (``bool("false")`` would be True)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no", ""):
        return False
    raise FormatError(f"storage option {name} must be true or false, got {value!r}")


def normalize_storage_options(url: str, options: dict[str, Any] | None) -> dict[str, Any]:
    """``options`` in the one dialect (module docstring), for ``url``'s scheme; the edge every
    store is opened through. S3: obstore spellings are renamed (``DeprecationWarning``), a
    top-level ``region``/``region_name`` moves to ``client_kwargs["region_name"]``, ``anon`` becomes
    a bool (:class:`FormatError` for anything but true/false text). Other schemes: as given."""
    opts = dict(options or {})
    if _scheme(url) not in ("s3", "s3a"):
        return opts
    for old, new in _DEPRECATED_NAMES.items():
        if old in opts:
            warnings.warn(
                f"storage option {old!r} is obstore's spelling; use {new!r}",
                DeprecationWarning,
                stacklevel=3,
            )
            value = opts.pop(old)
            opts.setdefault(new, value)
    region = opts.pop("region", None) or opts.pop("region_name", None)
    if region:
        opts["client_kwargs"] = {"region_name": region, **(opts.get("client_kwargs") or {})}
    if "anon" in opts:
        opts["anon"] = _flag("anon", opts["anon"])
    return opts


def _obstore_options(
    scheme: str, options: dict[str, Any]
) -> tuple[dict[str, Any], ClientConfig | None]:
    """obstore ``from_url`` config and client options from normalised options (one way)."""
    opts = dict(options)
    client_options: dict[str, Any] = dict(opts.pop("client_options", {}) or {})
    client_kwargs = opts.pop("client_kwargs", {}) or {}
    for src, dst in (("endpoint_url", "endpoint_url"), ("region_name", "region")):
        if src in client_kwargs:
            opts.setdefault(dst, client_kwargs[src])
    config: dict[str, Any] = {}
    anon = _flag("anon", opts.pop("anon", False))
    for name, value in opts.items():
        if value is None:
            continue
        config[_S3FS_TO_OBSTORE.get(name, name) if scheme in ("s3", "s3a") else name] = value
    if anon:
        config["skip_signature"] = True
    endpoint = str(config.get("endpoint", ""))
    if endpoint:
        config.setdefault("virtual_hosted_style_request", False)
        if endpoint.startswith("http://"):
            client_options.setdefault("allow_http", True)
    # obstore checks the keys of its ClientConfig itself (a typed error on an unknown one)
    return config, cast("ClientConfig", client_options) if client_options else None


def list_children(zstore: Any) -> list[str]:
    """Names of the entries directly under an opened store's root (through the store itself:
    the same client, options and credentials as its reads). Never from a stale listing: an
    fsspec store's listing cache is dropped first."""
    fs = getattr(zstore, "fs", None)
    if fs is not None and hasattr(fs, "invalidate_cache"):
        fs.invalidate_cache()

    async def names() -> list[str]:
        return [n.rstrip("/") async for n in zstore.list_dir("")]

    return sorted(sync(names()))


def get_object(zstore: Any, key: str, byte_range: ByteRequest | None = None) -> bytes | None:
    """Object ``key`` of an opened store (``byte_range``: a part of it), ``None`` if absent."""
    from ._zarr_adapter import default_buffer_prototype

    buf = sync(zstore.get(key, prototype=default_buffer_prototype(), byte_range=byte_range))
    return None if buf is None else buf.to_bytes()


def object_size(zstore: Any, key: str) -> int:
    """Size in bytes of object ``key`` of an opened store (``FileNotFoundError`` if absent)."""
    return int(sync(zstore.getsize(key)))


def object_exists(zstore: Any, key: str) -> bool:
    """Whether an opened store holds object ``key``."""
    return bool(sync(zstore.exists(key)))


def delete_prefix(zstore: Any, prefix: str = "") -> None:
    """Delete every object of an opened store under ``prefix`` (``""``: the whole store)."""
    sync(zstore.delete_dir(prefix))


def open_store(
    url: str | Path,
    storage_options: dict[str, Any] | None = None,
    *,
    read_only: bool,
    fsync: bool = True,
    direct_io: bool | None = None,
) -> StoreHandle:
    """Open the zarr store behind ``url`` (see module docstring for the URL forms). ``fsync=False``:
    a local store without fsync (atomic per object, not durable against power loss);
    ``direct_io``: see :class:`DurableLocalStore`."""
    url = str(url)
    options = normalize_storage_options(url, storage_options)
    backend = options.pop("backend", None)
    scheme = _scheme(url)
    if scheme in ("", "file"):
        path = Path(urlparse(url).path if scheme == "file" else url).expanduser().absolute()
        if not read_only:
            path.mkdir(parents=True, exist_ok=True)
        local: zarr.abc.store.Store
        if fsync and not read_only:
            local = DurableLocalStore(path, direct_io=direct_io)
        else:
            local = zarr.storage.LocalStore(path, read_only=read_only)
        return StoreHandle(url=url, zstore=local, kind="local", local_path=path)
    if scheme in OBJECT_SCHEMES and backend in (None, "obstore"):
        from obstore.store import from_url

        config, client_options = _obstore_options(scheme, options)
        try:
            obj = from_url(url, client_options=client_options, **config)
        except Exception as e:  # obstore raises its own config errors
            raise FormatError(f"cannot open object store {url!r}: {e}") from e
        ostore = zarr.storage.ObjectStore(obj, read_only=read_only)
        return StoreHandle(url=url, zstore=ostore, kind="object", objstore=obj)
    if backend not in (None, "fsspec"):
        raise FormatError(f"unknown storage backend {backend!r} (use 'obstore' or 'fsspec')")
    zstore = zarr.storage.FsspecStore.from_url(url, storage_options=options, read_only=read_only)
    objstore: Any = None
    if scheme in OBJECT_SCHEMES and not read_only:  # data via s3fs, writer lease via obstore
        from obstore.store import from_url

        config, client_options = _obstore_options(scheme, options)
        objstore = from_url(url, client_options=client_options, **config)
    kind = "object" if objstore is not None else "fsspec"
    return StoreHandle(url=url, zstore=zstore, kind=kind, objstore=objstore)

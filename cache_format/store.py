"""Opening a zarr store from a URL (local directory, s3://, gs://, az://, any fsspec URL).

- A path or ``file://`` URL: :class:`zarr.storage.LocalStore` (atomic per-object writes); for
  writing :class:`DurableLocalStore`, which also fsyncs (FORMAT.md W5a).
- ``s3://``, ``gs://``, ``az://``/``abfs://``: :class:`zarr.storage.ObjectStore` over obstore
  (conditional puts give a safe writer lock). ``storage_options`` accepts s3fs-style names
  (``endpoint_url``, ``key``, ``secret``, ``token``, ``region``, ``anon``, ``client_kwargs``)
  and obstore config names; ``{"backend": "fsspec"}`` picks :class:`zarr.storage.FsspecStore`.
- Anything else: :class:`zarr.storage.FsspecStore` (``storage_options`` go to fsspec as given).
"""

from __future__ import annotations

import asyncio
import os
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import zarr.storage
from zarr.core.buffer import Buffer

from .errors import FormatError

OBJECT_SCHEMES = frozenset({"s3", "s3a", "gs", "gcs", "az", "azure", "abfs", "abfss"})

_S3FS_TO_OBSTORE = {
    "endpoint_url": "endpoint",
    "key": "access_key_id",
    "secret": "secret_access_key",
    "token": "session_token",
    "region": "region",
    "region_name": "region",
}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DurableLocalStore(zarr.storage.LocalStore):
    """A :class:`zarr.storage.LocalStore` whose object writes survive power loss once
    :meth:`sync_dirs` has returned.

    Each object is written as zarr's LocalStore writes it (a ``*.partial`` temporary file renamed
    over the key, so a reader sees the old or the new object, never a torn one) and its bytes are
    fsynced before the rename. The rename itself (a directory entry) becomes durable when the
    directory is fsynced: the store remembers every directory whose entries it changed and
    :meth:`sync_dirs` fsyncs each once. The writer calls it after the data of an append and again
    after the commit (FORMAT.md W3-W5).
    """

    def __init__(self, root: Path | str, *, read_only: bool = False) -> None:
        super().__init__(root, read_only=read_only)
        self._dirty: set[Path] = set()
        self._dirty_lock = threading.Lock()

    def _put_durable(self, path: Path, value: Buffer, exclusive: bool) -> None:
        changed = [path.parent]
        missing = path.parent
        while not missing.exists():  # new directories: their parents' entries change too
            changed.append(missing.parent)
            missing = missing.parent
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{uuid.uuid4().hex}.partial")
        try:
            with tmp.open("wb") as f:
                f.write(value.as_buffer_like())
                f.flush()
                os.fsync(f.fileno())
            if exclusive:  # like zarr: fails if the key exists
                os.link(tmp, path)
                os.unlink(tmp)
            else:
                tmp.replace(path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        with self._dirty_lock:
            self._dirty.update(changed)

    async def _set(self, key: str, value: Buffer, exclusive: bool = False) -> None:
        if not self._is_open:
            await self._open()
        self._check_writable()
        if not isinstance(value, Buffer):
            raise TypeError(f"value must be a zarr Buffer, got {type(value).__name__}")
        await asyncio.to_thread(self._put_durable, self.root / key, value, exclusive)

    def set_sync(self, key: str, value: Buffer) -> None:
        self._ensure_open_sync()
        self._check_writable()
        if not isinstance(value, Buffer):
            raise TypeError(f"value must be a zarr Buffer, got {type(value).__name__}")
        self._put_durable(self.root / key, value, False)

    def sync_dirs(self) -> None:
        """fsync every directory whose entries changed since the last call."""
        with self._dirty_lock:
            dirty, self._dirty = self._dirty, set()
        for d in sorted(dirty, key=lambda p: len(p.parts), reverse=True):  # leaves first
            if d.exists():
                _fsync_dir(d)


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
        changed directories (object bytes are fsynced as written); elsewhere a no-op (a
        completed PUT is the object store's to keep)."""
        if isinstance(self.zstore, DurableLocalStore):
            self.zstore.sync_dirs()


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


def _obstore_options(scheme: str, options: dict[str, Any]) -> tuple[dict[str, Any], dict]:
    """Translate s3fs-style options into obstore ``from_url`` kwargs and client options."""
    opts = dict(options)
    client_options: dict[str, Any] = dict(opts.pop("client_options", {}) or {})
    client_kwargs = opts.pop("client_kwargs", {}) or {}
    for src in ("endpoint_url", "region_name"):
        if src in client_kwargs:
            opts.setdefault(src, client_kwargs[src])
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
    return config, client_options


_OBSTORE_TO_S3FS = {
    "endpoint": "endpoint_url",
    "access_key_id": "key",
    "secret_access_key": "secret",
    "session_token": "token",
}


def _fsspec_options(scheme: str, options: dict[str, Any]) -> dict[str, Any]:
    """s3fs wants the region inside ``client_kwargs``; accept obstore names too."""
    if scheme not in ("s3", "s3a"):
        return options
    opts = {_OBSTORE_TO_S3FS.get(n, n): v for n, v in options.items()}
    region = opts.pop("region", None) or opts.pop("region_name", None)
    if region:
        opts["client_kwargs"] = {**opts.get("client_kwargs", {}), "region_name": region}
    return opts


def fsspec_storage_options(url: str, options: dict[str, Any] | None) -> dict[str, Any]:
    """The ``storage_options`` of this library (s3fs or obstore names) as fsspec expects them."""
    return _fsspec_options(_scheme(url), dict(options or {}))


def open_store(
    url: str | Path,
    storage_options: dict[str, Any] | None = None,
    *,
    read_only: bool,
    fsync: bool = True,
) -> StoreHandle:
    """Open the zarr store behind ``url`` (see module docstring for the URL forms).

    ``fsync=False`` writes a local store without fsync (zarr's plain LocalStore: faster, not
    durable against power loss; still atomic per object).
    """
    url = str(url)
    options = dict(storage_options or {})
    backend = options.pop("backend", None)
    scheme = _scheme(url)
    if scheme in ("", "file"):
        path = Path(urlparse(url).path if scheme == "file" else url).expanduser().absolute()
        if not read_only:
            path.mkdir(parents=True, exist_ok=True)
        cls = DurableLocalStore if fsync and not read_only else zarr.storage.LocalStore
        zstore = cls(path, read_only=read_only)
        return StoreHandle(url=url, zstore=zstore, kind="local", local_path=path)
    if scheme in OBJECT_SCHEMES and backend in (None, "obstore"):
        from obstore.store import from_url

        config, client_options = _obstore_options(scheme, options)
        try:
            objstore = from_url(url, client_options=client_options or None, **config)
        except Exception as e:  # obstore raises its own config errors
            raise FormatError(f"cannot open object store {url!r}: {e}") from e
        zstore = zarr.storage.ObjectStore(objstore, read_only=read_only)
        return StoreHandle(url=url, zstore=zstore, kind="object", objstore=objstore)
    if backend not in (None, "fsspec"):
        raise FormatError(f"unknown storage backend {backend!r} (use 'obstore' or 'fsspec')")
    zstore = zarr.storage.FsspecStore.from_url(
        url, storage_options=_fsspec_options(scheme, options), read_only=read_only
    )
    objstore = None
    if scheme in OBJECT_SCHEMES and not read_only:  # data via s3fs, writer lease via obstore
        from obstore.store import from_url

        config, client_options = _obstore_options(scheme, options)
        objstore = from_url(url, client_options=client_options or None, **config)
    kind = "object" if objstore is not None else "fsspec"
    return StoreHandle(url=url, zstore=zstore, kind=kind, objstore=objstore)

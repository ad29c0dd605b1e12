"""Writer lock: one append transaction at a time per store (FORMAT.md rule W5).

- Local directory: ``fcntl.flock`` on ``<root>/.logitcache.lock`` (dropped by the kernel when the
  holder dies; the holder deletes the file before unlocking, and a contender that locked a
  deleted file retries on the new one).
- Object store: a lease object ``<prefix>/.logitcache.lock`` created with ``If-None-Match: *``,
  renewed every ``ttl/3`` with ``If-Match: <etag>``; an expired lease is taken over with
  ``If-Match`` on its etag, so one contender wins. A holder paused longer than ``ttl`` could
  overlap the next one (the caveat of every lease).
- Other fsspec stores: an in-process lock only."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from typing import Any, Protocol

from .errors import WriterLockedError
from .spec import LOCK_NAME
from .store import StoreHandle

_POLL_S = 0.05


class WriterLock(Protocol):
    def acquire(self, timeout: float) -> None: ...
    def release(self) -> None: ...
    def check(self) -> None: ...


class LocalLock:
    """``flock``-based exclusive lock on a file in the store directory."""

    def __init__(self, path: os.PathLike[str] | str):
        self.path = os.fspath(path)
        self._fd: int | None = None

    def acquire(self, timeout: float) -> None:
        import fcntl

        deadline = time.monotonic() + timeout
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise WriterLockedError(
                        f"store {self.path!r} is locked by another writer (waited {timeout} s)"
                    ) from None
                time.sleep(_POLL_S)
                continue
            if self._same_file(fd):
                self._fd = fd
                return
            os.close(fd)  # the holder deleted it on release: lock the current file instead
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)

    def _same_file(self, fd: int) -> bool:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)

    def release(self) -> None:
        import fcntl

        if self._fd is not None:
            try:
                os.unlink(self.path)  # still holding the lock: nobody else owns this file
            except FileNotFoundError:
                pass
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def check(self) -> None:
        if self._fd is None:
            raise WriterLockedError("writer lock not held")


class ObjectLock:
    """Lease lock on an object store via conditional puts (see module docstring)."""

    def __init__(self, objstore: Any, key: str = LOCK_NAME, ttl: float = 60.0) -> None:
        self.objstore = objstore
        self.key = key
        self.ttl = float(ttl)
        self.owner = f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
        self._etag: str | None = None
        self._lost = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._mu = threading.Lock()

    def _payload(self) -> bytes:
        return json.dumps({"owner": self.owner, "expires": time.time() + self.ttl}).encode()

    def _try_take(self) -> bool:
        import obstore
        from obstore.exceptions import AlreadyExistsError, NotFoundError, PreconditionError

        try:
            res = obstore.put(self.objstore, self.key, self._payload(), mode="create")
            self._etag = res["e_tag"]
            return True
        except (AlreadyExistsError, PreconditionError):
            pass
        try:
            got = obstore.get(self.objstore, self.key)
            etag = got.meta["e_tag"]
            data = json.loads(bytes(got.bytes()))
        except (NotFoundError, FileNotFoundError):
            return False  # released meanwhile; retry create
        except (ValueError, KeyError):
            data, etag = {"expires": 0}, None
        if float(data.get("expires", 0)) > time.time() or etag is None:
            return False
        try:
            res = obstore.put(self.objstore, self.key, self._payload(), mode={"e_tag": etag})
            self._etag = res["e_tag"]
            return True
        except (PreconditionError, AlreadyExistsError, NotFoundError, FileNotFoundError):
            return False

    def acquire(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self._try_take():
            if time.monotonic() >= deadline:
                raise WriterLockedError(
                    f"object-store lock {self.key!r} held by another writer (waited {timeout} s)"
                )
            time.sleep(_POLL_S * 2)
        self._lost = False
        self._stop.clear()
        self._thread = threading.Thread(target=self._heartbeat, daemon=True)
        self._thread.start()

    def _heartbeat(self) -> None:
        import obstore

        while not self._stop.wait(self.ttl / 3):
            with self._mu:
                if self._etag is None:
                    return
                try:
                    res = obstore.put(
                        self.objstore, self.key, self._payload(), mode={"e_tag": self._etag}
                    )
                    self._etag = res["e_tag"]
                except Exception:
                    self._lost = True
                    return

    def check(self) -> None:
        """Raise if the lease was lost (renewal failed): the caller must not commit."""
        if self._etag is None or self._lost:
            raise WriterLockedError(f"lost the object-store lock {self.key!r}")

    def release(self) -> None:
        import obstore

        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._mu:
            if self._etag is None:
                return
            try:
                meta = obstore.head(self.objstore, self.key)
                if meta["e_tag"] == self._etag and not self._lost:
                    obstore.delete(self.objstore, self.key)
            except Exception:
                pass  # already gone or taken over; nothing of ours to release
            self._etag = None


class ProcessLock:
    """In-process lock for stores without a cross-process primitive (generic fsspec)."""

    _locks: dict[str, threading.Lock] = {}

    def __init__(self, url: str):
        self.url = url
        self._lock = self._locks.setdefault(url, threading.Lock())
        self._held = False

    def acquire(self, timeout: float) -> None:
        if not self._lock.acquire(timeout=timeout):
            raise WriterLockedError(f"store {self.url!r} is locked (waited {timeout} s)")
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._lock.release()

    def check(self) -> None:
        if not self._held:
            raise WriterLockedError("writer lock not held")


def make_lock(handle: StoreHandle, ttl: float = 60.0) -> WriterLock:
    """The lock implementation for a store kind."""
    if handle.kind == "local" and handle.local_path is not None:
        return LocalLock(handle.local_path / LOCK_NAME)
    if handle.kind == "object":
        return ObjectLock(handle.objstore, LOCK_NAME, ttl=ttl)
    return ProcessLock(handle.url)

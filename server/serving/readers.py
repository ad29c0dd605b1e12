"""The readers a :class:`~.caches.CacheRegistry` keeps, one per cache, and when a read-through
lookup may use one without a refresh: the registry's writers report this process's commits
(:meth:`KeptReaders.committed`), so a lookup refreshes only when a commit since its reader's
generation may hold an asked key or came from another process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from logitcache.cache_format import CacheReader
from logitcache.cache_format.errors import StoreNotFoundError
from logitcache.cache_format.layout import read_root_attrs
from logitcache.cache_format.spec import ROOT_ATTR

from ..errors import NotFoundError

#: Keys of this process's commits remembered per cache (the oldest commits are forgotten past
#: it; a lookup across a forgotten commit refreshes its reader).
KEEP_COMMITTED_KEYS = 1 << 16


@dataclass
class _Kept:
    reader: CacheReader | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    # this process's commits the reader may not hold yet: generation -> the keys it committed
    # (under KeptReaders._lock)
    own: dict[int, frozenset[str]] = field(default_factory=dict)
    own_keys: int = 0

    def forget_own(self, upto: int) -> None:
        """Forget the commits up to generation ``upto`` (the reader holds them)."""
        for g in [g for g in self.own if g <= upto]:
            self.own_keys -= len(self.own.pop(g))


class KeptReaders:
    """One reader per cache name, opened on first use; thread-safe. ``url(name)``: the cache's
    store URL (checked); ``store(name)``: its read-only zarr store (for its root)."""

    def __init__(
        self,
        url: Callable[[str], str],
        store: Callable[[str], Any],
        storage_options: dict[str, Any] | None,
    ) -> None:
        self._url, self._store, self._options = url, store, storage_options
        self._lock = threading.Lock()
        self._kept: dict[str, _Kept] = {}

    def reader(self, name: str) -> CacheReader:
        """The reader of ``name`` at its latest commit (refreshed, incrementally, on each call);
        :class:`NotFoundError` if there is no cache."""
        url = self._url(name)
        with self._lock:
            entry = self._kept.setdefault(name, _Kept())
        try:
            with entry.lock:
                if entry.reader is None:
                    entry.reader = CacheReader(url, storage_options=self._options)
                else:
                    entry.reader.refresh()
                with self._lock:
                    entry.forget_own(entry.reader.manifest.generation)
                return entry.reader
        except (StoreNotFoundError, FileNotFoundError) as e:
            with self._lock:
                self._kept.pop(name, None)
            raise NotFoundError(f"no cache named {name!r}") from e

    def lookup_reader(self, name: str, keys: Collection[str]) -> CacheReader:
        """A reader of ``name`` holding every one of ``keys`` committed before this call (the kept
        one unless a commit since may hold one); :class:`NotFoundError` if there is no cache."""
        with self._lock:
            entry = self._kept.get(name)
        if entry is not None:
            with entry.lock:
                got = entry.reader
                if got is not None and self._holds(name, entry, got.manifest.generation, keys):
                    return got
        return self.reader(name)

    def _holds(self, name: str, entry: _Kept, have: int, keys: Collection[str]) -> bool:
        """Whether a reader at generation ``have`` holds every committed one of ``keys``;
        ``False`` also when the root cannot be read (the refresh then reports it)."""
        try:
            disk = (read_root_attrs(self._store(name)) or {})[ROOT_ATTR]["generation"]
        except Exception:  # noqa: BLE001 - the refresh that follows raises what it finds
            return False
        if disk == have:
            return True
        if not isinstance(disk, int) or disk < have:
            return False
        with self._lock:
            if disk - have > len(entry.own):
                return False
            since = [entry.own.get(g) for g in range(have + 1, disk + 1)]
        return all(got is not None and got.isdisjoint(keys) for got in since)

    def committed(self, name: str, generation: int, keys: frozenset[str]) -> None:
        """This process committed ``keys`` into ``name`` at ``generation`` (called before the
        append returns; at most :data:`KEEP_COMMITTED_KEYS` keys kept, oldest forgotten first)."""
        with self._lock:
            entry = self._kept.setdefault(name, _Kept())
            entry.own[generation] = keys
            entry.own_keys += len(keys)
            while entry.own_keys > KEEP_COMMITTED_KEYS:
                entry.forget_own(min(entry.own))

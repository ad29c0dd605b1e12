"""Named caches under the server's store root, and the one writer per cache this process holds.

A name (:data:`NAME_PATTERN`) maps to ``<store_root>/<name>`` and cannot leave the root. Before
anything is written the engine's expected manifest is compared with an existing cache's; any
difference is a 409 :class:`~logitcache.server.errors.ConflictError`. A resumed cache keeps its
own storage dtypes.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from logitcache.cache_format import (
    CacheReader,
    CacheWriter,
    Manifest,
    SequenceBatch,
    SequenceRecord,
    object_exists,
)
from logitcache.cache_format.errors import FormatError, ManifestError, StoreNotFoundError
from logitcache.cache_format.identity import TEACHER_FIELDS, teacher_diff, teacher_extra
from logitcache.cache_format.layout import INCOMPLETE_ATTR, parse_root, read_root_attrs
from logitcache.cache_format.spec import LOCK_NAME, ROOT_ATTR, layout_named

from .. import paths
from ..engine.identity import teacher_identity
from ..errors import (
    CacheBrokenError,
    CacheIncompleteError,
    ConflictError,
    InvalidCacheNameError,
    NotACacheError,
    ServiceError,
    StoreNotWritableError,
    format_error_status,
    public_message,
)
from .readers import KeptReaders

if TYPE_CHECKING:
    from ..engine import EngineInfo

log = logging.getLogger(__name__)

#: Allowed cache names.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_name(name: str) -> str:
    """``name`` if it is one safe segment under the store root, else
    :class:`InvalidCacheNameError`."""
    try:
        paths.one_segment(name, NAME_PATTERN, "cache name")
        ok = ".." not in name
    except paths.UnsafePathError:
        ok = False
    if not ok:
        raise InvalidCacheNameError(
            f"invalid cache name {name!r}: use 1-128 of [A-Za-z0-9._-], starting with a letter or "
            "digit, without '..'"
        )
    return name


#: ``errno`` values of a store that refuses writes.
_NOT_WRITABLE = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})


@contextmanager
def not_writable_as_409(name: str) -> Iterator[None]:
    """A write the store refuses becomes :class:`StoreNotWritableError` (409), not a 500."""
    try:
        yield
    except OSError as e:
        if e.errno not in _NOT_WRITABLE:
            raise
        raise StoreNotWritableError(
            f"cache {name!r} cannot be written: the store refuses writes ({os.strerror(e.errno)})"
        ) from None


def is_url(root: str) -> bool:
    """Whether ``root`` is a URL (``scheme://...``) rather than a local path."""
    return "://" in root


#: Seconds a cache's writer stays open after its last user, for the next job to reuse.
WRITER_IDLE_S = 120.0
#: Idle writers kept open at most (least recently used closed first; ~20 MB each at k=100).
KEEP_IDLE_WRITERS = 4


@dataclass
class _OpenWriter:
    writer: CacheWriter
    manifest: Manifest
    users: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    idle_since: float | None = None  # monotonic time its last user left; None while in use
    timer: threading.Timer | None = None  # closes it once idle for the registry's idle_s


class WriterHandle:
    """A shared, serialised view of one cache's writer; ``on_commit(generation, keys)`` runs
    after each commit."""

    def __init__(
        self, name: str, entry: _OpenWriter, on_commit: Callable[[int, frozenset[str]], None]
    ):
        self.name = name
        self._entry = entry
        self._on_commit = on_commit

    def _committed(self, added: int, records: Iterable[SequenceRecord | SequenceBatch]) -> None:
        """Report a commit's keys (of records and of :class:`SequenceBatch` parts)."""
        if added > 0:
            keys: set[str] = set()
            for r in records:
                if isinstance(r, SequenceBatch):
                    keys.update(r.key_list())
                elif r.key is not None:
                    keys.add(str(r.key))
            self._on_commit(self._entry.writer.manifest.generation, frozenset(keys))

    @property
    def manifest(self) -> Manifest:
        return self._entry.manifest

    def append(self, records: Sequence[SequenceRecord]) -> int:
        """Append (and commit) records; keys already present are skipped. Returns new count."""
        records = list(records)
        with self._entry.lock, not_writable_as_409(self.name):
            added = self._entry.writer.append(records)
            self._committed(added, records)
            return added

    def append_parts(self, parts: Sequence[Sequence[SequenceRecord]]) -> list[int]:
        """One append (one commit) of every part's records; returns each part's new records (a
        key counts for its first part; keys another process committed meanwhile are taken off
        the last parts)."""
        with self._entry.lock, not_writable_as_409(self.name):
            w = self._entry.writer
            keys = list(dict.fromkeys(r.key for part in parts for r in part))
            seen = set(keys) - set(w.missing(keys))
            counts: list[int] = []
            for part in parts:
                fresh = {r.key for r in part if r.key not in seen}
                seen |= fresh
                counts.append(len(fresh))
            records = [r for part in parts for r in part]
            added = w.append(records)
            self._committed(added, records)
            short = sum(counts) - added
        for i in reversed(range(len(counts))):
            cut = min(short, counts[i])
            counts[i] -= cut
            short -= cut
        return counts

    def contains(self, key: str) -> bool:
        """Whether ``key`` is committed (an append in progress is not waited for)."""
        return self._entry.writer.contains(key)

    def missing(self, keys: Sequence[str]) -> list[str]:
        """The keys of ``keys`` not yet committed, in order."""
        return self._entry.writer.missing(keys)


#: Why a store left by a crash during its creation is not usable (:func:`incomplete_reason`).
NO_ROOT = (
    "creation was interrupted before its root zarr.json was written; no sequence was "
    "committed. Writing to it again (a job, or a score request naming this cache) completes it"
)
ROOT_MARKED = (
    "creation was interrupted while its arrays were created (root zarr.json marked "
    f"{INCOMPLETE_ATTR!r}, no manifest); no sequence was committed. Writing to it again "
    "(a job, or a score request naming this cache) completes it"
)


class CacheRegistry:
    """Resolves cache names to store URLs, lists caches, and shares one writer per cache
    (thread-safe; appends to one cache are serialised by its own lock)."""

    def __init__(
        self,
        root: str,
        storage_options: dict[str, Any] | None = None,
        *,
        idle_s: float = WRITER_IDLE_S,
        keep_idle: int = KEEP_IDLE_WRITERS,
    ):
        """``idle_s``/``keep_idle``: how long and how many writers stay open after their last
        user (``0``: closed at once)."""
        if not is_url(root):
            root = str(Path(root).expanduser().resolve())
            Path(root).mkdir(parents=True, exist_ok=True)
        self.root = root.rstrip("/")
        self.storage_options = dict(storage_options or {}) or None
        self._lock = threading.Lock()
        self._writers: dict[str, _OpenWriter] = {}
        self.idle_s = idle_s
        self.keep_idle = keep_idle
        self._closed = False
        self._readers = KeptReaders(self.url, self.store, self.storage_options)
        self._stores: dict[str, Any] = {}

    # --- naming / discovery ---------------------------------------------------------------

    def url(self, name: str) -> str:
        """The store URL (or local path) of cache ``name``; a linked local folder must resolve
        inside the root."""
        check_name(name)
        url = f"{self.root}/{name}"
        if not is_url(self.root) and os.path.islink(url):
            paths.resolve_under(Path(self.root), name, "cache folder")
        return url

    def names(self) -> list[str]:
        """Names of the caches (entries with a root ``zarr.json``) under the root, sorted."""
        from logitcache.cache_format.store import list_children

        root = self._root_store()
        out = []
        for name in list_children(root):
            if NAME_PATTERN.fullmatch(name) and object_exists(root, f"{name}/zarr.json"):
                out.append(name)
        return out

    def _root_store(self) -> Any:
        """The read-only store of the root (opened once)."""
        return self._open_store("", self.root)  # "" is no cache name

    def reader(self, name: str) -> CacheReader:
        """A reader of cache ``name`` at its latest commit (kept per cache, refreshed
        incrementally); :class:`NotFoundError` if none."""
        return self._readers.reader(name)

    def lookup_reader(self, name: str, keys: Collection[str]) -> CacheReader:
        """A reader of cache ``name`` holding every one of ``keys`` committed before this call
        (refreshed only if a commit since may hold one); :class:`NotFoundError` if none."""
        return self._readers.lookup_reader(name, keys)

    def incomplete_reason(self, name: str) -> str | None:
        """Why ``name`` is a store whose creation was interrupted (a non-empty local folder
        without a root ``zarr.json``, or a root marked incomplete without a manifest), or None.
        Neither holds committed data; the writer's next ``open`` re-creates it."""
        if not is_url(self.root):
            d = Path(self.root) / name
            try:
                if not d.is_dir():
                    return None
                if _holds_chunks(d):  # committed rows without a usable root: needs repair
                    return None
                if not (d / "zarr.json").exists():
                    return NO_ROOT if any(d.iterdir()) else None
            except OSError:
                return None
        try:
            attrs = read_root_attrs(self.store(name))
        except Exception:  # noqa: BLE001 - unreadable: broken, not incomplete
            return None
        if attrs is not None and ROOT_ATTR not in attrs and attrs.get(INCOMPLETE_ATTR):
            return ROOT_MARKED
        return None

    def open_reader(self, name: str) -> CacheReader:
        """The reader of ``name``: 404 if absent, 409 ``cache_incomplete`` / ``cache_broken`` if its
        store cannot be used."""
        try:
            return self.reader(name)
        except Exception as e:  # noqa: BLE001 - any failure to open is reported, not a 500
            reason = self.incomplete_reason(name)
            if reason is not None:
                raise CacheIncompleteError(f"cache {name!r} is incomplete: {reason}") from None
            if isinstance(e, ServiceError):
                raise
            raise broken(name, e) from None

    def incomplete(self) -> dict[str, str]:
        """Every store under a local root whose creation was interrupted, with the reason."""
        if is_url(self.root):
            return {}
        try:
            folders = sorted(p.name for p in Path(self.root).iterdir() if p.is_dir())
        except OSError:
            return {}
        out = {}
        for name in folders:
            if NAME_PATTERN.fullmatch(name) and ".." not in name:
                reason = self.incomplete_reason(name)
                if reason is not None:
                    out[name] = reason
        return out

    def store(self, name: str) -> Any:
        """The read-only zarr store of cache ``name`` (opened once; raw object reads)."""
        return self._open_store(name, self.url(name))

    def _open_store(self, name: str, url: str) -> Any:
        with self._lock:
            if name not in self._stores:
                from logitcache.cache_format.store import open_store

                self._stores[name] = open_store(url, self.storage_options, read_only=True).zstore
            return self._stores[name]

    def manifest(self, name: str) -> Manifest | None:
        """The committed manifest of cache ``name`` (read from the root ``zarr.json`` alone), or
        ``None`` if there is none yet; a root that cannot be read raises."""
        try:
            attrs = read_root_attrs(self.store(name))
        except (StoreNotFoundError, FileNotFoundError):
            return None
        if attrs is None:
            return None
        if ROOT_ATTR not in attrs and not attrs.get(INCOMPLETE_ATTR):
            raise NotACacheError(f"{name!r} holds a zarr group that is not a logitcache cache")
        try:
            return parse_root(attrs)
        except (StoreNotFoundError, ManifestError):  # not committed yet, or no manifest to read
            return None

    def check_writable(self, name: str) -> None:
        """:class:`StoreNotWritableError` (409) if a local store refuses writes to cache
        ``name`` (its folder, or the root for a new cache), before any engine work."""
        if is_url(self.root):
            return
        folder = Path(self.url(name))
        if not os.access(folder if folder.exists() else self.root, os.W_OK):
            raise StoreNotWritableError(
                f"cache {name!r} cannot be written: the store is read-only or not writable"
            )

    # --- identity checks ------------------------------------------------------------------

    def target_manifest(
        self, name: str, expected: Manifest, *, k: int | None, stored: Manifest | None
    ) -> Manifest:
        """The manifest a writer of ``name`` must use: ``expected`` for a new cache, else the
        ``stored`` one once every teacher field, ``k`` (when given) and the target kind agree
        (:class:`ConflictError` listing the differences)."""
        if stored is None:
            return expected
        diff: dict[str, Any] = {
            f: {"cache": have, "server": want}
            for f, (have, want) in teacher_diff(
                teacher_identity(stored), teacher_identity(expected)
            ).items()
        }
        if k is not None and k != stored.k:
            diff["k"] = {"cache": stored.k, "request": k}
        for f in ("targets", "sampling", "hidden"):  # one cache, one kind of rows (FORMAT.md 4.4)
            if getattr(stored, f) != getattr(expected, f):
                diff[f] = {"cache": getattr(stored, f), "request": getattr(expected, f)}
        if diff:
            raise ConflictError(
                f"cache {name!r} was made with another teacher configuration: "
                + ", ".join(sorted(diff)),
                detail=diff,
            )
        return stored

    # --- shared writers -------------------------------------------------------------------

    @contextmanager
    def writer(
        self, name: str, manifest: Manifest, layout: str | None = None, head: Any = None
    ) -> Iterator[WriterHandle]:
        """Use the process's writer of cache ``name``: opened on first use, shared by concurrent
        users, kept open ``idle_s`` after the last leaves, and caught up with other processes'
        commits when taken up again. ``layout``: the preset of a cache created here; ``head``:
        the teacher head of a hidden cache."""
        with self._lock:
            entry = self._take(name, manifest, layout, head)
        try:
            yield WriterHandle(name, entry, partial(self._readers.committed, name))
        finally:
            self._release(name, entry)

    def _take(self, name: str, manifest: Manifest, layout: str | None, head: Any) -> _OpenWriter:
        """The entry of ``name``'s writer with one more user (under ``self._lock``)."""
        entry = self._writers.get(name)
        if entry is not None and entry.users == 0 and not self._revive(entry, manifest):
            self._drop(name, entry)
            entry = None
        if entry is None:
            with not_writable_as_409(name):
                w = CacheWriter.open(
                    self.url(name),
                    manifest,
                    storage_options=self.storage_options,
                    layout=None if layout is None else layout_named(layout),
                    head=head,
                )
            entry = _OpenWriter(writer=w, manifest=manifest)
            self._writers[name] = entry
        elif entry.manifest.identity() != manifest.identity():
            raise ConflictError(f"cache {name!r} is open with another manifest")
        entry.users += 1
        return entry

    @staticmethod
    def _revive(entry: _OpenWriter, manifest: Manifest) -> bool:
        """Ready an idle entry for a new first user (timer stopped, writer caught up);
        ``False``: open a new writer instead."""
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None
        if entry.manifest.identity() != manifest.identity():
            return False
        try:
            with entry.lock:
                fresh = entry.writer.refresh()
        except Exception:  # noqa: BLE001 - the fresh open below raises it if it persists
            log.warning("a kept writer could not catch up; opening a new one", exc_info=True)
            return False
        if fresh:
            entry.manifest, entry.idle_since = manifest, None  # as a fresh open's first user
        return fresh

    def _release(self, name: str, entry: _OpenWriter) -> None:
        """One user less; the last leaves the writer idle (closed after ``idle_s``); idle
        writers past ``keep_idle`` are closed, least recently used first."""
        with self._lock:
            entry.users -= 1
            if entry.users > 0:
                return
            if self._closed or self.idle_s <= 0 or self.keep_idle <= 0:
                self._drop(name, entry)
                return
            entry.idle_since = since = time.monotonic()
            entry.timer = threading.Timer(self.idle_s, self._expire, (name, entry, since))
            entry.timer.daemon = True
            entry.timer.start()
            idle = sorted(
                (e.idle_since, n) for n, e in self._writers.items() if e.idle_since is not None
            )
            for _, n in idle[: max(len(idle) - self.keep_idle, 0)]:
                self._drop(n, self._writers[n])

    def _expire(self, name: str, entry: _OpenWriter, since: float) -> None:
        """Timer: close ``entry`` if it is still ``name``'s writer, idle since ``since``."""
        with self._lock:
            if self._writers.get(name) is entry and entry.idle_since == since:
                self._drop(name, entry)

    def _drop(self, name: str, entry: _OpenWriter) -> None:
        """Forget and close ``entry`` (under ``self._lock``; every append to it has returned)."""
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None
        if self._writers.get(name) is entry:
            del self._writers[name]
        with entry.lock:
            entry.writer.close()

    def open_writers(self) -> dict[str, int]:
        """The caches whose writer is open now, with its number of users (0: idle, kept)."""
        with self._lock:
            return {n: e.users for n, e in self._writers.items()}

    def close_writer(self, name: str) -> bool:
        """Close cache ``name``'s writer now if it is idle (e.g. before its files are removed);
        ``False`` if it is in use or none is open."""
        with self._lock:
            entry = self._writers.get(name)
            if entry is None or entry.users > 0:
                return False
            self._drop(name, entry)
            return True

    def close(self) -> None:
        """Close every open writer (shutdown); none is kept after this."""
        with self._lock:
            self._closed = True
            entries = list(self._writers.items())
            for name, entry in entries:
                self._drop(name, entry)


def _holds_chunks(folder: Path) -> bool:
    """Whether a local store holds a chunk or shard (only an append writes one)."""
    for _, _, files in os.walk(folder):
        for f in files:
            if f != "zarr.json" and f != LOCK_NAME and not f.endswith(".partial"):
                return True
    return False


def broken(name: str, e: BaseException) -> CacheBrokenError:
    """The 409 ``cache_broken`` of a store that cannot be opened (logged; no paths in it)."""
    log.warning("cache %r cannot be opened: %r", name, e)
    return CacheBrokenError(
        f"cache {name!r} cannot be opened: {type(e).__name__}: {public_message(str(e))}"
    )


@contextmanager
def broken_store(name: str) -> Iterator[None]:
    """An unreadable store (any error but a typed 4xx) becomes 409 ``cache_broken``."""
    try:
        yield
    except ServiceError:
        raise
    except FormatError as e:
        if format_error_status(e)[0] < 500:  # a typed finding (409/422/404): as mapped
            raise
        raise broken(name, e) from None
    except Exception as e:  # noqa: BLE001 - an unreadable store is a conflict, not a 500
        raise broken(name, e) from None


def expected_manifest(
    info: EngineInfo, *, k: int, logprob_dtype: str, dataset: str = ""
) -> Manifest:
    """The manifest of a new cache of top-``k`` rows from the engine described by ``info``."""
    ident = teacher_identity(info)
    return Manifest(
        **{f: ident[f] for f in TEACHER_FIELDS},
        k=k,
        logprob_dtype=logprob_dtype,  # type: ignore[arg-type]
        dataset=dataset,
        extra=teacher_extra(ident),
    )

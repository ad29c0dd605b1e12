"""Named caches under the server's store root, and the one writer per cache this process holds.

A cache name maps to ``<store_root>/<name>`` (a local directory or an object-store prefix). Names
match :data:`NAME_PATTERN` (letters, digits, ``.``, ``_``, ``-``; no ``/``, no ``..``, at most 128
characters), so no name can leave the root.

Before anything is written the server's expected manifest (from the engine: teacher, revision,
tokenizer fingerprint, vocab size, temperature, logprob mode, and the requested k) is compared
with an existing cache's; any difference is a :class:`~logitcache.server.errors.ConflictError`
(409). Storage dtypes (``logprob_dtype``, ``tail_mass_dtype``) are the cache's own: a resumed cache
keeps what it was created with.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from logitcache.cache_format import CacheReader, CacheWriter, Manifest, SequenceRecord
from logitcache.cache_format.errors import ManifestError, StoreNotFoundError
from logitcache.cache_format.identity import TEACHER_FIELDS, teacher_diff, teacher_extra
from logitcache.cache_format.spec import layout_named

from .engine.identity import teacher_identity
from .errors import ConflictError, InvalidCacheNameError, NotFoundError

if TYPE_CHECKING:
    from .engine import EngineInfo

#: Allowed cache names.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_name(name: str) -> str:
    """Return ``name`` if it is a valid cache name, else raise :class:`InvalidCacheNameError`."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name) or ".." in name:
        raise InvalidCacheNameError(
            f"invalid cache name {name!r}: use 1-128 of [A-Za-z0-9._-], starting with a letter or "
            "digit, without '..'"
        )
    return name


def is_url(root: str) -> bool:
    """Whether ``root`` is a URL (``scheme://...``) rather than a local path."""
    return "://" in root


@dataclass
class _OpenWriter:
    writer: CacheWriter
    manifest: Manifest
    users: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class _CachedReader:
    reader: CacheReader | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class WriterHandle:
    """A shared, serialised view of one cache's writer (see :meth:`CacheRegistry.writer`)."""

    def __init__(self, name: str, entry: _OpenWriter):
        self.name = name
        self._entry = entry

    @property
    def manifest(self) -> Manifest:
        return self._entry.manifest

    def append(self, records: Sequence[SequenceRecord]) -> int:
        """Append (and commit) records; keys already present are skipped. Returns new count."""
        with self._entry.lock:
            return self._entry.writer.append(list(records))

    def contains(self, key: str) -> bool:
        """Whether ``key`` is committed; does not wait for an append in progress (a key being
        committed right now may read as absent: re-appending it is a no-op)."""
        return self._entry.writer.contains(key)

    def missing(self, keys: Sequence[str]) -> list[str]:
        """The keys of ``keys`` not yet committed, in order (see :meth:`contains`)."""
        w = self._entry.writer
        return [k for k in keys if not w.contains(k)]


class CacheRegistry:
    """Resolves cache names to store URLs, lists caches, and shares one writer per cache.

    Thread-safe: writers are opened, shared and closed under a lock; appends to one cache are
    serialised by that cache's own lock.
    """

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None):
        if not is_url(root):
            root = str(Path(root).expanduser().resolve())
            Path(root).mkdir(parents=True, exist_ok=True)
        self.root = root.rstrip("/")
        self.storage_options = dict(storage_options or {}) or None
        self._lock = threading.Lock()
        self._writers: dict[str, _OpenWriter] = {}
        self._readers: dict[str, _CachedReader] = {}
        self._stores: dict[str, Any] = {}
        self._root: Any = None

    # --- naming / discovery ---------------------------------------------------------------

    def url(self, name: str) -> str:
        """The store URL (or local path) of cache ``name`` (validated)."""
        return f"{self.root}/{check_name(name)}"

    def names(self) -> list[str]:
        """Names of the caches (entries with a root ``zarr.json``) under the root, sorted.

        Listed through the same store (and storage options) that reads and writes the caches
        (``cache_format.store.list_children``)."""
        from logitcache.cache_format.store import list_children

        root = self._root_store()
        out = []
        for name in list_children(root):
            if NAME_PATTERN.fullmatch(name) and _exists(root, f"{name}/zarr.json"):
                out.append(name)
        return out

    def _root_store(self) -> Any:
        """The read-only store of the root (opened once)."""
        with self._lock:
            if self._root is None:
                from logitcache.cache_format.store import open_store

                self._root = open_store(self.root, self.storage_options, read_only=True).zstore
            return self._root

    def reader(self, name: str) -> CacheReader:
        """A reader of cache ``name`` at its latest commit; :class:`NotFoundError` if none.

        Readers are kept per cache and refreshed (incrementally) on each call, so streaming a
        large cache block by block does not reload its index every time. Reads of an older
        snapshot stay valid while a refresh runs (the committed prefix never changes).
        """
        url = self.url(name)
        with self._lock:
            entry = self._readers.setdefault(name, _CachedReader())
        try:
            with entry.lock:
                if entry.reader is None:
                    entry.reader = CacheReader(url, storage_options=self.storage_options)
                else:
                    entry.reader.refresh()
                return entry.reader
        except (StoreNotFoundError, FileNotFoundError) as e:
            with self._lock:
                self._readers.pop(name, None)
            raise NotFoundError(f"no cache named {name!r}") from e

    def store(self, name: str) -> Any:
        """The read-only zarr store of cache ``name`` (opened once; raw object reads)."""
        url = self.url(name)
        with self._lock:
            if name not in self._stores:
                from logitcache.cache_format.store import open_store

                self._stores[name] = open_store(url, self.storage_options, read_only=True).zstore
            return self._stores[name]

    def manifest(self, name: str) -> Manifest | None:
        """The committed manifest of cache ``name``, or ``None`` if the cache does not exist."""
        try:
            return self.reader(name).manifest
        except NotFoundError:
            return None
        except ManifestError:
            return None

    # --- identity checks ------------------------------------------------------------------

    def target_manifest(self, name: str, expected: Manifest, *, k: int | None) -> Manifest:
        """The manifest a writer of ``name`` must use for ``expected``'s teacher.

        For a new cache: ``expected``. For an existing cache: its own
        manifest, after checking that every teacher field, ``k`` (when given) and the target
        kind (``targets``, ``sampling``) agree; any difference raises :class:`ConflictError`
        listing them.
        """
        stored = self.manifest(name)
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
        for f in ("targets", "sampling"):  # one cache holds one kind of rows (FORMAT.md 4.4)
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
        self, name: str, manifest: Manifest, layout: str | None = None
    ) -> Iterator[WriterHandle]:
        """Use the process's writer of cache ``name`` (opened on first use, closed on last).
        ``layout``: the preset a cache created here gets (``spec.LAYOUTS``; an existing cache
        keeps its own, FORMAT.md 4.7)."""
        url = self.url(name)
        with self._lock:
            entry = self._writers.get(name)
            if entry is None:
                w = CacheWriter.open(
                    url,
                    manifest,
                    storage_options=self.storage_options,
                    layout=None if layout is None else layout_named(layout),
                )
                entry = _OpenWriter(writer=w, manifest=manifest)
                self._writers[name] = entry
            elif entry.manifest.identity() != manifest.identity():
                raise ConflictError(f"cache {name!r} is open with another manifest")
            entry.users += 1
        try:
            yield WriterHandle(name, entry)
        finally:
            with self._lock:
                entry.users -= 1
                if entry.users == 0:
                    del self._writers[name]
                    with entry.lock:
                        entry.writer.close()

    def close(self) -> None:
        """Close every open writer (shutdown)."""
        with self._lock:
            entries = list(self._writers.values())
            self._writers.clear()
        for entry in entries:
            with entry.lock:
                entry.writer.close()


class RangeReader:
    """Read whole sequence ranges of one reader with two contiguous reads each
    (``CacheReader.read_ranges``: the same code the client's ``LocalSource`` reads with).

    Sequences ``[a, b)`` are rows ``[row_start(a), row_start(b))`` and tokens
    ``[row_start(a) + a, row_start(b) + b)`` (FORMAT.md): one row read and one token read,
    however many sequences, instead of one read per sequence. The committed prefix never
    changes, so ranges checked against an earlier snapshot stay valid while the reader refreshes.
    """

    def __init__(self, reader: CacheReader) -> None:
        self.reader = reader
        # a float16 cache is read (and sent) as its stored float16 values: exact, less work
        self.logprob_dtype = "float16" if reader.manifest.logprob_dtype == "float16" else "float32"

    def read(self, start: int, stop: int) -> list[SequenceRecord]:
        """Records of sequences ``[start, stop)`` (``0 <= start <= stop <= num_sequences``)."""
        return self.reader.read_ranges([(start, stop)], logprob_dtype=self.logprob_dtype)


def _exists(zstore: Any, key: str) -> bool:
    from zarr.core.sync import sync

    return bool(sync(zstore.exists(key)))


def expected_manifest(
    info: EngineInfo, *, k: int, logprob_dtype: str, dataset: str = ""
) -> Manifest:
    """The manifest of a new cache of top-``k`` rows from the engine described by ``info``: its
    teacher identity (:func:`~.engine.identity.teacher_identity`; the weights hash and dtype go
    to ``extra["teacher"]``), ``k``, the storage dtype and the dataset description."""
    ident = teacher_identity(info)
    return Manifest(
        **{f: ident[f] for f in TEACHER_FIELDS},
        k=k,
        logprob_dtype=logprob_dtype,  # type: ignore[arg-type]
        dataset=dataset,
        extra=teacher_extra(ident),
    )

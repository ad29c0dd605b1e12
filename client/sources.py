"""Where cached sequences come from: the Zarr store itself, or the teacher service over HTTP.

A source answers four questions and nothing else (the :class:`CacheSource` protocol): the cache
``manifest``, ``num_sequences``, the token ``lengths`` of the first ``num_sequences`` sequences, and
``fetch(indices) -> {index: SequenceRecord}``. Sources are picklable and open their reader or HTTP
connection lazily in the process that uses them (a DataLoader worker reopens after fork or
spawn), so a source built in the trainer can be handed to workers.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from .errors import SourceError

if TYPE_CHECKING:
    from logitcache.cache_format import CacheReader, Manifest, SequenceRecord

__all__ = [
    "CacheSource",
    "LocalSource",
    "HttpSource",
    "contiguous_runs",
    "merged_ranges",
    "open_source",
]


@runtime_checkable
class CacheSource(Protocol):
    """What :class:`logitcache.client.CacheDataset` reads from."""

    @property
    def manifest(self) -> Manifest:
        """The cache's ``Manifest`` (tokenizer fingerprint, vocab size, k, ...)."""
        ...

    @property
    def num_sequences(self) -> int:
        """Committed sequences visible to this source (fixed until :meth:`refresh`)."""
        ...

    @property
    def lengths(self) -> np.ndarray:
        """``int64 [num_sequences]``: token count ``L`` of each sequence."""
        ...

    def fetch(self, indices: Iterable[int]) -> dict[int, SequenceRecord]:
        """Records of the given sequence indices, keyed by index."""
        ...

    def refresh(self) -> None:
        """See sequences committed since the source was opened."""
        ...


def contiguous_runs(indices: Iterable[int]) -> list[tuple[int, int]]:
    """Cut sorted unique ``indices`` into ``[start, stop)`` runs of consecutive integers:
    ``[3, 4, 5, 9] -> [(3, 6), (9, 10)]``."""
    idx = np.unique(np.fromiter(indices, dtype=np.int64))
    if idx.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(idx) != 1) + 1
    return [(int(part[0]), int(part[-1]) + 1) for part in np.split(idx, breaks)]


def merged_ranges(
    wanted: np.ndarray, lengths: np.ndarray, max_gap_tokens: int
) -> list[tuple[int, int]]:
    """Sequence ranges ``[a, b)`` covering sorted unique ``wanted`` with few reads: runs of
    consecutive indices are merged when fewer than ``max_gap_tokens`` tokens of unwanted
    sequences lie between them (reading those is cheaper than another read)."""
    ranges: list[tuple[int, int]] = []
    for a, b in contiguous_runs(wanted.tolist()):
        if ranges and int(lengths[ranges[-1][1] : a].sum()) <= max_gap_tokens:
            ranges[-1] = (ranges[-1][0], b)
        else:
            ranges.append((a, b))
    return ranges


#: URL schemes that ``logitcache.cache_format`` opens with obstore unless told otherwise.
_OBSTORE_SCHEMES = frozenset({"s3", "s3a", "gs", "gcs", "az", "azure", "abfs", "abfss"})


class LocalSource:
    """Read a cache store directly: a local path or an object-store URL (``s3://bucket/prefix``).

    ``storage_options`` go to ``CacheReader`` unchanged (e.g. ``{"endpoint_url": ...,
    "key": ..., "secret": ...}``); ``decode_threads=n``: the reader is
    ``CacheReader(decode_threads=n)``; ``max_gap_tokens``: how :meth:`fetch` merges reads.
    These settings are pickled with the source, so a DataLoader worker's reader (opened
    there) has them too.

    Fork safety: object-store URLs are read through obstore by default, whose runtime does not
    survive ``fork`` (a forked child hangs on its first request). :attr:`fork_safe` says so;
    :class:`~logitcache.client.dataset.CacheDataLoader` then starts its workers with ``spawn``,
    and a source used in a forked child after its parent read the store raises
    :class:`SourceError` instead of hanging. ``storage_options={"backend": "fsspec"}`` (s3fs)
    is fork-safe.
    """

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        max_gap_tokens: int = 16384,
        decode_threads: int = 1,
    ) -> None:
        if decode_threads < 1:
            raise SourceError(f"decode_threads must be >= 1, got {decode_threads}")
        self.url = str(url)
        self.storage_options = dict(storage_options) if storage_options else None
        self.max_gap_tokens = int(max_gap_tokens)
        self.decode_threads = int(decode_threads)
        self._reader: CacheReader | None = None
        self._pid: int | None = None
        self._lengths: np.ndarray | None = None

    #: The constructor's arguments, in order: what a pickle (a DataLoader worker's copy) holds.
    _CONFIG = tuple(inspect.signature(__init__).parameters)[1:]

    def __getstate__(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._CONFIG}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**{n: state[n] for n in self._CONFIG})  # type: ignore[misc]

    def __repr__(self) -> str:
        threads = f", decode_threads={self.decode_threads}" if self.decode_threads > 1 else ""
        return f"LocalSource({self.url!r}{threads})"

    @property
    def fork_safe(self) -> bool:
        """Whether a child forked after this process read the store can read it too."""
        scheme = self.url.split("://", 1)[0].lower() if "://" in self.url else ""
        backend = (self.storage_options or {}).get("backend")
        return not (scheme in _OBSTORE_SCHEMES and backend in (None, "obstore"))

    @property
    def reader(self) -> CacheReader:
        """The ``CacheReader`` of this process (opened on first use, reopened after a fork)."""
        if self._reader is None or self._pid != os.getpid():
            from logitcache.cache_format import CacheReader

            if self._pid is not None and not self.fork_safe:
                raise SourceError(
                    f"{self.url}: this process was forked after its parent read the store "
                    "through obstore, which does not survive fork; use CacheDataLoader (it "
                    "spawns workers), DataLoader(multiprocessing_context='spawn'), or "
                    "storage_options={'backend': 'fsspec'}"
                )

            self._reader = CacheReader(
                self.url,
                storage_options=self.storage_options,
                decode_threads=self.decode_threads,
            )
            self._pid = os.getpid()
            self._lengths = None
        return self._reader

    @property
    def manifest(self) -> Manifest:
        return self.reader.manifest

    @property
    def num_sequences(self) -> int:
        return int(self.reader.num_sequences)

    @property
    def lengths(self) -> np.ndarray:
        return np.asarray(self.reader.lengths, dtype=np.int64)

    def _snapshot_lengths(self) -> np.ndarray:
        """Lengths of the reader's snapshot (cached until refresh; no keys: the reader reads
        those only when asked)."""
        reader = self.reader
        if self._lengths is None or len(self._lengths) != reader.num_sequences:
            self._lengths = np.asarray(reader.lengths, dtype=np.int64)
        return self._lengths

    def _point_reads(self, wanted: int, ranges: int) -> bool:
        """Whether :meth:`fetch` reads ``wanted`` sequences, which merge into ``ranges`` ranges,
        with one point read (see :meth:`fetch`)."""
        if 2 * ranges < wanted:
            return False  # runs of neighbours (shuffle blocks): range reads decode them cheaper
        reader = self.reader
        return reader.local_root is not None and reader.decoder == "numba"

    def fetch(self, indices: Iterable[int]) -> dict[int, SequenceRecord]:
        """Records of the wanted sequences, keyed by index, the same whichever way they are read:
        scattered sequences (at least one merged range per two wanted) by one point read
        (``CacheReader.sequences``: each wanted chunk decoded once) where the reader's compiled
        path serves them (a local directory store with numba); else range reads: runs less than
        ``max_gap_tokens`` apart are merged (:func:`merged_ranges`; not for a hidden cache,
        whose rows decode chunk by chunk), read by one ``CacheReader.read_ranges`` call, and the
        unwanted sequences in between dropped. An object store answers few large requests
        better, and neighbours (shuffle blocks) decode cheaper as ranges.
        """
        lengths = self._snapshot_lengths()
        wanted = np.unique(np.fromiter(indices, dtype=np.int64))
        if wanted.size and (wanted[0] < 0 or wanted[-1] >= len(lengths)):
            raise SourceError(f"sequence indices outside [0, {len(lengths)})")
        hidden = self.reader.manifest.hidden is not None  # FORMAT.md 4.10
        ranges = merged_ranges(wanted, lengths, 0 if hidden else self.max_gap_tokens)
        dt = "bfloat16" if hidden else "float32"
        if self._point_reads(len(wanted), len(ranges)):
            picked = wanted.tolist()
            got = self.reader.sequences(picked, logprob_dtype=dt)
            return dict(zip(picked, got, strict=True))
        records = self.reader.read_ranges(ranges, logprob_dtype=dt)
        sent = np.concatenate([np.arange(a, b) for a, b in ranges]) if ranges else wanted
        keep = np.isin(sent, wanted)
        return {int(i): r for i, r, k in zip(sent.tolist(), records, keep, strict=True) if k}

    def refresh(self) -> None:
        self.reader.refresh()
        self._lengths = None


class HttpSource(LocalSource):
    """Read a cache from the teacher service: a :class:`LocalSource` over its stored objects as
    they are (``GET /v1/caches/{name}/store/{key}`` with byte ranges; server/API.md). The server
    only copies compressed shard bytes; this process (or each DataLoader worker) decodes them.
    """

    def __init__(
        self,
        base_url: str,
        cache: str,
        *,
        api_key: str | None = None,
        max_gap_tokens: int = 8192,
        decode_threads: int = 1,
    ) -> None:
        self.base_url, self.cache, self.api_key = base_url, cache, api_key
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        super().__init__(
            f"{base_url.rstrip('/')}/v1/caches/{cache}/store",
            {"headers": headers} if headers else None,
            max_gap_tokens=max_gap_tokens,
            decode_threads=decode_threads,
        )

    _CONFIG = tuple(inspect.signature(__init__).parameters)[1:]

    def __repr__(self) -> str:
        return f"HttpSource({self.base_url!r}, {self.cache!r})"


_SOURCE_MEMBERS = ("manifest", "num_sequences", "lengths", "fetch", "refresh")


def _is_source(obj: object) -> bool:
    """Whether ``obj`` has :class:`CacheSource`'s members (as attributes of the object or of its
    type), looked up without calling them: ``isinstance(obj, CacheSource)`` on Python 3.11 reads
    each property, so an :class:`HttpSource` would make a request to its server in the check."""
    missing = object()
    return all(inspect.getattr_static(obj, n, missing) is not missing for n in _SOURCE_MEMBERS)


def open_source(
    location: str | os.PathLike[str] | CacheSource,
    *,
    storage_options: dict[str, Any] | None = None,
    cache: str | None = None,
    **http_options: Any,
) -> CacheSource:
    """Turn a location into a source: a source is returned as is; ``http(s)://`` URLs need
    ``cache`` (the cache name on the server) and give an :class:`HttpSource`; anything else
    (local path, ``s3://``, ``file://``) gives a :class:`LocalSource`."""
    if not isinstance(location, str | os.PathLike):
        if _is_source(location):
            return location
        raise SourceError(
            f"a cache location is a path, a URL or a CacheSource, not {type(location).__name__}"
        )
    url = os.fspath(location)
    if url.startswith(("http://", "https://")):
        if cache is None:
            raise SourceError("an http(s) location needs cache=<name of the cache on the server>")
        return HttpSource(url, cache, **http_options)
    if cache is not None or http_options:
        raise SourceError("cache= and HTTP options only apply to http(s) locations")
    return LocalSource(url, storage_options)

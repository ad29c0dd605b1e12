"""Reading a cache: by sequence index, by key, by row range (FORMAT.md §6 "Reading").

A reader works on a snapshot: the manifest (commit point) read at open or at :meth:`refresh`
and that commit's sequence index (:class:`~._snapshot.IndexSnapshot`); it never reads past the
snapshot's counts. A read that races a writer's rewrite of a partly filled shard fails its
CRC32C and is retried on a fresh snapshot; a failure that persists is a
:class:`~.errors.CorruptStoreError`. Every read goes through one decoder (:mod:`._decode`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import zarr
from zarr.codecs import BloscCodec, ShardingCodec

from . import _hiddenread as hiddenread
from . import _idmap as idmap
from . import _rowextra, spec
from . import _shardread as shardread
from ._decode import Fetched, OpenArrays, Span, get_decoder, index_block, stored_values
from ._integrity import checked_read
from ._keyindex import KeyTable, follow_runs, stored_key_bytes
from ._manifest import Manifest
from ._seal import sealed
from ._snapshot import IndexBlocks, IndexSnapshot, Piece
from ._stored import stored_record
from ._zarr_adapter import Opened, open_arrays
from .errors import (
    ChecksumError,
    CorruptStoreError,
    FormatError,
    StoreNotFoundError,
    TargetKindError,
)
from .hidden import HiddenRows, TeacherHead
from .layout import array_defs, committed_lengths, parse_root, read_root_attrs, strict
from .quant import OUT_DTYPES
from .records import RowBlock, SequenceRecord
from .store import open_store

_T = TypeVar("_T")

_RETRIES = 8  # raced reads: retried with backoff 10 ms .. 1.3 s (about 2.5 s in all)


def _with_retries(fn: Callable[[], _T], on_retry: Callable[[], None] | None = None) -> _T:
    """Run ``fn``; retry a raced read (bad checksum or bytes, I/O error) with backoff. Other typed
    errors are raised at once; any other failure that persists becomes a
    :class:`CorruptStoreError`."""
    for attempt in range(_RETRIES):
        try:
            return fn()
        except ChecksumError as e:
            err: Exception = e
        except FormatError:
            raise
        except Exception as e:
            err = e
        if attempt < _RETRIES - 1:
            time.sleep(0.01 * 2**attempt)
            if on_retry is not None:
                on_retry()
    if isinstance(err, ChecksumError):
        raise err
    raise CorruptStoreError(f"unreadable after {_RETRIES} attempts: {err!r}") from err


def _array_names(m: Manifest) -> list[str]:
    return [d.name for d in array_defs(m)]


def _open_arrays(
    zstore: Any, m: Manifest, known: dict[str, Opened] | None = None
) -> dict[str, Opened]:
    try:
        return open_arrays(zstore, _array_names(m), known)
    except (FileNotFoundError, zarr.errors.ArrayNotFoundError) as e:
        raise CorruptStoreError(f"store is missing an array: {e}") from e
    except Exception as e:  # damaged array metadata (zarr.json)
        raise CorruptStoreError(f"array metadata unreadable: {e!r}") from e


class CacheReader:
    """Read-only view of the committed part of a cache.

    ``as_torch=True``: reads return dicts of torch tensors (``record.to_torch()``).
    ``decode_threads > 1`` splits the decode of one read call over that many threads (the same
    values). ``decoder``: ``"numba"`` or ``"numpy"`` (:mod:`._decode`; default: the compiled one
    where numba is installed). Random access is fastest on a store written with the
    ``random_access`` or ``random_access_raw`` layout preset (FORMAT.md 4.7,
    :attr:`layout_name`)."""

    def __init__(
        self,
        url: str | Path,
        storage_options: dict[str, Any] | None = None,
        *,
        as_torch: bool = False,
        decode_threads: int = 1,
        decoder: str | None = None,
    ):
        if decode_threads < 1:
            raise ValueError(f"decode_threads must be >= 1, got {decode_threads}")
        self._decoder = get_decoder(decoder)
        self.decode_threads = int(decode_threads)
        self.as_torch = as_torch
        self._url, self._storage_options = str(url), storage_options
        self._decode_pool: ThreadPoolExecutor | None = None
        self._handle = open_store(url, storage_options, read_only=True)
        self._index = IndexSnapshot.empty(
            KeyTable(self._read_keys, self._read_key_bytes),
            IndexBlocks(self._read_index_block, self._read_lengths),
        )
        self._manifest: Manifest | None = None
        self._open: OpenArrays | None = None
        self._id_order: np.ndarray | None = None
        self._arrays: dict[str, Opened] | None = None  # with their metadata, for the next refresh
        self.refresh()

    # ------------------------------------------------------------------ snapshot
    def refresh(self) -> bool:
        """Adopt the latest commit (reading its last index block only); True if it changed. A read
        that races a writer's shard rewrite is retried on a freshly read commit."""
        return _with_retries(self._refresh_once)

    def _refresh_once(self) -> bool:
        zstore = self._handle.zstore
        try:
            attrs = read_root_attrs(zstore)
        except CorruptStoreError:  # a damaged root: its own typed error
            raise
        except Exception as e:  # store unreachable or unreadable
            raise FormatError(f"cannot read store {self._handle.url!r}: {e}") from e
        if attrs is None:
            raise StoreNotFoundError(f"no logitcache store at {self._handle.url!r}")
        m = parse_root(attrs)
        old = self._manifest
        if old is not None and m.generation == old.generation:
            return False
        known = len(self._index)
        if old is not None and (m.generation < old.generation or m.num_sequences < known):
            raise CorruptStoreError("store went backwards (generation or count decreased)")
        opened_now = _open_arrays(zstore, m, self._arrays)
        arrays = {n: a for n, (a, _) in opened_now.items()}
        need = committed_lengths(m)
        for n, a in arrays.items():
            if a.shape[0] < need[n]:
                raise CorruptStoreError(
                    f"array {n} has {a.shape[0]} entries, commit needs {need[n]}"
                )
        strict_ = strict(m)
        id_order = self._id_order
        if m.id_remap and m.num_rows and id_order is None:
            seal = sealed(m.format_version)
            id_order = checked_read(
                arrays[spec.ID_ORDER], spec.ID_ORDER, 0, m.vocab_size, strict_, seal
            )
            if not idmap.is_permutation(id_order, m.vocab_size):
                raise CorruptStoreError("id_order is not a permutation of the vocabulary")
        opened = self._adopt_arrays(arrays, need, strict_, m, id_order)
        index = self._index.at(m, partial(index_block, opened))  # checks its end (R6, R8)
        self._id_order = id_order  # every read done and checked: now adopt
        self._open, self._arrays = opened, opened_now
        self._index = index
        self._manifest = m
        follow_runs(index.table, zstore, m)
        return True

    def _adopt_arrays(
        self,
        arrays: dict[str, zarr.Array],
        need: dict[str, int],
        st: bool,
        m: Manifest,
        id_order: np.ndarray | None,
    ) -> OpenArrays:
        direct = {}
        for n, a in arrays.items():
            lay = shardread.direct_layout(
                a, n, committed=need[n], strict=st, sealed=sealed(m.format_version)
            )
            if lay is not None:
                direct[n] = lay
        ids = direct.get(spec.TOPK_IDS)
        root = None if ids is None else shardread.local_root(ids)
        return OpenArrays(m, arrays, direct, need, st, root, id_order)

    def _reopen_arrays(self) -> None:
        o = self._opened
        self._arrays = _open_arrays(self._handle.zstore, o.manifest)
        arrays = {n: a for n, (a, _) in self._arrays.items()}
        self._open = self._adopt_arrays(arrays, o.need, o.strict, o.manifest, o.id_order)

    def _read_index_block(self, a: int, b: int, upto: bool) -> tuple[np.ndarray, int, int | None]:
        """Index block ``[a, b)`` of the adopted commit (:data:`._snapshot.ReadBlock`), with the
        reader's retries."""
        return self._retry(lambda: index_block(self._opened, a, b, upto))

    def _read_lengths(self, a: int, b: int) -> np.ndarray:
        """Committed ``seq_lengths[a:b]``, with the reader's retries."""
        return self._retry(lambda: stored_values(self._opened, [(spec.SEQ_LENGTHS, a, b)])[0])

    def _read_keys(self, a: int, b: int) -> np.ndarray:
        """Stored keys ``[a, b)`` (committed), with the reader's retries."""

        return self._retry(lambda: stored_values(self._opened, [(spec.SEQ_KEYS, a, b)])[0])

    def _read_key_bytes(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray] | None:
        """UTF-8 bytes of committed keys ``[a, b)`` and their ends (:func:`stored_key_bytes`);
        ``None`` for a version-1 store (it has none)."""

        def read() -> tuple[np.ndarray, np.ndarray] | None:
            o = self._opened
            m = o.manifest
            if m.format_version < 2:
                return None
            return stored_key_bytes(partial(stored_values, o), a, b, m.num_key_bytes)

        return self._retry(read)

    @property
    def _opened(self) -> OpenArrays:
        assert self._open is not None
        return self._open

    def head(self) -> TeacherHead:
        """The teacher head of a ``targets="hidden"`` store (FORMAT.md 4.10), checked against
        the manifest's ``head_digest`` (:class:`FormatError` for any other store)."""
        return self._retry(lambda: hiddenread.read_head(self._opened))

    @property
    def manifest(self) -> Manifest:
        assert self._manifest is not None
        return self._manifest

    @property
    def index(self) -> IndexSnapshot:
        """The sequence index of the adopted commit (frozen; replaced at each refresh that
        adopts a new commit)."""
        return self._index

    @property
    def url(self) -> str:
        return self._handle.url

    @property
    def store(self) -> zarr.abc.store.Store:
        """The zarr store the reader reads (read-only)."""
        return self._handle.zstore

    @property
    def local_root(self) -> str | None:
        """The directory of a local store whose row arrays are in the format's sharded layout
        (the compiled decoder reads those), else ``None``."""
        return self._opened.root

    @property
    def decoder(self) -> str:
        """The name of the decoder this reader's reads run (``"numba"`` or ``"numpy"``)."""
        return self._decoder.active()

    @property
    def layout_name(self) -> str:
        """The store's layout preset (FORMAT.md 4.7): its ``logitcache_layout`` attribute, else
        ``"default"`` if ``topk_ids`` has the default chunking and codecs, else ``"custom"``."""
        opened = self._opened
        row = spec.HIDDEN if opened.manifest.hidden is not None else spec.TOPK_IDS
        arr = opened.arrays[row]
        name = arr.attrs.get(spec.LAYOUT_ATTR)
        if isinstance(name, str) and name:
            return name
        if row == spec.HIDDEN:  # its chunking follows d (FORMAT.md 4.10)
            return "default"
        lay = opened.direct.get(row)
        d = spec.DEFAULT_LAYOUT
        if lay is None or (lay.chunk_rows, lay.shard_rows) != (d.row_chunk, d.row_shard):
            return "custom"
        sharding = lay.metadata.codecs[0]
        comp = None
        if isinstance(sharding, ShardingCodec):
            comp = next((c for c in sharding.codecs if isinstance(c, BloscCodec)), None)
        if comp is None or (comp.cname.value, comp.clevel) != ("zstd", 1):
            return "custom"
        return "default"

    @property
    def num_sequences(self) -> int:
        return self.manifest.num_sequences

    @property
    def num_rows(self) -> int:
        return self.manifest.num_rows

    @property
    def num_tokens(self) -> int:
        return self.manifest.num_tokens

    @property
    def keys(self) -> list[str]:
        """Sequence keys in storage order (a new list, read from the store: the reader keeps
        no key per sequence)."""
        return list(self._index.keys)

    @property
    def lengths(self) -> np.ndarray:
        """Token counts ``L_i`` per sequence (a new int32 array; the whole index, read at the first
        use per snapshot)."""
        return self._index.lengths.astype(np.int32)

    @property
    def row_starts(self) -> np.ndarray:
        """First global row of each sequence (computed from the lengths: a new array)."""
        return self._index.row_starts

    def __len__(self) -> int:
        return self.num_sequences

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def index_of(self, key: str) -> int:
        """Sequence index of ``key`` (KeyError if absent), from the key index (FORMAT.md 4.11)."""
        return self._index.index_of(key)

    # ------------------------------------------------------------------ reading
    def _retry(self, fn: Callable[[], _T]) -> _T:
        """Run ``fn``; on a checksum/decoding failure (raced rewrite) reopen the arrays, retry."""
        return _with_retries(fn, self._reopen_arrays)

    def _check_seq(self, i: int) -> int:
        n = self.num_sequences
        if not isinstance(i, int | np.integer):
            raise TypeError(f"sequence index must be an int, got {type(i).__name__}")
        i = int(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sequence index {i} out of range [0, {n})")
        return i

    def _pool(self) -> ThreadPoolExecutor | None:
        if self.decode_threads <= 1:
            return None
        if self._decode_pool is None:
            self._decode_pool = ThreadPoolExecutor(self.decode_threads, "logitcache-decode")
        return self._decode_pool

    def read_spans(
        self,
        spans: list[Span],
        logprob_dtype: str = "float32",
    ) -> list[Fetched]:
        """Per span ``(ids, logprobs, tail, tokens or None, mask or None)`` of this snapshot, with
        the reader's retries; spans past the committed counts are :class:`CorruptStoreError`
        (R6)."""
        if logprob_dtype not in OUT_DTYPES:
            raise ValueError(f"logprob_dtype must be one of {OUT_DTYPES}, got {logprob_dtype!r}")
        if self._opened.manifest.hidden is not None:
            raise TargetKindError('a targets="hidden" store has no top-k rows (FORMAT.md 4.10)')

        def read() -> list[Fetched]:
            opened, threads = self._opened, self.decode_threads
            return self._decoder.fetch(opened, spans, logprob_dtype, self._pool(), threads)

        return self._retry(read)

    def _out(self, rec: Any) -> Any:
        return rec.to_torch() if self.as_torch else rec

    def sequence(self, i: int, *, logprob_dtype: str = "float32") -> SequenceRecord | dict:
        """Sequence ``i`` (storage order) as a :class:`SequenceRecord`; ``logprob_dtype`` as in
        :meth:`rows`."""
        return self._out(self._sequences([self._check_seq(i)], logprob_dtype)[0])

    def get(self, key: str) -> SequenceRecord | dict:
        """The sequence stored under ``key`` (KeyError if absent)."""
        return self.sequence(self._index.index_of(key))

    def sequences(self, indices: Sequence[int], *, logprob_dtype: str = "float32") -> list:
        """Several sequences (any order, repeats allowed) in one read: every inner chunk they
        need is fetched and decoded once (point reads, FORMAT.md D4)."""
        idx = [self._check_seq(i) for i in indices]
        if not idx:
            return []
        return [self._out(rec) for rec in self._sequences(idx, logprob_dtype)]

    def _sequences(self, idx: list[int], logprob_dtype: str) -> list[Any]:
        """Records of sequences ``idx`` (checked indices) in one read."""
        index, whole = self._index, (slice(None), slice(None))
        return self._records(
            [index.span(i) for i in idx], [[(i, *whole)] for i in idx], logprob_dtype
        )

    def read_ranges(
        self, ranges: Sequence[tuple[int, int]], *, logprob_dtype: str = "float32"
    ) -> list[Any]:
        """Records of the sequences of every ``[a, b)`` in ``ranges``, range after range: one read
        per range (sequences are stored back to back), the records views of its blocks. Ranges may
        be empty, overlap or come in any order."""
        index = self._index
        todo = [(a, b) for a, b in index.check_ranges(ranges) if b > a]
        if not todo:
            return []
        spans: list[Span] = [index.range_span(a, b) for a, b in todo]
        return self._records(spans, [index.pieces(a, b) for a, b in todo], logprob_dtype)

    def _records(self, spans: list[Span], pieces: list[list[Piece]], logprob_dtype: str) -> list:
        """The records of each span's ``pieces`` (top-k or hidden, FORMAT.md 4.10), with the
        store's optional per-row arrays attached."""
        make: Callable[..., Any] = stored_record
        if self._opened.manifest.hidden is not None:
            got: list[Any] = self._retry(
                lambda: hiddenread.fetch(self._opened, spans, logprob_dtype)
            )
            make = hiddenread.record
        else:
            got = self.read_spans(spans, logprob_dtype)
        keys = self._index.keys
        out = [make(keys, i, g, r, t) for g, ps in zip(got, pieces, strict=True) for i, r, t in ps]
        extra = _rowextra.read(self._opened, self._retry, [rows for rows, _ in spans])
        return _rowextra.attach(out, extra)

    def rows(self, start: int, stop: int, *, logprob_dtype: str = "float32") -> RowBlock | dict:
        """Global rows ``[start, stop)`` (they may span sequences; see :attr:`row_starts`).
        ``logprob_dtype="float16"`` returns a float16 store's stored values as they are (the fastest
        read); other encodings are decoded to float32 and rounded."""
        n = self.num_rows
        if not (0 <= start <= stop <= n):
            raise IndexError(f"row range [{start}, {stop}) outside [0, {n})")
        span: list[Span] = [(slice(start, stop), None)]
        if self._opened.manifest.hidden is not None:  # FORMAT.md 4.10
            hidden, _, mask = self._retry(
                lambda: hiddenread.fetch(self._opened, span, logprob_dtype)
            )[0]
            return self._out(HiddenRows(start, hidden, mask))
        ids, lp, tail, _, mask = self.read_spans(span, logprob_dtype)[0]
        extra = _rowextra.read(self._opened, self._retry, [slice(start, stop)])
        block = RowBlock(
            start, ids, lp, tail, mask, *(_rowextra.first(extra, x.name) for x in _rowextra.EXTRAS)
        )
        return self._out(block)

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Global input-token range ``[start, stop)`` of the flat ``input_ids`` array."""
        if not (0 <= start <= stop <= self.num_tokens):
            raise IndexError(f"token range [{start}, {stop}) outside [0, {self.num_tokens})")
        job = [(spec.INPUT_IDS, start, stop)]
        return self._retry(lambda: stored_values(self._opened, job)[0])

    def __iter__(self) -> Iterator[SequenceRecord | dict]:
        for i in range(self.num_sequences):
            yield self.sequence(i)

    # ------------------------------------------------------------------ lifetime
    def __getstate__(self) -> dict[str, Any]:
        """A reader pickles as its configuration (e.g. for a ``DataLoader`` worker): the copy opens
        the store again."""
        return {
            "url": self._url,
            "storage_options": self._storage_options,
            "as_torch": self.as_torch,
            "decode_threads": self.decode_threads,
            "decoder": self._decoder.name,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        url, options = state.pop("url"), state.pop("storage_options")
        self.__init__(url, options, **state)  # type: ignore[misc]

    def close(self) -> None:
        """Stop the decode threads, if any (a later read starts them again)."""
        pool, self._decode_pool = self._decode_pool, None
        if pool is not None:
            pool.shutdown()

    def __enter__(self) -> CacheReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

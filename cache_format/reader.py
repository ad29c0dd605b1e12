"""Reading a cache: by sequence index, by key, by row range (FORMAT.md §6 "Reading").

A reader works on a snapshot: the manifest (commit point) read at open or at :meth:`refresh`.
It never reads past the snapshot's counts, so while a writer appends it sees a consistent
committed prefix. Reads only touch the chunks that hold the requested rows. A read that races
a writer's rewrite of a partly filled shard fails its CRC32C and is retried on a fresh snapshot;
a failure that persists is a :class:`~.errors.CorruptStoreError` (a :class:`~.errors.ChecksumError`
for bad bytes).

Row and token reads of the format's arrays go through :mod:`.shardread` (shard objects read
with few store requests and decoded straight into the output), arrays of any other layout
through zarr's array API (``direct=False`` forces zarr for all); both return the same values.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import zarr
from zarr.codecs import BloscCodec, ShardingCodec
from zarr.core.sync import sync

from . import fastdecode, idmap, pointread, procread, shardread, spec
from .errors import ChecksumError, CorruptStoreError, FormatError, StoreNotFoundError
from .integrity import checked_get
from .layout import array_defs, committed_lengths, parse_root, read_root_attrs, strict
from .manifest import Manifest
from .quant import OUT_DTYPES, decode_logprobs
from .records import RowBlock, SequenceRecord
from .store import open_store

#: Per span: top-k ids, logprobs, float32 tail, tokens (None for a row-only span), loss mask or
#: None (:meth:`CacheReader._fetch`).
_Fetched = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]

_T = TypeVar("_T")


def span_tokens(tokens: np.ndarray | None) -> np.ndarray:
    """The tokens of a sequence span of :meth:`CacheReader._fetch` (read with every sequence
    span; ``None`` only for a row-only span)."""
    assert tokens is not None
    return tokens


def _blockwise(stored: str, out: str) -> bool:
    """Whether logprobs stored as ``stored`` are decoded into ``out`` in row blocks with no
    dequantisation (float16 bits -> float16 or float32, float32 bits -> float32)."""
    return stored == "float16" or (stored == "float32" and out == "float32")


class _FastPlan:
    """What :meth:`CacheReader._fetch_fast` passes to :func:`.fastdecode.read_arrays` for one
    ``(logprob_dtype, tokens)`` (:meth:`CacheReader._fast_plan`): the arrays' layouts in the
    order ``topk_ids, topk_logprobs, tail_mass[, loss_mask][, input_ids]``."""

    __slots__ = ("lays", "root", "stored", "widen", "mask", "tokens", "row_arrays")

    def __init__(
        self,
        names: list[str],
        lays: list[shardread.DirectLayout],
        root: str,
        stored: np.dtype,
        widen: bool,
    ):
        self.lays, self.root, self.stored, self.widen = lays, root, stored, widen
        self.mask = spec.LOSS_MASK in names
        self.tokens = spec.INPUT_IDS in names
        self.row_arrays = len(names) - self.tokens


_RETRIES = 8  # raced reads: retried with backoff 10 ms .. 1.3 s (about 2.5 s in all)


def _with_retries(fn: Callable[[], _T], on_retry: Callable[[], None] | None = None) -> _T:
    """Run ``fn``; retry a raced read (bad checksum or bytes, I/O error) with backoff.

    Typed errors other than :class:`ChecksumError` are raised at once. Any other failure inside
    ``fn`` is the store's (the callers check their arguments before): retried, and if it persists
    a :class:`CorruptStoreError` (never an untyped exception).
    """
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


def _check_index(
    m: Manifest, known: int, lengths: np.ndarray, tok: np.ndarray, row: np.ndarray, t0: int, r0: int
) -> None:
    """The sequence index entries ``[known, S)`` must tile the committed tokens and rows exactly
    (R8): ``L_i >= 2``, starts are running sums from ``(t0, r0)`` (the end of the entries already
    loaded), the last sequence ends at ``num_tokens`` / ``num_rows``. So no read can reach past
    the committed counts (R6), whatever the index says."""
    lengths = lengths.astype(np.int64)
    if lengths.size and int(lengths.min()) < 2:
        raise CorruptStoreError("sequence index: a sequence length < 2")
    exp_tok = t0 + np.concatenate([[0], np.cumsum(lengths)[:-1]]) if lengths.size else lengths
    exp_row = r0 + np.concatenate([[0], np.cumsum(lengths - 1)[:-1]]) if lengths.size else lengths
    if not (np.array_equal(tok, exp_tok) and np.array_equal(row, exp_row)):
        bad = known + int(np.flatnonzero((tok != exp_tok) | (row != exp_row))[0])
        raise CorruptStoreError(f"sequence index: offsets of sequence {bad} break R8")
    end_t, end_r = t0 + int(lengths.sum()), r0 + int((lengths - 1).sum())
    if (end_t, end_r) != (m.num_tokens, m.num_rows):
        raise CorruptStoreError(
            f"sequence index ends at token {end_t}, row {end_r}; the commit counts "
            f"{m.num_tokens} tokens, {m.num_rows} rows"
        )


class CacheReader:
    """Read-only view of the committed part of a cache.

    ``as_torch=True`` makes :meth:`sequence`, :meth:`get`, :meth:`sequences` and :meth:`rows`
    return dicts of torch tensors (``record.to_torch()``) instead of numpy records.
    ``direct=False`` reads every array through zarr's array API instead of :mod:`.shardread`
    (same values, slower; for comparison and as an escape hatch).
    ``decode_threads > 1`` decodes the arrays of one read call (e.g. the sequences of one
    :meth:`sequences` call) in that many threads (blosc and the numpy kernels release the GIL);
    the values are the same.
    ``read_processes > 0`` spreads the rows of each :meth:`sequence` / :meth:`sequences` call
    over the calling process and that many reader processes (:mod:`.procread`: started at the
    first such call, each with its own GIL, decoding into shared memory the returned arrays
    are views of; same values); :meth:`close` (or ``with``) stops them.

    :meth:`sequence`, :meth:`get` and :meth:`sequences` take the point-read path
    (FORMAT.md D4) when every array they need is read directly: only the needed inner chunks,
    each decoded once per call (``os.pread`` on a local store). With numba installed the whole
    call is one compiled call per thread (:mod:`.fastdecode`; ``decode_threads > 1`` cuts a call
    at chunk edges, which pays for :meth:`sequences` batches); otherwise, and for what that path
    hands back, chunk by chunk (:mod:`.pointread`); the values are the same. Per chunk, with
    ``decode_threads > 1`` the chunks of a call are split over at most ``pointread.MAX_SHARES``
    threads in runs of at least ``pointread.PARALLEL_MIN_BYTES`` decoded (this pays for
    :meth:`sequences` batches and the default layout's large chunks). Random access is fastest on a
    store written with the ``random_access`` layout preset (``spec.LAYOUTS``, FORMAT.md 4.7), or
    ``random_access_raw`` (the same chunks uncompressed: nothing to decompress, about twice the
    bytes); :attr:`layout_name` says which one a store has.
    """

    def __init__(
        self,
        url: str | Path,
        storage_options: dict[str, Any] | None = None,
        *,
        as_torch: bool = False,
        direct: bool = True,
        decode_threads: int = 1,
        read_processes: int = 0,
    ):
        if decode_threads < 1:
            raise ValueError(f"decode_threads must be >= 1, got {decode_threads}")
        if read_processes < 0:
            raise ValueError(f"read_processes must be >= 0, got {read_processes}")
        self.decode_threads = int(decode_threads)
        self.read_processes = int(read_processes)
        self._procs: procread.ReadProcesses | None = None
        self._url, self._storage_options = str(url), storage_options
        self._decode_pool: ThreadPoolExecutor | None = None
        self._handle = open_store(url, storage_options, read_only=True)
        self._store = self._handle.zstore
        self.as_torch = as_torch
        self.direct = direct
        self._arrays: dict[str, zarr.Array] = {}
        self._direct: dict[str, shardread.DirectLayout] = {}
        self._local_root: str | None = None  # the local store directory of the direct arrays
        self._fast_plans: dict[tuple[str, bool], _FastPlan | None] = {}  # (see _fast_plan)
        self._keys: list[str] = []
        self._key_index: dict[str, int] = {}
        self._lengths = np.zeros(0, dtype=np.int32)
        self._tok_start = np.zeros(0, dtype=np.int64)
        self._row_start = np.zeros(0, dtype=np.int64)
        self._manifest: Manifest | None = None
        self._id_order: np.ndarray | None = None
        self.point_reads = True
        """Use the point-read path for :meth:`sequence` / :meth:`sequences` where it applies
        (``False``: the range path, same values; for comparison)."""
        self.refresh()

    # ------------------------------------------------------------------ snapshot
    def refresh(self) -> bool:
        """Adopt the latest commit; returns True if it changed. The index grows incrementally.

        A read that races a writer's shard rewrite (CRC32C mismatch, truncated object) is retried
        on a freshly read commit.
        """
        return _with_retries(self._refresh_once)

    def _refresh_once(self) -> bool:
        try:
            attrs = read_root_attrs(self._store)
        except Exception as e:  # store unreachable or unreadable
            raise FormatError(f"cannot read store {self._handle.url!r}: {e}") from e
        if attrs is None:
            raise StoreNotFoundError(f"no logitcache store at {self._handle.url!r}")
        m = parse_root(attrs)
        old = self._manifest
        if old is not None and m.generation == old.generation:
            return False
        if old is not None and (m.generation < old.generation or m.num_sequences < len(self._keys)):
            raise CorruptStoreError("store went backwards (generation or count decreased)")
        names = _array_names(m)
        try:
            arrays = {n: zarr.open_array(self._store, path=n, mode="r") for n in names}
        except (FileNotFoundError, zarr.errors.ArrayNotFoundError) as e:
            raise CorruptStoreError(f"store is missing an array: {e}") from e
        except Exception as e:  # damaged array metadata (zarr.json)
            raise CorruptStoreError(f"array metadata unreadable: {e!r}") from e
        need = committed_lengths(m)
        for n, a in arrays.items():
            if a.shape[0] < need[n]:
                raise CorruptStoreError(
                    f"array {n} has {a.shape[0]} entries, commit needs {need[n]}"
                )
        strict_ = strict(m)
        known = len(self._keys)
        s = m.num_sequences
        jobs = []
        if m.id_remap and m.num_rows and self._id_order is None:
            jobs.append((spec.ID_ORDER, 0, m.vocab_size))
        if s > known:
            jobs += [(n, known, s) for n in spec.SEQ_ARRAYS]

        async def gather() -> list[np.ndarray]:
            return await asyncio.gather(
                *(checked_get(arrays[n]._async_array, n, a, b, strict_) for n, a, b in jobs)
            )

        got = dict(zip([j[0] for j in jobs], sync(gather()), strict=True))
        if spec.ID_ORDER in got:
            order = np.asarray(got[spec.ID_ORDER])
            if not idmap.is_permutation(order, m.vocab_size):
                raise CorruptStoreError("id_order is not a permutation of the vocabulary")
            self._id_order = order
        new_keys = [str(x) for x in got.get(spec.SEQ_KEYS, [])]
        empty = np.zeros(0, dtype=np.int64)
        lengths = np.asarray(got.get(spec.SEQ_LENGTHS, empty))
        tok_start = np.asarray(got.get(spec.SEQ_TOKEN_START, empty))
        row_start = np.asarray(got.get(spec.SEQ_ROW_START, empty))
        t0 = int(self._tok_start[-1] + self._lengths[-1]) if known else 0
        r0 = int(self._row_start[-1] + self._lengths[-1] - 1) if known else 0
        _check_index(m, known, lengths, tok_start, row_start, t0, r0)
        self._set_arrays(arrays, need, strict_)
        if s > known:
            for i, key in enumerate(new_keys, start=known):  # every read done: now mutate
                self._key_index.setdefault(key, i)
            self._keys.extend(new_keys)
            self._lengths = np.concatenate([self._lengths, lengths])
            self._tok_start = np.concatenate([self._tok_start, tok_start])
            self._row_start = np.concatenate([self._row_start, row_start])
        self._manifest = m
        return True

    @property
    def manifest(self) -> Manifest:
        assert self._manifest is not None
        return self._manifest

    @property
    def url(self) -> str:
        return self._handle.url

    @property
    def layout_name(self) -> str:
        """The store's layout preset (FORMAT.md 4.7): its ``logitcache_layout`` attribute, else
        ``"default"`` if ``topk_ids`` has the default chunking and codecs, else ``"custom"``."""
        arr = self._arrays[spec.TOPK_IDS]
        name = arr.attrs.get(spec.LAYOUT_ATTR)
        if isinstance(name, str) and name:
            return name
        lay = self._direct.get(spec.TOPK_IDS) or shardread.direct_layout(arr)
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
        """Sequence keys in storage order (a copy)."""
        return list(self._keys)

    @property
    def lengths(self) -> np.ndarray:
        """Token counts ``L_i`` per sequence (``L_i - 1`` rows each)."""
        return self._lengths.copy()

    @property
    def row_starts(self) -> np.ndarray:
        """First global row of each sequence."""
        return self._row_start.copy()

    def __len__(self) -> int:
        return self.num_sequences

    def __contains__(self, key: object) -> bool:
        return key in self._key_index

    def index_of(self, key: str) -> int:
        """Sequence index of ``key`` (KeyError if absent)."""
        return self._key_index[key]

    # ------------------------------------------------------------------ reading
    def _retry(self, fn: Callable[[], _T]) -> _T:
        """Run ``fn``; on a checksum/decoding failure (raced rewrite) reopen the arrays, retry."""
        return _with_retries(fn, self._reopen_arrays)

    def _set_arrays(self, arrays: dict[str, zarr.Array], need: dict[str, int], st: bool) -> None:
        self._arrays = arrays
        self._need = need
        self._strict = st
        self._direct = {}
        if self.direct:
            for n, a in arrays.items():
                lay = shardread.direct_layout(a, n, committed=need[n], strict=st)
                if lay is not None:
                    self._direct[n] = lay
        ids = self._direct.get(spec.TOPK_IDS)
        self._local_root = None if ids is None else shardread.local_root(ids)
        self._fast_plans = {}

    def _reopen_arrays(self) -> None:
        self._set_arrays(
            {n: zarr.open_array(self._store, path=n, mode="r") for n in self._arrays_names()},
            self._need,
            self._strict,
        )

    def _arrays_names(self) -> list[str]:
        return _array_names(self.manifest)

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

    def _read(self, jobs: list[tuple[str, slice]]) -> list[np.ndarray]:
        """Stored values of ``array[sel]`` for each job, all I/O issued concurrently in one call
        into zarr's event loop (per-call overhead dominates small reads), then decoded here."""
        a, direct = self._arrays, self._direct
        for name, sel in jobs:  # R6: never past the committed count, whatever asked
            if not 0 <= sel.start <= sel.stop <= self._need[name]:
                raise CorruptStoreError(
                    f"read of {name}[{sel.start}:{sel.stop}] past the committed "
                    f"{self._need[name]} entries"
                )

        def io(name: str, sel: slice) -> Any:
            lay = direct.get(name)
            if lay is None:
                return checked_get(a[name]._async_array, name, sel.start, sel.stop, self._strict)
            return shardread.fetch(lay, sel.start, sel.stop)

        async def gather() -> list[Any]:
            return await asyncio.gather(*(io(n, sel) for n, sel in jobs))

        def decode(job: tuple[str, slice], got: Any) -> np.ndarray:
            name, sel = job
            lay = direct.get(name)
            if lay is None:
                return got
            block = lay.empty(sel.stop - sel.start)
            shardread.decode(lay, got, sel.start, sel.stop, block)
            return block

        fetched = sync(gather())
        if self.decode_threads > 1 and len(jobs) > 1:
            if self._decode_pool is None:
                self._decode_pool = ThreadPoolExecutor(self.decode_threads, "logitcache-decode")
            return list(self._decode_pool.map(decode, jobs, fetched))
        return [decode(job, got) for job, got in zip(jobs, fetched, strict=True)]

    def _fetch(
        self,
        spans: list[tuple[slice, slice | None]],
        logprob_dtype: str = "float32",
        *,
        point: bool = False,
        into: list[dict[str, np.ndarray]] | None = None,
    ) -> list[_Fetched]:
        """Read row ranges (and token ranges) of every span in one :meth:`_read` (``point``:
        through :meth:`_fetch_point` where every array is read directly).

        Returns per span ``(topk_ids, logprobs as logprob_dtype, float32 tail, tokens or None,
        loss mask or None)`` (the mask only in a ``loss_mask`` store, FORMAT.md 4.6).
        ``into`` (point reads): per span, output arrays to decode into where they fit
        (``"ids"``, ``"lp"``, ``"tail"``, ``"mask"``, ``"tokens"``; see :mod:`.procread`); the
        returned arrays are those where they were used.
        """
        if logprob_dtype not in OUT_DTYPES:
            raise ValueError(f"logprob_dtype must be one of {OUT_DTYPES}, got {logprob_dtype!r}")
        if point and self.point_reads and fastdecode.AVAILABLE:
            tokens = spans[0][1] is not None or any(t is not None for _, t in spans)
            key = (logprob_dtype, tokens)
            plan = self._fast_plans[key] if key in self._fast_plans else self._fast_plan(*key)
            if plan is not None and fastdecode.ready():
                # The compiled read decodes into its own arena even when ``into`` is given: a
                # reader process (procread) copies it out, which costs less than the per-chunk
                # path decoding in place (benchmarks/results/client.md, session 9).
                fast = self._fetch_fast(spans, plan)
                if fast is not None:
                    return fast
        dtype = self.manifest.logprob_dtype
        names = [spec.TOPK_IDS, spec.TOPK_LOGPROBS, spec.TAIL_MASS]
        if dtype in spec.QUANTISED_DTYPES:
            names += [spec.LOGPROB_MAX, spec.LOGPROB_STEP]
        if self.manifest.loss_mask:
            names.append(spec.LOSS_MASK)
        if point and self.point_reads:
            wanted = [*names, *([spec.INPUT_IDS] if any(t for _, t in spans) else [])]
            if all(n in self._direct for n in wanted):
                return self._fetch_point(spans, names, logprob_dtype, into)
        jobs = []
        for rows, toks in spans:
            jobs += [(n, rows) for n in names]
            if toks is not None:
                jobs.append((spec.INPUT_IDS, toks))
        results = iter(self._read(jobs))
        out = []
        for _rows, toks in spans:
            got = {n: next(results) for n in names}
            if toks is not None:
                got[spec.INPUT_IDS] = next(results)
            ids = got[spec.TOPK_IDS]
            if self._id_order is not None:
                ids = self._id_order[ids]
            lp = decode_logprobs(
                got[spec.TOPK_LOGPROBS],
                dtype,
                got.get(spec.LOGPROB_MAX),
                got.get(spec.LOGPROB_STEP),
                out_dtype=logprob_dtype,
                in_place=True,
            )
            tail = np.asarray(got[spec.TAIL_MASS], dtype=np.float32)
            mask = got.get(spec.LOSS_MASK)
            out.append((ids, lp, tail, got.get(spec.INPUT_IDS), mask))
        return out

    def _pool(self) -> ThreadPoolExecutor | None:
        if self.decode_threads <= 1:
            return None
        if self._decode_pool is None:
            self._decode_pool = ThreadPoolExecutor(self.decode_threads, "logitcache-decode")
        return self._decode_pool

    def _fetch_point(
        self,
        spans: list[tuple[slice, slice | None]],
        names: list[str],
        logprob_dtype: str,
        into: list[dict[str, np.ndarray]] | None = None,
    ) -> list[_Fetched]:
        """:meth:`_fetch` through :mod:`.pointread` (FORMAT.md D4): each needed chunk decoded
        once, then the logprobs (and id remap) in row blocks, on the decode pool if any."""
        dtype = self.manifest.logprob_dtype
        blockwise = _blockwise(dtype, logprob_dtype)
        jobs: list[pointread.Job] = []
        dest: list[np.ndarray | None] = []
        slot = {spec.TOPK_IDS: "ids", spec.TAIL_MASS: "tail", spec.LOSS_MASK: "mask"}
        for s, (rows, toks) in enumerate(spans):
            jobs += [(n, rows.start, rows.stop) for n in names]
            if toks is not None:
                jobs.append((spec.INPUT_IDS, toks.start, toks.stop))
            if into is None:
                continue
            want = into[s]
            for n in names:
                x = want.get(slot.get(n, ""))
                if n == spec.TOPK_LOGPROBS and blockwise and dtype == logprob_dtype:
                    x = want.get("lp")  # the stored bits, decoded in place
                    x = (
                        None
                        if x is None
                        else x.view(np.uint16 if dtype == "float16" else np.uint32)
                    )
                dest.append(x)
            if toks is not None:
                dest.append(want.get("tokens"))
        pool, threads = self._pool(), self.decode_threads
        results = iter(pointread.read(self._direct, jobs, pool, threads, dest if into else None))
        out: list[_Fetched] = []
        tasks: list[Callable[[], None]] = []
        cost: list[int] = []
        order = self._id_order
        for s, (_rows, toks) in enumerate(spans):
            got = {n: next(results) for n in names}
            tokens = next(results) if toks is not None else None
            ids, d = got[spec.TOPK_IDS], got[spec.TOPK_LOGPROBS]
            if blockwise:
                lp = d.view(np.float16 if dtype == "float16" else np.float32)
                if dtype == "float16" and logprob_dtype == "float32":
                    given = into[s].get("lp") if into is not None else None
                    if given is None or given.shape != d.shape or given.dtype != np.float32:
                        given = np.empty(d.shape, dtype=np.float32)
                    lp = given
                for a, b in pointread.row_blocks(d.shape[0], d.shape[1]):
                    tasks.append(_lp_task(d[a:b], lp[a:b], ids[a:b], order))
                    cost.append((b - a) * d.shape[1] * 6)  # bytes read + written
            else:
                if order is not None:
                    ids = order[ids]
                lp = decode_logprobs(
                    d,
                    dtype,
                    got.get(spec.LOGPROB_MAX),
                    got.get(spec.LOGPROB_STEP),
                    out_dtype=logprob_dtype,
                    in_place=True,
                )
            tail = np.asarray(got[spec.TAIL_MASS], dtype=np.float32)
            out.append((ids, lp, tail, tokens, got.get(spec.LOSS_MASK)))
        pointread.run_tasks(tasks, cost, pool, threads)
        return out

    def _fast_plan(self, logprob_dtype: str, tokens: bool) -> _FastPlan | None:
        """The compiled read's arguments for reads of ``logprob_dtype`` (with ``tokens``: and
        ``input_ids``), made once per set of arrays; ``None`` where it does not apply (a remote
        store, an array not read directly, quantised logprobs, float32 stored read as float16):
        the per-chunk path reads those."""
        m = self.manifest
        names = [spec.TOPK_IDS, spec.TOPK_LOGPROBS, spec.TAIL_MASS]
        if m.loss_mask:
            names.append(spec.LOSS_MASK)
        if tokens:
            names.append(spec.INPUT_IDS)
        plan = None
        if (
            self._local_root is not None
            and _blockwise(m.logprob_dtype, logprob_dtype)
            and all(n in self._direct for n in names)
        ):
            plan = _FastPlan(
                names,
                [self._direct[n] for n in names],
                self._local_root,
                np.dtype(m.logprob_dtype),
                m.logprob_dtype == "float16" and logprob_dtype == "float32",
            )
        self._fast_plans[(logprob_dtype, tokens)] = plan
        return plan

    def _fetch_fast(
        self, spans: list[tuple[slice, slice | None]], plan: _FastPlan
    ) -> list[_Fetched] | None:
        """:meth:`_fetch` through :mod:`.fastdecode` (one compiled call; the records are views of
        one block per array), or ``None``: read it per chunk instead (also every span the
        per-chunk path refuses: out of order, or past the committed count, R6)."""
        rows = [(r.start, r.stop) for r, _ in spans]
        bounds = [rows] * plan.row_arrays
        if plan.tokens:
            bounds.append([(0, 0) if t is None else (t.start, t.stop) for _, t in spans])
        for jobs, lay in zip(bounds, plan.lays, strict=True):
            for st, sp in jobs:
                if st < 0 or sp < st or sp > lay.length:
                    return None
        lp = (1, plan.widen)  # spec.TOPK_LOGPROBS is the plan's second array
        got = fastdecode.read_arrays(
            plan.lays, plan.root, bounds, lp, self._pool(), self.decode_threads
        )
        if got is None:
            return None
        blocks, widened = got
        ids = blocks[0]
        tail = np.asarray(blocks[2], dtype=np.float32)  # stored float16 in some caches
        if self._id_order is not None:
            np.take(self._id_order, ids, out=ids)
        lp_all = widened if widened is not None else blocks[1].view(plan.stored)
        mask = blocks[3] if plan.mask else None
        tokens = blocks[-1] if plan.tokens else None
        out: list[_Fetched] = []
        r = t = 0
        for rs, ts in spans:
            n = rs.stop - rs.start
            tok = None
            if ts is not None and tokens is not None:
                tok = tokens[t : t + ts.stop - ts.start]
                t += ts.stop - ts.start
            m = None if mask is None else mask[r : r + n]
            out.append((ids[r : r + n], lp_all[r : r + n], tail[r : r + n], tok, m))
            r += n
        return out

    def _out(self, rec: SequenceRecord | RowBlock) -> Any:
        return rec.to_torch() if self.as_torch else rec

    def sequence(self, i: int, *, logprob_dtype: str = "float32") -> SequenceRecord | dict:
        """Sequence ``i`` (storage order) as a :class:`SequenceRecord`; ``logprob_dtype`` as in
        :meth:`rows`."""
        return self._out(self._records([self._check_seq(i)], logprob_dtype)[0])

    def get(self, key: str) -> SequenceRecord | dict:
        """The sequence stored under ``key`` (KeyError if absent)."""
        if key not in self._key_index:
            raise KeyError(key)
        return self.sequence(self._key_index[key])

    def _span(self, i: int) -> tuple[slice, slice]:
        t0, r0, n = int(self._tok_start[i]), int(self._row_start[i]), int(self._lengths[i])
        return slice(r0, r0 + n - 1), slice(t0, t0 + n)

    def sequences(self, indices: Sequence[int], *, logprob_dtype: str = "float32") -> list:
        """Several sequences (any order, repeats allowed) in one read: every inner chunk they
        need is fetched and decoded once (point reads, FORMAT.md D4)."""
        idx = [self._check_seq(i) for i in indices]
        if not idx:
            return []
        return [self._out(rec) for rec in self._records(idx, logprob_dtype)]

    def _records(self, idx: list[int], logprob_dtype: str) -> list[SequenceRecord]:
        """Records of sequences ``idx`` (checked indices) in one read: over the reader processes
        when there are any and the call splits, else in this process (with retries)."""
        if self._use_processes():
            got = self._proc_records(idx, logprob_dtype)
            if got is not None:
                return got

        def read() -> list[SequenceRecord]:
            got = self._fetch([self._span(i) for i in idx], logprob_dtype, point=True)
            keys = self._keys
            return [
                SequenceRecord.trusted(keys[i], span_tokens(tokens), ids, lp, tail, mask)
                for i, (ids, lp, tail, tokens, mask) in zip(idx, got, strict=True)
            ]

        return self._retry(read)

    def _use_processes(self) -> bool:
        return self.read_processes > 0 and self.point_reads and spec.TOPK_IDS in self._direct

    def _proc_records(self, idx: list[int], logprob_dtype: str) -> list[SequenceRecord] | None:
        """Records of sequences ``idx`` read by the reader processes (:mod:`.procread`); ``None``
        for a call that makes one piece (read in this process)."""
        if logprob_dtype not in OUT_DTYPES:
            raise ValueError(f"logprob_dtype must be one of {OUT_DTYPES}, got {logprob_dtype!r}")
        spans = []
        for i in idx:
            (rows, toks) = self._span(i)
            spans.append((rows.start, rows.stop, toks.start, toks.stop))
        cr = self._direct[spec.TOPK_IDS].chunk_rows
        groups = procread.cut(spans, self.read_processes + 1, cr)  # the caller takes a share
        if len(groups) <= 1:
            return None
        if self._procs is not None and self._procs.pid != os.getpid():
            self._procs = None  # a forked copy of the reader: the processes are the parent's
        if self._procs is None:
            self._procs = procread.ReadProcesses(
                self._url, self._storage_options, self.read_processes
            )
        m = self.manifest
        buf, reg = self._procs.read(
            spans, m.k, m.num_rows, m.num_tokens, logprob_dtype, m.loss_mask, groups, self
        )
        ids, lp, tail, mask, tok = reg.views(buf)
        out, r, t = [], 0, 0
        for i, (a, b, ta, tb) in zip(idx, spans, strict=True):
            n, nt = b - a, tb - ta
            rec = SequenceRecord.trusted(
                self._keys[i],
                tok[t : t + nt],
                ids[r : r + n],
                lp[r : r + n],
                tail[r : r + n],
                None if mask is None else mask[r : r + n],
            )
            out.append(rec)
            r, t = r + n, t + nt
        return out

    def __getstate__(self) -> dict[str, Any]:
        """A reader pickles as its configuration (e.g. to reach a ``DataLoader`` worker): the
        copy opens the store again (its latest commit at unpickling) and starts its own reader
        processes at its first point read; the original's processes, decode pool and open
        files stay the original's."""
        return {
            "url": self._url,
            "storage_options": self._storage_options,
            "as_torch": self.as_torch,
            "direct": self.direct,
            "decode_threads": self.decode_threads,
            "read_processes": self.read_processes,
            "point_reads": self.point_reads,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        point_reads = bool(state.pop("point_reads", True))
        url, options = state.pop("url"), state.pop("storage_options")
        self.__init__(url, options, **state)  # type: ignore[misc]
        self.point_reads = point_reads

    def close(self) -> None:
        """Stop the reader processes, if any (the reader stays usable: a later call starts
        them again)."""
        procs, self._procs = self._procs, None
        if procs is not None and procs.pid == os.getpid():
            procs.close()

    def __enter__(self) -> CacheReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def rows(self, start: int, stop: int, *, logprob_dtype: str = "float32") -> RowBlock | dict:
        """Global rows ``[start, stop)`` (they may span sequences; see :attr:`row_starts`).

        ``logprob_dtype="float32"`` (default): logprobs decoded to float32 (FORMAT.md D3).
        ``"float16"``: for a float16 store the stored values themselves (exact, no widening, the
        fastest read); for other encodings the float32 values rounded to float16.
        """
        n = self.num_rows
        if not (0 <= start <= stop <= n):
            raise IndexError(f"row range [{start}, {stop}) outside [0, {n})")

        def read() -> RowBlock:
            ids, lp, tail, _, mask = self._fetch([(slice(start, stop), None)], logprob_dtype)[0]
            return RowBlock(start, ids, lp, tail, mask)

        return self._out(self._retry(read))

    def read_ranges(
        self, ranges: Sequence[tuple[int, int]], *, logprob_dtype: str = "float32"
    ) -> list[SequenceRecord]:
        """Records of sequence ranges ``[(a, b), ...]``, two reads per range (:mod:`.ranges`)."""
        from .ranges import read_ranges

        return read_ranges(self, ranges, logprob_dtype=logprob_dtype)

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Global input-token range ``[start, stop)`` of the flat ``input_ids`` array."""
        if not (0 <= start <= stop <= self.num_tokens):
            raise IndexError(f"token range [{start}, {stop}) outside [0, {self.num_tokens})")
        return self._retry(lambda: self._read([(spec.INPUT_IDS, slice(start, stop))])[0])

    def __iter__(self) -> Iterator[SequenceRecord | dict]:
        for i in range(self.num_sequences):
            yield self.sequence(i)


def _lp_task(
    d: np.ndarray, lp: np.ndarray, ids: np.ndarray, order: np.ndarray | None
) -> Callable[[], None]:
    """One row block of a point read: the row-delta inverse of the stored logprob bits ``d``
    (in place), widened into ``lp`` if that is a float32 view of other memory (float16 store),
    and the id remap of ``ids`` (in place) when the store has one."""

    def task() -> None:
        pointread.undelta_block(d)
        if lp.dtype == np.float32 and d.dtype == np.uint16:
            pointread.widen_block(d.view(np.float16), lp)
        if order is not None:
            np.take(order, ids, out=ids)

    return task

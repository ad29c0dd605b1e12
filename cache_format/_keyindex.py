"""The keys of a store's committed sequences, read on demand (FORMAT.md §6, R3); no Python string
is held per sequence.

:meth:`KeyTable.key` reads the ``seq_keys`` block that holds a key (a few recent blocks kept);
:meth:`KeyTable.find` / :meth:`KeyTable.find_many` look keys up in a sorted array of 64-bit
hashes of their UTF-8 bytes (:func:`byte_hashes`), built at the first lookup and grown by the
keys committed since, a match confirmed against the stored key. A store with an on-disk key
index (:mod:`._keyruns`) is looked up there instead (:meth:`KeyTable.use_runs`). Keys never
change once committed, so nothing read here goes stale."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from . import fastencode, spec
from ._keyruns import KeyRuns, RunRef
from .errors import CorruptStoreError

if TYPE_CHECKING:
    from ._manifest import Manifest

#: ``read(a, b)``: the stored keys ``[a, b)`` (committed): an array of strings.
ReadKeys = Callable[[int, int], np.ndarray]
#: ``read_bytes(a, b)``: the UTF-8 bytes of stored keys ``[a, b)`` back to back (uint8) and
#: where each ends in them (int64); ``None`` where the store keeps no key bytes (version 1).
ReadKeyBytes = Callable[[int, int], tuple[np.ndarray, np.ndarray] | None]

BLOCK = 16384  # keys per cached block: the default seq_keys inner chunk (FORMAT.md 4)
KEEP_BLOCKS = 8  # blocks kept for key(i): about 8 x 16384 strings
HASH_BLOCK = 262144  # keys read per step while hashing: the default seq_keys shard
RECENT = 65536  # keys added by add() kept in a dict until merged into the sorted arrays


_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_SEED = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (wrapping)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def byte_hashes(buf: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """64-bit hashes (int64) of the non-empty byte strings ``buf[ends[i-1]:ends[i]]``: each byte
    plus one times an odd weight per position in the key, summed, mixed with the length
    (vectorised)."""
    if not len(ends):
        return np.zeros(0, np.int64)
    starts = np.zeros(len(ends), np.int64)
    starts[1:] = ends[:-1]
    lens = ends - starts
    weights = _mix(np.arange(int(lens.max()), dtype=np.uint64) + _SEED) | np.uint64(1)
    sums = fastencode.key_sums(buf, ends, weights)
    if sums is None:
        sums = key_sums_numpy(buf, starts, lens, weights)
    return _mix(sums ^ (lens.astype(np.uint64) * _SEED)).view(np.int64)


def key_sums_numpy(
    buf: np.ndarray, starts: np.ndarray, lens: np.ndarray, weights: np.ndarray
) -> np.ndarray:
    """The weighted byte sums of :func:`byte_hashes` (uint64, wrapping) with numpy: the keys
    ``buf[starts[i]:starts[i] + lens[i]]`` back to back, ``weights`` by position in a key.
    :func:`.fastencode.key_sums` gives the same in one compiled pass where it is loaded.
    Keys of one length from ``buf``'s start (a writer's keys, often) are one ``[n, L]`` matrix
    product: ``sum((b + 1) * w) = sum(b * w) + sum(w)``."""
    n = len(lens)
    width = int(lens[0]) if n else 0
    if (
        width
        and int(starts[0]) == 0
        and int(starts[-1]) == (n - 1) * width
        and lens.min() == lens.max()
    ):
        w = weights[:width]
        rows = buf[: n * width].reshape(n, width).astype(np.uint64)
        return rows @ w + np.cumsum(w, dtype=np.uint64)[-1]  # wrapping, as the general form
    pos = np.arange(len(buf), dtype=np.int64) - np.repeat(starts, lens)
    return np.add.reduceat((buf.astype(np.uint64) + np.uint64(1)) * weights[pos], starts)


def hashes_of(keys: Sequence[str] | np.ndarray) -> np.ndarray:
    """:func:`byte_hashes` of ``keys``' UTF-8 bytes (an empty key, which no store holds, hashes
    as one zero byte)."""
    ks = [str(k) or "\0" for k in keys]
    raw = "".join(ks).encode("utf-8", "surrogatepass")
    return byte_hashes(np.frombuffer(raw, np.uint8), np.cumsum(utf8_lengths(ks, raw)))


def utf8_lengths(keys: Sequence[str], raw: bytes, errors: str = "surrogatepass") -> np.ndarray:
    """The byte length of each key's UTF-8 form (int64); ``raw``: all of them joined."""
    if len(raw) == sum(map(len, keys)):  # ASCII: one byte per character
        return np.fromiter(map(len, keys), np.int64, len(keys))
    return np.fromiter((len(k.encode("utf-8", errors)) for k in keys), np.int64, len(keys))


#: ``fetch(jobs)``: the stored values of ``name[a:b]`` for each ``(name, a, b)`` (committed).
Fetch = Callable[[list[tuple[str, int, int]]], list[np.ndarray]]


def stored_key_bytes(
    fetch: Fetch, a: int, b: int, committed_bytes: int
) -> tuple[np.ndarray, np.ndarray]:
    """The UTF-8 bytes of committed keys ``[a, b)`` from ``seq_key_bytes`` and ``seq_key_end``
    (FORMAT.md 4, "Keys as bytes"; ``a < b``) and where each ends in them (checked: increasing,
    within the ``committed_bytes``)."""
    lo = max(a - 1, 0)
    ends = fetch([(spec.SEQ_KEY_END, lo, b)])[0].astype(np.int64)
    b0 = int(ends[0]) if a > 0 else 0
    ends = ends[1:] if a > 0 else ends
    if int(ends[-1]) > committed_bytes or bool(np.any(np.diff(ends) <= 0)) or int(ends[0]) <= b0:
        raise CorruptStoreError(
            f"seq_key_end[{a}:{b}] is not increasing within the {committed_bytes} committed key "
            "bytes"
        )
    buf = fetch([(spec.SEQ_KEY_BYTES, b0, int(ends[-1]))])[0]
    return buf.astype(np.uint8, copy=False), ends - b0


class KeyTable:
    """Keys ``[0, n)`` of a store, read by ``read`` on demand; thread-safe. Callers pass their
    snapshot's count, which may be below what the table has hashed."""

    def __init__(self, read: ReadKeys, read_bytes: ReadKeyBytes | None = None) -> None:
        self._read, self._read_bytes = read, read_bytes
        self._lock = threading.RLock()
        self._blocks: OrderedDict[int, np.ndarray] = OrderedDict()
        self._hashed = 0  # keys [0, _hashed) are in the sorted arrays
        self._sorted: np.ndarray = np.zeros(0, np.int64)  # hashes, ascending
        self._where: np.ndarray = np.zeros(0, np.uint32)  # the sequence of each hash
        self._recent: dict[str, int] = {}  # added keys [_hashed - len, _hashed), not yet merged
        self._runs: KeyRuns | None = None

    @property
    def runs(self) -> KeyRuns | None:
        return self._runs

    def use_runs(self, runs: KeyRuns | None) -> None:
        """Look keys up in the on-disk index ``runs`` (those of the newest commit known; a
        lookup among fewer sequences filters them); ``None``: hash the stored keys."""
        self._runs = runs

    def wrote(self, run: tuple[RunRef, bytes] | None) -> None:
        """Keep run ``(ref, object)`` that this process has just committed
        (:meth:`KeyRuns.wrote`); ``None`` (no key index): nothing to keep."""
        if run is not None and self._runs is not None:
            self._runs.wrote(*run)

    def _indexed(self, n: int) -> KeyRuns | None:
        runs = self._runs
        return runs if runs is not None and runs.covered >= n else None

    def _confirm(self, key: str, seqs: list[int], n: int) -> int | None:
        for i in seqs:  # ascending: the first sequence first
            if i < n and self.key(i, n) == key:
                return i
        return None

    @property
    def hashed(self) -> int:
        """How many keys the lookup arrays hold (0 until the first lookup)."""
        return self._hashed

    def key(self, i: int, n: int) -> str:
        """Key ``i`` of a snapshot of ``n`` committed keys (``0 <= i < n``)."""
        a = i - i % BLOCK
        with self._lock:
            block = self._blocks.get(a)
            if block is None or i - a >= len(block):
                block = self._read(a, min(n, a + BLOCK))
                self._blocks[a] = block
                while len(self._blocks) > KEEP_BLOCKS:
                    self._blocks.popitem(last=False)
            self._blocks.move_to_end(a)
            return str(block[i - a])

    def keys(self, n: int) -> Iterator[str]:
        """Keys ``[0, n)`` in order, read block by block (none kept)."""
        for a in range(0, n, HASH_BLOCK):
            yield from (str(k) for k in self._read(a, min(n, a + HASH_BLOCK)))

    def grow(self, n: int) -> None:
        """Hash keys ``[hashed, n)`` into the lookup arrays (read block by block)."""
        with self._lock:
            a = self._hashed
            parts = [
                self._stored_hashes(b, min(n, b + HASH_BLOCK)) for b in range(a, n, HASH_BLOCK)
            ]
            if parts:
                self._flush()
                self._merge(np.concatenate(parts), a)

    def sorted_hashes(self) -> tuple[np.ndarray, np.ndarray]:
        """The hashes of the keys hashed so far, ascending, and their sequences (int64)."""
        with self._lock:
            self._flush()
            return self._sorted.copy(), self._where.astype(np.int64)

    def _stored_hashes(self, a: int, b: int) -> np.ndarray:
        got = None if self._read_bytes is None else self._read_bytes(a, b)
        return hashes_of(self._read(a, b)) if got is None else byte_hashes(*got)

    def add(self, keys: Sequence[str] | np.ndarray, start: int) -> None:
        """Hash ``keys``, the committed keys ``[start, start + len(keys))``, into the lookup
        arrays when they hold keys ``[0, start)`` (else the keys are hashed at the next lookup,
        read from the store). Small additions wait in a dict (merged every :data:`RECENT`
        keys: a writer's append costs O(batch), not O(sequences))."""
        with self._lock:
            if start != self._hashed or self._runs is not None:
                return
            for i, key in enumerate(keys, start):
                self._recent.setdefault(str(key), i)
            self._hashed = start + len(keys)
            if len(self._recent) > RECENT:
                self._flush()

    def _flush(self) -> None:
        """Merge the dict of added keys into the sorted arrays."""
        if self._recent:
            recent, end = self._recent, self._hashed
            self._recent = {}
            self._merge(hashes_of(list(recent)), np.fromiter(recent.values(), np.int64), end)

    def _merge(self, h: np.ndarray, where: np.ndarray | int, end: int | None = None) -> None:
        """Merge hashes ``h`` of sequences ``where`` (an array; or the first of consecutive
        ones) into the sorted arrays, which then hold keys ``[0, end)``."""
        order = np.argsort(h)
        if isinstance(where, int):
            end, at = where + len(h), order + where
        else:
            at = where[order]
        assert end is not None
        dtype = self._where.dtype if end <= np.iinfo(np.uint32).max else np.dtype(np.int64)
        h, at = h[order], at.astype(dtype)
        if not len(self._sorted):  # the first build: nothing to merge into
            self._sorted, self._where = h, at
        else:
            pos = np.searchsorted(self._sorted, h)
            self._sorted = np.insert(self._sorted, pos, h)
            self._where = np.insert(self._where.astype(dtype, copy=False), pos, at)
        self._hashed = end

    def _confirmed(self, key: str, lo: int, hi: int, n: int) -> int | None:
        for i in sorted(self._where[lo:hi].tolist()):  # the first sequence first
            if i < n and self.key(i, n) == key:
                return int(i)
        return None

    def find(self, key: str, n: int) -> int | None:
        """The first of sequences ``[0, n)`` stored under ``key``, or ``None``."""
        runs = self._indexed(n)
        if runs is not None:
            return self._confirm(key, runs.candidates(hashes_of([key]))[0], n)
        with self._lock:
            self.grow(n)
            h = int(hashes_of([key])[0])
            lo = int(np.searchsorted(self._sorted, h, side="left"))
            hi = int(np.searchsorted(self._sorted, h, side="right"))
            got = None if lo == hi else self._confirmed(key, lo, hi, n)
            if got is None:  # added later than every key of the arrays
                i = self._recent.get(key)
                got = i if i is not None and i < n else None
            return got

    def find_many(
        self,
        keys: Sequence[str],
        n: int,
        hashes: np.ndarray | None = None,
        order: np.ndarray | None = None,
    ) -> np.ndarray:
        """Whether each of ``keys`` is stored among sequences ``[0, n)`` (bool array); ``hashes``
        (their :func:`hashes_of`) and ``order`` (sorting them) where the caller has them."""
        h = hashes_of(keys) if hashes is None else hashes
        out = np.zeros(len(keys), dtype=bool)
        runs = self._indexed(n)
        if runs is not None:
            if not len(keys):
                return out
            which, seqs = runs.matches(h, order)
            for at in np.lexsort((seqs, which)).tolist():
                i, s = int(which[at]), int(seqs[at])
                if not out[i] and s < n and self.key(s, n) == keys[i]:  # hash seen: confirm
                    out[i] = True  # against the store, the first sequence first
            return out
        with self._lock:
            self.grow(n)
            lo = np.searchsorted(self._sorted, h, side="left")
            hi = np.searchsorted(self._sorted, h, side="right")
            for j in np.flatnonzero(hi > lo).tolist():  # hash seen: confirm against the store
                out[j] = self._confirmed(keys[j], int(lo[j]), int(hi[j]), n) is not None
            if self._recent:
                recent = self._recent
                for j, key in enumerate(keys):
                    out[j] = out[j] or recent.get(key, n) < n
            return out


def latest_runs(store: Any) -> list[RunRef]:
    """The key index runs of the store's latest commit (``[]`` if it has none)."""
    from .layout import parse_root, read_root_attrs

    attrs = read_root_attrs(store)
    if attrs is None:
        raise CorruptStoreError("store root disappeared")
    return parse_root(attrs).runs() or []


def follow_runs(table: KeyTable, store: Any, m: Manifest) -> None:
    """Make ``table`` look keys up in the on-disk index of commit ``m`` (if it has one)."""
    runs = m.runs()
    old = table.runs
    if runs is None:
        table.use_runs(None)
    elif old is None:
        table.use_runs(KeyRuns(store, runs, partial(latest_runs, store)))
    else:
        old.update(runs)

"""The committed sequence index a reader works on (FORMAT.md §6, D1, R6, R8): a frozen snapshot
of one commit's counts, its index blocks read on demand, and a view of the keys
(:mod:`._keyindex`).

An index block is ``seq_lengths[a:b]`` of :data:`BLOCK` sequences with ``seq_row_start[a]``: a
point lookup reads one block. A block is checked when read (every length ``>= 2``, its rows
ending where the next block's start) and kept compactly; :data:`KEEP_BLOCKS` blocks are kept
(least recently used dropped), shared by the snapshots of one reader. The whole index
(:attr:`IndexSnapshot.lengths`) is read only when asked for."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import overload

import numpy as np

from ._keyindex import KeyTable
from ._manifest import Manifest
from .errors import CorruptStoreError

STEP = 64  # sequences per kept first row (row starts in between are summed from the lengths)
BLOCK = 16384  # sequences per index block: the default seq_lengths inner chunk (FORMAT.md 4)
KEEP_BLOCKS = 1024  # blocks kept: ~16.8M sequences, at most ~36 MB
WHOLE_BLOCK = 1 << 16  # entries read per step when the whole index is read

#: ``read(a, b, upto)``: committed ``seq_lengths[a:b]``, ``seq_row_start[a]`` and, when
#: ``upto`` (``b`` below the count), ``seq_row_start[b]`` (else ``None``).
ReadBlock = Callable[[int, int, bool], tuple[np.ndarray, int, int | None]]
#: ``read(a, b)``: committed ``seq_lengths[a:b]``.
ReadLengths = Callable[[int, int], np.ndarray]

#: ``(sequence, rows, tokens)``: where sequence ``i``'s rows and tokens lie in a span's arrays.
Piece = tuple[int, slice, slice]


def _frozen(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


@dataclass(frozen=True)
class _Block:
    """Index entries ``[first, first + len(lengths))``: lengths and the first row of every
    :data:`STEP`-th of them."""

    first: int
    lengths: np.ndarray
    checkpoints: np.ndarray

    def row_start(self, i: int) -> int:
        j = i - self.first
        c = j - j % STEP
        return int(self.checkpoints[j // STEP]) + int(self.lengths[c:j].sum()) - (j - c)


class IndexBlocks:
    """The index blocks of one reader's store, read by ``read_block`` (point lookups) and
    ``read_lengths`` (the whole index) and kept in a bounded LRU; thread-safe."""

    def __init__(self, read_block: ReadBlock, read_lengths: ReadLengths) -> None:
        self.read_block, self.read_lengths = read_block, read_lengths
        self._kept: OrderedDict[tuple[int, int], _Block] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._kept)

    def get(self, a: int, b: int, n: int, num_rows: int, read: ReadBlock | None = None) -> _Block:
        """Block ``[a, b)`` of a snapshot of ``n`` sequences and ``num_rows`` rows (read with
        ``read``, default :attr:`read_block`, and checked if not kept)."""
        with self._lock:
            got = self._kept.get((a, b))
            if got is not None:
                self._kept.move_to_end((a, b))
                return got
        got = _checked_block(a, b, n, num_rows, *(read or self.read_block)(a, b, b < n))
        with self._lock:
            self._kept[(a, b)] = got
            while len(self._kept) > KEEP_BLOCKS:
                self._kept.popitem(last=False)
        return got


def _checked_block(
    a: int, b: int, n: int, num_rows: int, ln: np.ndarray, r0: int, r1: int | None
) -> _Block:
    """Block ``[a, b)`` from its stored values, checked (R8; R6: it ends at the next block's
    first row, the last block at the commit's row count)."""
    if len(ln) != b - a:
        raise CorruptStoreError(f"sequence index: {len(ln)} lengths read for [{a}, {b})")
    ln = check_lengths(a, ln)
    end = r0 + int(ln.sum(dtype=np.int64)) - len(ln)
    want = num_rows if r1 is None else r1
    if (a == 0 and r0 != 0) or not 0 <= r0 <= end <= num_rows or end != want:
        where = "the commit counts" if r1 is None else f"seq_row_start[{b}] is"
        raise CorruptStoreError(
            f"sequence index: seq_row_start[{a}] = {r0} and the lengths of [{a}, {b}) end at "
            f"row {end}; {where} {want} rows"
        )
    rows = np.zeros(len(ln), np.int64)
    np.cumsum(ln[:-1] - 1, dtype=np.int64, out=rows[1:])
    return _Block(a, _frozen(ln), _frozen(rows[::STEP] + r0))


class SnapshotKeys(Sequence[str]):
    """The keys of a snapshot's ``n`` sequences, read from the store when asked for (a key by
    index reads its block; iterating reads them all, block by block, keeping none)."""

    def __init__(self, table: KeyTable, n: int) -> None:
        self._table, self._n = table, n

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...
    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        j = int(i) + self._n if int(i) < 0 else int(i)
        if not 0 <= j < self._n:
            raise IndexError(f"key index {i} out of range [0, {self._n})")
        return self._table.key(j, self._n)

    def __iter__(self) -> Iterator[str]:
        return self._table.keys(self._n)


@dataclass(frozen=True)
class IndexSnapshot:
    """The sequence index of one commit of ``n`` sequences: sequence ``i`` is ``keys[i]``,
    :meth:`length` tokens from token :meth:`token_start` and ``length - 1`` rows from
    :meth:`row_start`, read from ``blocks`` on demand. Keys are looked up in ``table``, shared
    with later snapshots (it may know keys of a later one: lookups pass this snapshot's count)."""

    n: int
    num_rows: int
    num_tokens: int
    table: KeyTable
    blocks: IndexBlocks
    _whole: list[np.ndarray] = field(default_factory=list, compare=False, repr=False)

    @classmethod
    def empty(cls, table: KeyTable, blocks: IndexBlocks) -> IndexSnapshot:
        return cls(0, 0, 0, table, blocks)

    def __len__(self) -> int:
        return self.n

    @property
    def keys(self) -> SnapshotKeys:
        return SnapshotKeys(self.table, self.n)

    def index_of(self, key: str) -> int:
        """The first sequence stored under ``key`` (KeyError if absent)."""
        i = self.table.find(key, self.n) if isinstance(key, str) else None
        if i is None:
            raise KeyError(key)
        return i

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.table.find(key, self.n) is not None

    def _block(self, i: int) -> _Block:
        a = i - i % BLOCK
        return self.blocks.get(a, min(self.n, a + BLOCK), self.n, self.num_rows)

    def length(self, i: int) -> int:
        """Tokens of sequence ``i``."""
        blk = self._block(i)
        return int(blk.lengths[i - blk.first])

    def row_start(self, i: int) -> int:
        """First global row of sequence ``i`` (``i = n``: the row count)."""
        return self.num_rows if i == self.n else self._block(i).row_start(i)

    def first_from_row(self, row: int) -> int:
        """The first sequence whose first row is at or after ``row`` (``n`` if none; row starts
        increase): a binary search reading about ``log2(n)`` index entries."""
        lo, hi = 0, self.n
        while lo < hi:
            mid = (lo + hi) // 2
            if self.row_start(mid) < row:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def token_start(self, i: int) -> int:
        """First global token of sequence ``i`` (its rows before it, plus one per sequence)."""
        return self.row_start(i) + i

    def lengths_of(self, a: int, b: int) -> np.ndarray:
        """Tokens of sequences ``[a, b)`` (int32; read block by block)."""
        parts, i = [], a
        while i < b:
            blk = self._block(i)
            j = min(b, blk.first + len(blk.lengths))
            parts.append(blk.lengths[i - blk.first : j - blk.first])
            i = j
        return np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)

    @property
    def lengths(self) -> np.ndarray:
        """Tokens of every sequence (read-only, uint16 while every length fits, else int32), read
        whole at the first use and checked to end at the commit's counts (R6, R8)."""
        if not self._whole:
            self._whole.append(self._read_whole())
        return self._whole[0]

    def _read_whole(self) -> np.ndarray:
        n, out = self.n, np.empty(self.n, np.uint16)
        rows = 0
        for a in range(0, n, WHOLE_BLOCK):
            b = min(n, a + WHOLE_BLOCK)
            ln = check_lengths(a, self.blocks.read_lengths(a, b))
            if len(ln) != b - a:
                raise CorruptStoreError(f"sequence index: {len(ln)} lengths read for [{a}, {b})")
            if ln.dtype != out.dtype:
                out = out.astype(np.int32)
            out[a:b] = ln
            rows += int(ln.sum(dtype=np.int64)) - len(ln)
        if (rows, rows + n) != (self.num_rows, self.num_tokens):
            raise CorruptStoreError(
                f"sequence index ends at token {rows + n}, row {rows}; the commit counts "
                f"{self.num_tokens} tokens, {self.num_rows} rows"
            )
        return _frozen(out)

    @property
    def row_starts(self) -> np.ndarray:
        """First global row of every sequence (computed: a new int64 array)."""
        rows = self.lengths.astype(np.int64) - 1
        out = np.zeros(len(rows), np.int64)
        np.cumsum(rows[:-1], out=out[1:])
        return out

    @property
    def token_starts(self) -> np.ndarray:
        """First global token of every sequence (computed: a new int64 array)."""
        return self.row_starts + np.arange(self.n, dtype=np.int64)

    def span(self, i: int) -> tuple[slice, slice]:
        """Rows and tokens of sequence ``i``."""
        blk = self._block(i)
        r0, n = blk.row_start(i), int(blk.lengths[i - blk.first])
        return slice(r0, r0 + n - 1), slice(r0 + i, r0 + i + n)

    def range_span(self, a: int, b: int) -> tuple[slice, slice]:
        """Rows and tokens of sequences ``[a, b)`` (stored back to back), ``a < b``."""
        r0, r1 = self.row_start(a), self.row_start(b)
        return slice(r0, r1), slice(r0 + a, r1 + b)

    def pieces(self, a: int, b: int) -> list[Piece]:
        """Sequences ``[a, b)`` as :data:`Piece` s of :meth:`range_span` ``(a, b)``."""
        out: list[Piece] = []
        rs = 0
        for i, n in zip(range(a, b), self.lengths_of(a, b).tolist(), strict=True):
            ts = rs + i - a
            out.append((i, slice(rs, rs + n - 1), slice(ts, ts + n)))
            rs += n - 1
        return out

    def check_ranges(self, ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """``ranges`` as int pairs; ``IndexError`` unless ``0 <= a <= b <= len(self)``."""
        n, out = self.n, []
        for r in ranges:
            a, b = (int(x) for x in r)
            if not 0 <= a <= b <= n:
                raise IndexError(f"sequence range [{a}, {b}) outside [0, {n}]")
            out.append((a, b))
        return out

    def at(self, m: Manifest, read: ReadBlock | None = None) -> IndexSnapshot:
        """The snapshot of commit ``m`` (same table and blocks), its last block read (with ``read``,
        default the blocks' reader) and checked to end at the commit's counts (R6, R8)."""
        n = m.num_sequences
        if m.num_tokens != m.num_rows + n or (n == 0 and m.num_rows != 0):
            raise CorruptStoreError(
                f"the commit counts {m.num_tokens} tokens, {m.num_rows} rows and {n} sequences: "
                "tokens must be rows plus sequences"
            )
        snap = IndexSnapshot(n, m.num_rows, m.num_tokens, self.table, self.blocks)
        if n:
            a = (n - 1) - (n - 1) % BLOCK
            self.blocks.get(a, n, n, m.num_rows, read)
        return snap


def check_lengths(known: int, lengths: np.ndarray) -> np.ndarray:
    """The sequence lengths from ``known`` checked (R8: ``L_i >= 2``), as uint16 if they fit, else
    int32; where their sums end is checked by the caller (R6)."""
    if lengths.size:
        lo, hi = int(lengths.min()), int(lengths.max())
        if lo < 2:
            bad = known + int(np.flatnonzero(lengths < 2)[0])
            raise CorruptStoreError(f"sequence index: sequence {bad} has a length < 2")
        if hi <= np.iinfo(np.uint16).max:
            return lengths.astype(np.uint16, copy=False)
    return lengths.astype(np.int32, copy=False)

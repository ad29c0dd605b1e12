"""The committed sequence index a reader works on (FORMAT.md §6, R6, R8): a frozen snapshot of
the length and first row and token of every sequence, made at open and at each refresh that
adopts a new commit, and a view of the keys (read on demand, :mod:`._keyindex`).

Per sequence it holds the length (uint16 while every length fits, else int32: 2 or 4 bytes) and,
every :data:`STEP` sequences, the first row (int64): first rows and tokens are running sums of
the lengths (R8), checked when read."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np

from ._keyindex import KeyTable
from ._manifest import Manifest
from .errors import CorruptStoreError

STEP = 64  # sequences per kept first row (row starts in between are summed from the lengths)


def _frozen(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


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
    """The sequence index of one commit: sequence ``i`` is ``keys[i]``, ``lengths[i]`` tokens
    from token :meth:`token_start` and ``lengths[i] - 1`` rows from :meth:`row_start`
    (``lengths``: a read-only uint16 or int32 array). ``checkpoints[j]`` is the first row of
    sequence ``j * STEP``. Keys are looked up in ``table``, shared with later snapshots (it may know
    keys of a later one: lookups pass this snapshot's count)."""

    lengths: np.ndarray
    checkpoints: np.ndarray
    num_rows: int
    num_tokens: int
    table: KeyTable

    @classmethod
    def empty(cls, table: KeyTable) -> IndexSnapshot:
        return cls(_frozen(np.zeros(0, np.uint16)), _frozen(np.zeros(0, np.int64)), 0, 0, table)

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def keys(self) -> SnapshotKeys:
        return SnapshotKeys(self.table, len(self))

    def index_of(self, key: str) -> int:
        """The first sequence stored under ``key`` (KeyError if absent)."""
        i = self.table.find(key, len(self)) if isinstance(key, str) else None
        if i is None:
            raise KeyError(key)
        return i

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.table.find(key, len(self)) is not None

    def row_start(self, i: int) -> int:
        """First global row of sequence ``i``."""
        j = i - i % STEP
        return int(self.checkpoints[i // STEP]) + int(self.lengths[j:i].sum()) - (i - j)

    def token_start(self, i: int) -> int:
        """First global token of sequence ``i`` (its rows before it, plus one per sequence)."""
        return self.row_start(i) + i

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
        return self.row_starts + np.arange(len(self), dtype=np.int64)

    def span(self, i: int) -> tuple[slice, slice]:
        """Rows and tokens of sequence ``i``."""
        r0, n = self.row_start(i), int(self.lengths[i])
        return slice(r0, r0 + n - 1), slice(r0 + i, r0 + i + n)

    def range_span(self, a: int, b: int) -> tuple[slice, slice]:
        """Rows and tokens of sequences ``[a, b)`` (stored back to back), ``a < b``."""
        r0 = self.row_start(a)
        r1 = r0 + int(self.lengths[a:b].sum()) - (b - a)
        return slice(r0, r1), slice(r0 + a, r1 + b)

    def check_ranges(self, ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """``ranges`` as int pairs; ``IndexError`` unless ``0 <= a <= b <= len(self)``."""
        n, out = len(self), []
        for r in ranges:
            a, b = (int(x) for x in r)
            if not 0 <= a <= b <= n:
                raise IndexError(f"sequence range [{a}, {b}) outside [0, {n}]")
            out.append((a, b))
        return out

    def extended(self, m: Manifest, blocks: Iterable[np.ndarray]) -> IndexSnapshot:
        """This snapshot with the index entries ``[len(self), m.num_sequences)`` appended, given
        as consecutive blocks of lengths, after checking them (:func:`check_lengths`; their
        sums must end at the commit's counts, R6, R8)."""
        i = known = len(self)
        r0 = self.row_start(known - 1) + int(self.lengths[-1]) - 1 if known else 0
        n = m.num_sequences
        # filled in place (no list of blocks): what an open leaves behind is this and no more
        lengths = np.empty(max(n, known), self.lengths.dtype)
        lengths[:known] = self.lengths
        checkpoints = np.empty(-(-max(n, known) // STEP), np.int64)
        checkpoints[: len(self.checkpoints)] = self.checkpoints
        for block in blocks:
            ln = check_lengths(i, block)
            if i + len(ln) > n:
                raise CorruptStoreError(f"sequence index: more than the {n} committed entries")
            if ln.dtype != lengths.dtype:
                lengths = lengths.astype(np.int32)
            lengths[i : i + len(ln)] = ln
            first = (-i) % STEP  # entries at multiples of STEP
            if first < len(ln):  # rows[p]: the block's rows before its entry p
                rows = np.zeros(len(ln), np.int64)
                np.cumsum(ln[: len(ln) - 1] - 1, dtype=np.int64, out=rows[1:])
                cps = rows[first::STEP] + r0
                c0 = (i + first) // STEP
                checkpoints[c0 : c0 + len(cps)] = cps
            total = int(ln.sum(dtype=np.int64))
            i, r0 = i + len(ln), r0 + total - len(ln)
        if (r0 + i, r0) != (m.num_tokens, m.num_rows) or i != n:
            raise CorruptStoreError(
                f"sequence index ends at token {r0 + i}, row {r0}; the commit counts "
                f"{m.num_tokens} tokens, {m.num_rows} rows"
            )
        return IndexSnapshot(
            _frozen(lengths), _frozen(checkpoints), m.num_rows, m.num_tokens, self.table
        )


def check_lengths(known: int, lengths: np.ndarray) -> np.ndarray:
    """The sequence lengths from ``known`` (R8: ``L_i >= 2``; the starts of sequences are their
    running sums, and where the sums end is checked by the caller: no read can reach past the
    committed counts, R6). Returns them as uint16 if they fit, else int32."""
    if lengths.size:
        lo, hi = int(lengths.min()), int(lengths.max())
        if lo < 2:
            bad = known + int(np.flatnonzero(lengths < 2)[0])
            raise CorruptStoreError(f"sequence index: sequence {bad} has a length < 2")
        if hi <= np.iinfo(np.uint16).max:
            return lengths.astype(np.uint16, copy=False)
    return lengths.astype(np.int32, copy=False)

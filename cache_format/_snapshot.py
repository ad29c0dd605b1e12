"""The committed sequence index a reader works on (FORMAT.md §6, R6, R8): a frozen snapshot of
the keys, lengths and first row and token of every sequence, made at open and at each refresh
that adopts a new commit."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ._manifest import Manifest
from .errors import CorruptStoreError


def _frozen(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


@dataclass(frozen=True)
class IndexSnapshot:
    """The sequence index of one commit: sequence ``i`` is ``keys[i]``, ``lengths[i]`` tokens
    from token ``token_starts[i]`` and ``lengths[i] - 1`` rows from row ``row_starts[i]``
    (read-only arrays). ``positions`` maps a key to its first sequence (it may know keys of a
    later snapshot: :meth:`index_of` checks)."""

    keys: tuple[str, ...]
    lengths: np.ndarray
    token_starts: np.ndarray
    row_starts: np.ndarray
    num_rows: int
    num_tokens: int
    positions: Mapping[str, int]

    @classmethod
    def empty(cls) -> IndexSnapshot:
        none = _frozen(np.zeros(0, np.int64))
        return cls((), _frozen(np.zeros(0, np.int32)), none, none, 0, 0, {})

    def __len__(self) -> int:
        return len(self.keys)

    def index_of(self, key: str) -> int:
        """The first sequence stored under ``key`` (KeyError if absent)."""
        i = self.positions.get(key)
        if i is None or i >= len(self.keys):
            raise KeyError(key)
        return i

    def __contains__(self, key: object) -> bool:
        i = self.positions.get(key) if isinstance(key, str) else None
        return i is not None and i < len(self.keys)

    def span(self, i: int) -> tuple[slice, slice]:
        """Rows and tokens of sequence ``i``."""
        t0, r0, n = int(self.token_starts[i]), int(self.row_starts[i]), int(self.lengths[i])
        return slice(r0, r0 + n - 1), slice(t0, t0 + n)

    def range_span(self, a: int, b: int) -> tuple[slice, slice]:
        """Rows and tokens of sequences ``[a, b)`` (stored back to back), ``a < b``."""
        last = b - 1
        r1 = int(self.row_starts[last]) + int(self.lengths[last]) - 1
        t1 = int(self.token_starts[last]) + int(self.lengths[last])
        return slice(int(self.row_starts[a]), r1), slice(int(self.token_starts[a]), t1)

    def check_ranges(self, ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """``ranges`` as int pairs; ``IndexError`` unless ``0 <= a <= b <= len(self)``."""
        n, out = len(self.keys), []
        for r in ranges:
            a, b = (int(x) for x in r)
            if not 0 <= a <= b <= n:
                raise IndexError(f"sequence range [{a}, {b}) outside [0, {n}]")
            out.append((a, b))
        return out

    def extended(
        self,
        m: Manifest,
        keys: list[str],
        lengths: np.ndarray,
        token_starts: np.ndarray,
        row_starts: np.ndarray,
    ) -> IndexSnapshot:
        """This snapshot with the index entries ``[len(self), m.num_sequences)`` appended, after
        checking them (:func:`check_index`). ``positions`` is shared and grown in place."""
        known = len(self.keys)
        t0 = int(self.token_starts[-1] + self.lengths[-1]) if known else 0
        r0 = int(self.row_starts[-1] + self.lengths[-1] - 1) if known else 0
        check_index(m, known, lengths, token_starts, row_starts, t0, r0)
        positions = self.positions
        assert isinstance(positions, dict)
        for i, key in enumerate(keys, start=known):  # every read done: now grow
            positions.setdefault(key, i)
        return IndexSnapshot(
            self.keys + tuple(keys),
            _frozen(np.concatenate([self.lengths, lengths])),
            _frozen(np.concatenate([self.token_starts, token_starts])),
            _frozen(np.concatenate([self.row_starts, row_starts])),
            m.num_rows,
            m.num_tokens,
            positions,
        )


def check_index(
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

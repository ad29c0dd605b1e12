"""Whole sequence ranges in a few contiguous reads (FORMAT.md §6): ``CacheReader.read_ranges``.

Sequences are stored back to back: sequence ``i`` owns rows ``[r_i, r_i + L_i - 1)`` and tokens
``[t_i, t_i + L_i)`` with ``r_i = sum_{j<i} (L_j - 1)`` and ``t_i = r_i + i``. So sequences
``[a, b)`` are exactly rows ``[r_a, r_b)`` and tokens ``[t_a, t_b)`` (``r_S = num_rows``,
``t_S = num_tokens``): one row read and one token read per range, however many sequences it
holds, instead of one read per sequence. All ranges of one call are read with their I/O issued
concurrently (one call into the reader's event loop), then cut into records that are views of
the range blocks (no copy).

Used by the client's ``LocalSource`` and the server's range streaming, so both read the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from .records import SequenceRecord

if TYPE_CHECKING:
    from .reader import CacheReader

__all__ = ["check_ranges", "read_ranges"]


def check_ranges(ranges: Sequence[tuple[int, int]], num_sequences: int) -> list[tuple[int, int]]:
    """``ranges`` as int pairs; ``IndexError`` unless ``0 <= a <= b <= num_sequences`` for each."""
    out = []
    for r in ranges:
        a, b = (int(x) for x in r)
        if not 0 <= a <= b <= num_sequences:
            raise IndexError(f"sequence range [{a}, {b}) outside [0, {num_sequences}]")
        out.append((a, b))
    return out


def read_ranges(
    reader: CacheReader,
    ranges: Sequence[tuple[int, int]],
    *,
    logprob_dtype: str = "float32",
) -> list[SequenceRecord]:
    """Records of the sequences of every ``[a, b)`` in ``ranges``, range after range.

    ``logprob_dtype`` as in :meth:`CacheReader.rows`. Empty ranges contribute nothing; ranges may
    overlap or come in any order. Reads go through the reader's retry (a raced shard rewrite is
    re-read on a fresh snapshot) and never go past the reader's snapshot.
    """
    spans_of = check_ranges(ranges, reader.num_sequences)
    todo = [(a, b) for a, b in spans_of if b > a]
    if not todo:
        return []
    lengths = reader._lengths.astype(np.int64, copy=False)
    row_start = np.append(reader._row_start.astype(np.int64, copy=False), reader.num_rows)
    keys = reader._keys

    def read() -> list[SequenceRecord]:
        spans: list[tuple[slice, slice | None]] = [
            (
                slice(int(row_start[a]), int(row_start[b])),
                slice(int(row_start[a]) + a, int(row_start[b]) + b),
            )
            for a, b in todo
        ]
        out: list[SequenceRecord] = []
        for (a, b), (ids, lp, tail, tokens, mask) in zip(
            todo, reader._fetch(spans, logprob_dtype), strict=True
        ):
            assert tokens is not None  # sequence spans read their tokens
            r0 = int(row_start[a])
            for i in range(a, b):
                rs, n = int(row_start[i]) - r0, int(lengths[i])
                ts = rs + i - a
                out.append(
                    SequenceRecord(
                        keys[i],
                        tokens[ts : ts + n],
                        ids[rs : rs + n - 1],
                        lp[rs : rs + n - 1],
                        tail[rs : rs + n - 1],
                        None if mask is None else mask[rs : rs + n - 1],
                    )
                )
        return out

    return reader._retry(read)

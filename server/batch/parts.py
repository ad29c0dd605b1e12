"""A scored batch as the cache writer takes it: :class:`~logitcache.cache_format.SequenceBatch`
parts built from the engine's arrays, no record per sequence.

:func:`to_batches` finds runs of sequences whose rows are consecutive ranges of one buffer (the
transformers backend's) and makes each run one part, a view of that buffer; a sequence in a
buffer of its own (vLLM's) is a part of its own from :data:`PART_ROWS` rows on, else joined
with its short neighbours.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

import numpy as np
from logitcache.cache_format import SequenceBatch

if TYPE_CHECKING:
    from ..engine import TeacherScores
    from ..inputs import records as inputs

#: Rows from which a sequence in a buffer of its own is a part of its own (a view) rather than
#: joined with its neighbours: a part costs ~0.1 ms of Python in the pipeline and the writer's
#: encode, a join ~0.4-1.2 CPU-us per row at k=100 (a fresh array, 800 bytes a row).
PART_ROWS = 512
#: The per-row arrays of a part besides the top-k rows (``None`` on every score or on none).
_EXTRAS = ("entropy", "actual_logprob")


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def _follows(prev: np.ndarray, cur: np.ndarray) -> bool:
    """Whether ``cur`` holds the rows right after ``prev``'s in the same buffer (same dtype,
    row stride and row shape)."""
    return (
        cur.base is not None
        and cur.base is prev.base
        and cur.dtype == prev.dtype
        and cur.strides == prev.strides
        and cur.shape[1:] == prev.shape[1:]
        and _address(cur) == _address(prev) + prev.shape[0] * prev.strides[0]
    )


def _joined_view(arrays: list[np.ndarray]) -> np.ndarray:
    """The rows of ``arrays`` (each :func:`_follows` the one before) as one read-only view."""
    first = arrays[0]
    if len(arrays) == 1:
        return first
    rows = sum(a.shape[0] for a in arrays)
    return np.lib.stride_tricks.as_strided(
        first, (rows, *first.shape[1:]), first.strides, writeable=False
    )


def runs(scores: Seq[TeacherScores]) -> list[tuple[int, int]]:
    """``[a, b)`` ranges of ``scores`` whose top-k ids and logprobs are each consecutive rows
    of one buffer (maximal runs, in order)."""
    out: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(scores)):
        p, c = scores[i - 1], scores[i]
        if not (_follows(p.topk_ids, c.topk_ids) and _follows(p.topk_logprobs, c.topk_logprobs)):
            out.append((start, i))
            start = i
    out.append((start, len(scores)))
    return out


def _optional(values: list[Any], name: str) -> np.ndarray | None:
    """Per-row arrays given by every score (joined) or by none (``None``)."""
    given = [v is not None for v in values]
    if not any(given):
        return None
    if not all(given):
        raise RuntimeError(f"the engine returned {name} for some sequences of a batch only")
    return np.concatenate(values)


def _part(seqs: Seq[inputs.Sequence], scores: Seq[TeacherScores], view: bool) -> SequenceBatch:
    """One part: ``seqs`` and their rows (``view``: a view of their one buffer, else joined)."""
    ids = [s.topk_ids for s in scores]
    lps = [s.topk_logprobs for s in scores]
    lengths = np.fromiter((s.length for s in seqs), np.int64, len(seqs))
    offsets = np.zeros(len(seqs) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tails = [s.known_tail() for s in scores]  # None: the writer computes it (same bits)
    if any(t is None for t in tails):
        tails = [s.tail_mass for s in scores] if any(t is not None for t in tails) else [None]
    mask = None
    if any(s.loss_mask is not None for s in seqs):  # chat records of a loss_mask job
        ones = [
            np.ones(s.length - 1, np.uint8) if s.loss_mask is None else s.loss_mask for s in seqs
        ]
        mask = np.concatenate(ones)
    return SequenceBatch(
        input_ids=np.concatenate([s.input_ids for s in seqs]),
        offsets=offsets,
        topk_ids=_joined_view(ids) if view else np.concatenate(ids),
        topk_logprobs=_joined_view(lps) if view else np.concatenate(lps),
        keys=[s.key for s in seqs],
        tail_mass=None if tails[0] is None else np.concatenate(tails),
        loss_mask=mask,
        **{n: _optional([getattr(s, n, None) for s in scores], n) for n in _EXTRAS},
    )


def spans(scores: Seq[TeacherScores]) -> list[tuple[int, int, bool]]:
    """``(a, b, view)`` per part of ``scores``: runs of several sequences, or of one with
    :data:`PART_ROWS` rows or more, are views; shorter single-sequence runs are joined."""
    out: list[tuple[int, int, bool]] = []
    for a, b in runs(scores):
        short = b - a == 1 and scores[a].num_rows < PART_ROWS
        if short and out and not out[-1][2]:
            out[-1] = (out[-1][0], b, False)
        else:
            out.append((a, b, not short))
    return [(a, b, view or b - a == 1) for a, b, view in out]


def to_batches(seqs: Seq[inputs.Sequence], scores: Seq[TeacherScores]) -> list[SequenceBatch]:
    """Checked sequences and the engine's ``TeacherScores`` as the parts of one append (views of
    the engine's buffers where :func:`spans` allows)."""
    if len(scores) != len(seqs):
        raise RuntimeError(f"engine returned {len(scores)} results for {len(seqs)} sequences")
    return [_part(seqs[a:b], scores[a:b], view) for a, b, view in spans(scores)]

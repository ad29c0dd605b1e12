"""Logprobs at caller-chosen token ids, read through the cache (``/generate``'s
``token_ids_logprob``, ``/inference/v1/generate``'s ``prompt_logprob_token_ids``).

A request asks, per sequence ``i``, for the logprobs of ids ``asked[i][r, c]`` at rows ``first[i]
+ r`` (row ``j`` predicts token ``j + 1``, DESIGN.md); ``-1`` pads a row (answered ``-inf``, as
vLLM does). The answer is a float32 matrix of the same shape per sequence:

* from the sequence's top-k rows as served (a cache hit, or a miss just scored and stored at
  the cache's k: :class:`~.cache_hits.CacheServing`), when every asked id of every asked row is
  in its row's top-k;
* otherwise exact from the engine at the request's temperature: for a miss scored with its ids
  (:func:`one_call_ids`), from that same engine call; else by ``score_ids`` on the union of the
  sequence's asked ids (at most :data:`IDS_PER_CALL` per engine call);
* except when the request asks for an approximation (``approximate``): then the asked ids outside
  a served row's top-k get the row's tail mass spread uniformly over the ``V - k`` ids outside it,
  ``log(tail / (V - k))`` (``-inf`` for a zero tail), with no engine call, and the answer marks
  them (:attr:`Chosen.approximated`). Ids in the top-k stay exact, and a miss scored with its ids
  is exact throughout.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np
from logitcache.cache_format import SequenceRecord

from ..engine.protocol import MAX_DRAWS
from ..errors import InvalidInputError
from ..inputs.records import Sequence
from .scoring import ScoringService

#: Most distinct ids of one sequence scored by one engine call (the engine's own limit).
IDS_PER_CALL = MAX_DRAWS


@dataclass(frozen=True)
class Chosen:
    """Per sequence the ``[R_i, m_i]`` float32 logprobs at the asked ids, and which sequences
    were answered by the engine (``exact``) rather than from their top-k rows."""

    logprobs: list[np.ndarray]
    exact: list[bool]
    approximated: list[np.ndarray | None] | None = None
    """Per sequence the ``[R_i, m_i]`` mask of the entries spread from the tail (``None``: none
    of its entries)."""


def check_asked(asked: np.ndarray, first: int, length: int, vocab_size: int, where: str) -> None:
    """422 unless ``asked`` is an integer ``[R, m]`` matrix (``m >= 1``) of ids in ``[-1,
    vocab_size)`` for rows ``first .. first + R - 1`` of a ``length``-token sequence."""
    if asked.ndim != 2 or asked.shape[1] == 0 or asked.dtype.kind not in "iu":
        raise InvalidInputError(f"{where}: a non-empty integer matrix [rows, ids] expected")
    if first < 0 or first + asked.shape[0] > length - 1:
        raise InvalidInputError(
            f"{where}: rows {first}..{first + asked.shape[0] - 1} asked of a sequence with "
            f"{length - 1} scored rows"
        )
    if asked.size and (int(asked.min()) < -1 or int(asked.max()) >= vocab_size):
        raise InvalidInputError(
            f"{where}: token ids must be in the vocabulary [0, {vocab_size}) (-1 pads a row)"
        )


def from_rows(rec: SequenceRecord, asked: np.ndarray, first: int) -> np.ndarray | None:
    """The logprobs at ``asked`` from ``rec``'s top-k rows ``first ..``, or ``None`` when an
    asked id is outside its row's top-k."""
    lps, found = _lookup(rec, asked, first)
    return lps if found.all() else None


def from_tail(
    rec: SequenceRecord, asked: np.ndarray, first: int, vocab_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """The logprobs at ``asked`` from ``rec``'s rows ``first ..`` (an id outside a row's top-k
    gets ``log(tail / (V - k))``) and the mask of those."""
    lps, found = _lookup(rec, asked, first)
    k = rec.topk_ids.shape[1]
    tail = rec.tail_or_computed()[first : first + asked.shape[0]].astype(np.float64)
    with np.errstate(divide="ignore"):
        spread = np.log(np.clip(tail, 0.0, 1.0) / max(vocab_size - k, 1))[:, None]
    spread = np.broadcast_to(spread, asked.shape)
    return np.where(found, lps, spread).astype(np.float32), ~found


def _lookup(rec: SequenceRecord, asked: np.ndarray, first: int) -> tuple[np.ndarray, np.ndarray]:
    """The logprobs at ``asked`` found in ``rec``'s top-k rows ``first ..`` and the mask of those
    found (padding counts as found), by one sorted search."""
    n = asked.shape[0]
    rows = rec.topk_ids[first : first + n].astype(np.int64)
    row_of = np.arange(n, dtype=np.int64)[:, None] << 32
    keys = (row_of + rows).ravel()
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    query = (row_of + np.maximum(asked, 0)).ravel()
    pos = np.minimum(np.searchsorted(sorted_keys, query), max(keys.size - 1, 0))
    pad = (asked < 0).ravel()
    found = (sorted_keys[pos] == query) if keys.size else np.zeros(query.shape, bool)
    lps = rec.topk_logprobs[first : first + n].ravel()[order[pos]] if keys.size else query * 0.0
    lps = np.where(pad, -np.inf, lps).reshape(asked.shape).astype(np.float32)
    return lps, (found | pad).reshape(asked.shape)


def union(asked: np.ndarray) -> np.ndarray:
    """The sorted distinct ids of ``asked`` (padding dropped; one id when there are none, which
    keeps an engine call well-formed)."""
    ids = np.unique(asked[asked >= 0])
    return ids if ids.size else np.zeros(1, dtype=asked.dtype)


def one_call_ids(asked: Seq[np.ndarray]) -> list[list[int]] | None:
    """Per sequence the :func:`union` of its asks, for one engine call with its top-k rows, or
    ``None`` when a union is over :data:`IDS_PER_CALL`."""
    unions = [union(a) for a in asked]
    if any(u.size > IDS_PER_CALL for u in unions):
        return None
    return [u.tolist() for u in unions]


def _union_chunks(asked: np.ndarray) -> list[np.ndarray]:
    ids = union(asked)
    return [ids[i : i + IDS_PER_CALL] for i in range(0, ids.size, IDS_PER_CALL)]


def _gather(full: np.ndarray, union: np.ndarray, asked: np.ndarray, first: int) -> np.ndarray:
    """``[R, m]`` from the engine's ``[L - 1, len(union)]`` logprobs at the sorted ``union``."""
    rows = full[first : first + asked.shape[0]]
    col = np.searchsorted(union, np.maximum(asked, 0))
    at = np.take_along_axis(rows, np.minimum(col, union.size - 1), axis=1)
    return np.where(asked < 0, -np.inf, at).astype(np.float32)


async def at_chosen_ids(
    scoring: ScoringService,
    seqs: Seq[Sequence],
    records: Seq[SequenceRecord],
    asked: Seq[np.ndarray],
    first: Seq[int],
    temperature: float | None,
    known: Mapping[int, np.ndarray] | None = None,
    approximate: bool = False,
) -> Chosen:
    """The logprobs at ``asked[i]`` (rows ``first[i] ..``) of each sequence: from
    ``records[i]`` when they hold every asked id, else from ``known[i]`` or the engine (with
    ``approximate``, from the tail); the caller checked the asks."""
    known = known or {}
    out: list[np.ndarray | None] = [
        from_rows(rec, a, f) for rec, a, f in zip(records, asked, first, strict=True)
    ]
    todo = [i for i, o in enumerate(out) if o is None]
    spread: list[np.ndarray | None] = [None] * len(out)
    for i in todo:
        if i in known:
            out[i] = _gather(known[i], union(asked[i]), asked[i], first[i])
        elif approximate:
            vocab = scoring.engine.info.vocab_size
            out[i], spread[i] = from_tail(records[i], asked[i], first[i], vocab)
    todo = [i for i in todo if spread[i] is None]
    calls: list[tuple[int, np.ndarray]] = [
        (i, u) for i in todo if i not in known for u in _union_chunks(asked[i])
    ]
    if calls:
        full = await scoring.admitted_ids(
            [seqs[i] for i, _ in calls], [u.tolist() for _, u in calls], temperature
        )
        parts: dict[int, list[np.ndarray]] = {}
        unions: dict[int, list[np.ndarray]] = {}
        for (i, u), lp in zip(calls, full, strict=True):
            parts.setdefault(i, []).append(lp)
            unions.setdefault(i, []).append(u)
        for i in parts:
            out[i] = _gather(
                np.concatenate(parts[i], axis=1), np.concatenate(unions[i]), asked[i], first[i]
            )
    exact = set(todo)
    return Chosen(
        logprobs=[o for o in out if o is not None],
        exact=[i in exact for i in range(len(out))],
        approximated=spread if approximate else None,
    )

"""Many sequences as flat columns (:class:`SequenceBatch`): what :meth:`.CacheWriter.append`
encodes, given directly or made from :class:`~.records.SequenceRecord` s in one pass
(:meth:`SequenceBatch.of_records`). Checked with a few vectorised NumPy passes, no Python object
per sequence (content keys excepted: one SHA-256 each, FORMAT.md §2)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import RecordError
from .records import (
    SequenceRecord,
    TopkRows,
    _as_actual,
    _as_entropy,
    _as_float32,
    _as_int32,
    _as_mask,
    computed_tail,
    known_tail,
)


def _first(bad: np.ndarray) -> int:
    return int(np.flatnonzero(bad)[0])


@dataclass(frozen=True, eq=False)
class SequenceBatch(TopkRows):
    """``S`` sequences side by side: sequence ``i`` is ``input_ids[offsets[i]:offsets[i + 1]]``
    (``L_i >= 2`` tokens) and owns rows ``offsets[i] - i`` to ``offsets[i + 1] - i - 1`` of the row
    arrays (``R = T - S`` rows in all).

    Fields: ``input_ids`` ``[T]`` int32, ``offsets`` ``[S + 1]``, ``topk_ids`` / ``topk_logprobs``
    ``[R, k]``, ``keys`` (``None``: content keys), and the per-row arrays of
    :class:`~.records.SequenceRecord`. Construction coerces dtypes and checks shapes
    (:class:`~.errors.RecordError`, naming the first sequence at fault); the checks against a
    cache's manifest are the writer's."""

    input_ids: np.ndarray
    offsets: np.ndarray
    topk_ids: np.ndarray
    topk_logprobs: np.ndarray
    keys: Sequence[str] | None = None
    tail_mass: np.ndarray | None = None
    loss_mask: np.ndarray | None = None
    entropy: np.ndarray | None = None
    actual_logprob: np.ndarray | None = None

    def __post_init__(self) -> None:
        ids = _as_int32("input_ids", self.input_ids, None)
        off = np.asarray(self.offsets)
        if off.dtype.kind not in "iu" or off.ndim != 1 or off.shape[0] < 1:
            raise RecordError(f"offsets must be 1-D integers [S + 1], got {off.dtype} {off.shape}")
        off = off.astype(np.int64)
        if ids.ndim != 1 or int(off[0]) != 0 or int(off[-1]) != ids.shape[0]:
            raise RecordError(
                f"offsets must run from 0 to len(input_ids) = {ids.shape[0]} over 1-D input_ids"
            )
        short = np.diff(off) < 2
        if short.any():
            i = _first(short)
            raise RecordError(
                f"input_ids must be 1-D with L >= 2 tokens, got {int(off[i + 1] - off[i])}",
                index=i,
            )
        n, rows = off.shape[0] - 1, ids.shape[0] - (off.shape[0] - 1)
        topk = _as_int32("topk_ids", self.topk_ids, None)
        lp = _as_float32("topk_logprobs", self.topk_logprobs, None)
        if topk.ndim != 2 or topk.shape[0] != rows or topk.shape[1] < 1:
            raise RecordError(f"topk_ids must be [T-S={rows}, k], got {topk.shape}")
        if lp.shape != topk.shape:
            raise RecordError(f"topk_logprobs shape {lp.shape} != topk_ids shape {topk.shape}")
        keys = self.keys
        if keys is not None:
            keys = list(keys)
            if len(keys) != n:
                raise RecordError(f"keys must be {n} (one per sequence), got {len(keys)}")
            try:  # passes in C: join refuses anything but str, ``in`` finds an empty one
                "".join(keys)
                i = keys.index("") if "" in keys else -1
            except TypeError:
                i = next(j for j, k in enumerate(keys) if not isinstance(k, str))
            if i >= 0:
                raise RecordError(f"key must be a non-empty str, got {keys[i]!r}", index=i)
        tail = self.tail_mass
        if tail is not None:
            tail = _as_float32("tail_mass", tail, None)
            if tail.shape != (rows,):
                raise RecordError(f"tail_mass must be [T-S={rows}], got {tail.shape}")
        fields = dict(input_ids=ids, offsets=off, topk_ids=topk, topk_logprobs=lp, keys=keys)
        fields["tail_mass"] = tail
        for name, check in (
            ("loss_mask", _as_mask),
            ("entropy", _as_entropy),
            ("actual_logprob", _as_actual),
        ):
            value = getattr(self, name)
            fields[name] = None if value is None else check(value, rows, None)
        self.__dict__.update(fields)

    @classmethod
    def of_records(
        cls, records: Sequence[SequenceRecord], rows_into: Callable[[int, int], Any] | None = None
    ) -> SequenceBatch:
        """The batch of ``records`` (checked ``SequenceRecord`` s of one ``k``; each optional
        row array given by all of them or by none, the tail mass and loss mask excepted: a
        record without one has its computed tail, or a mask of ones, where others have one).
        ``rows_into(rows, k)``: the int32 and float32 ``[rows, k]`` arrays to join the top-k
        rows into (:meth:`.fastencode.Outputs.take_rows`; ``None``: new arrays)."""
        if not records:
            raise RecordError("a batch of records needs at least one record")
        k = records[0].k
        for i, r in enumerate(records):
            if not isinstance(r, SequenceRecord) or r.k != k:
                raise RecordError("records of one batch must be SequenceRecords of one k", index=i)
        lengths = np.fromiter((r.input_ids.shape[0] for r in records), np.int64, len(records))
        off = np.zeros(len(records) + 1, np.int64)
        np.cumsum(lengths, out=off[1:])
        tails = [r.tail_mass for r in records]
        masks = [r.loss_mask for r in records]
        ids = [r.topk_ids for r in records]
        lps = [r.topk_logprobs for r in records]
        if rows_into is None:
            topk, lp = np.concatenate(ids), np.concatenate(lps)
        else:
            topk, lp = rows_into(int(off[-1]) - len(records), k)
            np.concatenate(ids, out=topk)
            np.concatenate(lps, out=lp)
        fields: dict[str, Any] = dict(
            input_ids=np.concatenate([r.input_ids for r in records]),
            offsets=off,
            topk_ids=topk,
            topk_logprobs=lp,
            keys=[r.key for r in records],
            tail_mass=None,
            loss_mask=None,
        )
        if any(t is not None for t in tails):
            fields["tail_mass"] = np.concatenate([r.tail_or_computed() for r in records])
        if any(m is not None for m in masks):
            fields["loss_mask"] = np.concatenate(
                [
                    np.ones(r.num_rows, np.uint8) if m is None else m
                    for r, m in zip(records, masks, strict=True)
                ]
            )
        for name in ("entropy", "actual_logprob"):
            got = [getattr(r, name) for r in records]
            given = [g is not None for g in got]
            if all(given):
                fields[name] = np.concatenate(got)
            elif any(given):
                raise RecordError(
                    f"record has no {name} where others have", index=given.index(False)
                )
            else:
                fields[name] = None
        batch = object.__new__(cls)
        batch.__dict__.update(fields)
        return batch

    @property
    def num_sequences(self) -> int:
        return int(self.offsets.shape[0] - 1)

    @property
    def lengths(self) -> np.ndarray:
        """Tokens of each sequence (int64 ``[S]``)."""
        return np.diff(self.offsets)

    @property
    def row_offsets(self) -> np.ndarray:
        """Where each sequence's rows start in the row arrays, and their end (int64 ``[S + 1]``)."""
        return self.offsets - np.arange(self.offsets.shape[0])

    def key_list(self) -> list[str]:
        """The sequences' keys: as given, or their content keys (computed once)."""
        if self.keys is not None:
            return list(self.keys)
        got = self.__dict__.get("_content_keys")
        if got is None:
            raw = memoryview(np.ascontiguousarray(self.input_ids, "<i4").tobytes())
            ends = (self.offsets * 4).tolist()
            sha = hashlib.sha256
            got = [
                "sha256:" + sha(raw[a:b]).hexdigest()
                for a, b in zip(ends[:-1], ends[1:], strict=True)
            ]
            self.__dict__["_content_keys"] = got
        return list(got)

    def tail_or_computed(self) -> np.ndarray:
        """The given tail mass, or the one implied by the logprobs (computed once)."""
        return self.tail_mass if self.tail_mass is not None else computed_tail(self)

    def record(self, i: int) -> SequenceRecord:
        """Sequence ``i`` as a record (views of the batch's arrays)."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        ra, rb = a - i, b - i - 1
        rows = {
            n: None if getattr(self, n) is None else getattr(self, n)[ra:rb]
            for n in ("tail_mass", "loss_mask", "entropy", "actual_logprob")
        }
        key = self.keys[i] if self.keys is not None else self.key_list()[i]
        ids, lp = self.topk_ids[ra:rb], self.topk_logprobs[ra:rb]
        return SequenceRecord.trusted(key, self.input_ids[a:b], ids, lp, **rows)


def give_tails(records: Sequence[SequenceRecord], batch: SequenceBatch) -> None:
    """Hand each record without a tail mass its rows of the tail the batch computed (bit for bit
    what :func:`.records.computed_tail` would compute), so that reading it again computes
    nothing."""
    tails = known_tail(batch)
    if tails is None:
        return
    row = batch.row_offsets.tolist()
    for i, r in enumerate(records):
        if r.tail_mass is None and known_tail(r) is None:
            object.__setattr__(r, "_computed_tail", tails[row[i] : row[i + 1]])

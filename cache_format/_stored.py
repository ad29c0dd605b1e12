"""The records a :class:`~._reader.CacheReader` returns for top-k and sampled stores: their
keys are read from the store when first used."""

from __future__ import annotations

from typing import Any

import numpy as np

from ._decode import Fetched
from ._snapshot import IndexSnapshot, SnapshotKeys
from .records import SequenceRecord


class LazyKey:
    """A reader's record whose ``key`` is read from the store when first used (a training loop
    never asks for it; reading it may raise what a read of ``seq_keys`` raises): the record's
    ``__dict__`` holds ``_keys = (SnapshotKeys, index)`` until then."""

    def __getattr__(self, name: str) -> Any:
        if name != "key" or "_keys" not in self.__dict__:
            raise AttributeError(name)
        keys, i = self.__dict__["_keys"]
        key = self.__dict__["key"] = keys[i]
        return key


class StoredRecord(LazyKey, SequenceRecord):
    """A reader's :class:`SequenceRecord` (its key read when first used, :class:`LazyKey`).
    Pickles and copies as a plain :class:`SequenceRecord`."""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return SequenceRecord.trusted, (
            self.key,
            self.input_ids,
            self.topk_ids,
            self.topk_logprobs,
            self.tail_mass,
            self.loss_mask,
            self.entropy,
            self.actual_logprob,
        )


def stored_record(keys: SnapshotKeys, i: int, *arrays: np.ndarray | None) -> SequenceRecord:
    """:meth:`SequenceRecord.trusted` of a reader's arrays ``(tokens, ids, logprobs, tail,
    mask)`` for sequence ``i``, its key left in the store until used."""
    rec = object.__new__(StoredRecord)
    tokens, ids, lp, tail, mask = arrays
    rec.__dict__.update(
        _keys=(keys, i),
        input_ids=tokens,
        topk_ids=ids,
        topk_logprobs=lp,
        tail_mass=tail,
        loss_mask=mask,
    )
    return rec


def records_of(index: IndexSnapshot, idx: list[int], got: list[Fetched]) -> list[SequenceRecord]:
    out, keys = [], index.keys
    for i, (ids, lp, tail, tokens, mask) in zip(idx, got, strict=True):
        assert tokens is not None  # sequence spans read their tokens
        out.append(stored_record(keys, i, tokens, ids, lp, tail, mask))
    return out

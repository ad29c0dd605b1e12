"""The records a :class:`~._reader.CacheReader` returns for top-k and sampled stores: their
keys are read from the store when first used."""

from __future__ import annotations

from typing import Any

from ._decode import Fetched
from ._snapshot import SnapshotKeys
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


def stored_record(
    keys: SnapshotKeys, i: int, got: Fetched, rows: slice, toks: slice
) -> SequenceRecord:
    """:meth:`SequenceRecord.trusted` of sequence ``i`` from a span's decoded arrays ``got``
    (its ``rows`` and ``toks``), its key left in the store until used."""
    rec = object.__new__(StoredRecord)
    ids, lp, tail, tokens, mask = got
    assert tokens is not None  # sequence spans read their tokens
    rec.__dict__.update(
        _keys=(keys, i),
        input_ids=tokens[toks],
        topk_ids=ids[rows],
        topk_logprobs=lp[rows],
        tail_mass=tail[rows],
        loss_mask=None if mask is None else mask[rows],
    )
    return rec

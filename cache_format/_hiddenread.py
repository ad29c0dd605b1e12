"""Reads of a hidden store (FORMAT.md 4.10): the decoded rows of a :class:`~.CacheReader`'s
spans and its :class:`~.hidden.HiddenRecord` s, through the same checked reads as every array
(:func:`._decode.stored_values`: R6, R7, R9 and the seals of 4.8)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from . import spec
from ._decode import OpenArrays, Span, stored_spans, stored_values
from ._snapshot import SnapshotKeys
from ._stored import LazyKey
from .hidden import HiddenRecord, TeacherHead, decode_rows, to_bf16_bits

HIDDEN_OUT = ("float32", "bfloat16")
"""What a hidden store's rows decode to (the readers' ``logprob_dtype`` argument): float32, or
bfloat16 bit patterns (uint16; a bfloat16 store's stored values, no conversion)."""

Got = tuple[np.ndarray, np.ndarray | None, np.ndarray | None]
"""Per span: hidden rows, tokens (``None`` for a row-only span), loss mask (or ``None``)."""


def fetch(opened: OpenArrays, spans: Sequence[Span], out: str) -> list[Got]:
    """The decoded hidden rows (and tokens, mask) of ``spans``."""
    if out not in HIDDEN_OUT:
        raise ValueError(f"a hidden store's rows decode to one of {HIDDEN_OUT}, got {out!r}")
    m = opened.manifest
    h = m.hidden
    assert h is not None
    names = [spec.HIDDEN]
    if h["dtype"] == "float8_e4m3":
        names.append(spec.HIDDEN_SCALE)
    if m.loss_mask:
        names.append(spec.LOSS_MASK)
    result: list[Got] = []
    for got, tokens in stored_spans(opened, spans, names):
        stored = got[spec.HIDDEN]
        if h["dtype"] == "bfloat16" and out == "bfloat16":
            hidden = stored
        else:
            hidden = decode_rows(stored, h["dtype"], got.get(spec.HIDDEN_SCALE))
            if out == "bfloat16":
                hidden = to_bf16_bits(hidden)
        result.append((hidden, tokens, got.get(spec.LOSS_MASK)))
    return result


class StoredHiddenRecord(LazyKey, HiddenRecord):
    """A reader's :class:`HiddenRecord` (its key read when first used, :class:`LazyKey`)."""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return HiddenRecord.trusted, (self.key, self.input_ids, self.hidden, self.loss_mask)


def record(keys: SnapshotKeys, i: int, got: Got, rows: slice, toks: slice) -> HiddenRecord:
    """Sequence ``i`` from a span's decoded arrays ``got`` (its ``rows`` and ``toks``), its key
    left in the store until used."""
    hidden, tokens, mask = got
    assert tokens is not None  # sequence spans read their tokens
    rec = object.__new__(StoredHiddenRecord)
    rec.__dict__.update(
        _keys=(keys, i),
        input_ids=tokens[toks],
        hidden=hidden[rows],
        loss_mask=None if mask is None else mask[rows],
    )
    return rec


def read_head(opened: OpenArrays) -> TeacherHead:
    """The stored teacher head (FORMAT.md 4.10) of a store with rows; :class:`~.errors.
    CorruptStoreError` if its bytes do not hash to the manifest's ``head_digest``."""
    from .errors import CorruptStoreError, FormatError, TargetKindError

    m = opened.manifest
    h = m.hidden
    if h is None:
        raise TargetKindError(f'store holds targets="{m.targets}", not "hidden": it has no head')
    if m.num_rows == 0:
        raise FormatError("the store has no rows yet: its head is written by the first commit")
    jobs = [(spec.HEAD_WEIGHT, 0, m.vocab_size)]
    if h["bias"]:
        jobs.append((spec.HEAD_BIAS, 0, m.vocab_size))
    got = stored_values(opened, jobs)
    head = TeacherHead(
        got[0],
        got[1] if h["bias"] else None,
        logit_scale=h["logit_scale"],
        softcap=h["softcap"],
        dtype=h["head_dtype"],
    )
    if head.digest() != h["head_digest"]:
        raise CorruptStoreError(
            f"head_weight/head_bias hash to {head.digest()}, the manifest says {h['head_digest']}"
        )
    return head

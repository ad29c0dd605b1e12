"""Frequency-rank remap of top-k ids (FORMAT.md §4.3), a lossless transform for compression: the
first committed batch defines ``id_order`` (the vocabulary by descending count in that batch,
ties by id); ``topk_ids`` stores each id's rank and readers decode ``id = id_order[stored]``."""

from __future__ import annotations

import numpy as np


def build_id_order(ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """Permutation of ``[0, vocab_size)`` by descending frequency of ``ids`` (stable on ties)."""
    counts = np.bincount(np.asarray(ids).ravel(), minlength=vocab_size)
    return np.argsort(-counts, kind="stable").astype(np.int32)


def inverse(order: np.ndarray) -> np.ndarray:
    """``rank`` with ``rank[order[r]] = r``."""
    rank = np.empty_like(order)
    rank[order] = np.arange(order.shape[0], dtype=order.dtype)
    return rank


def is_permutation(order: np.ndarray, vocab_size: int) -> bool:
    """True iff ``order`` holds every id of ``[0, vocab_size)`` exactly once."""
    if (
        order.shape != (vocab_size,)
        or order.min(initial=0) < 0
        or order.max(initial=0) >= vocab_size
    ):
        return False
    return bool((np.bincount(order, minlength=vocab_size) == 1).all())

"""Position selection by teacher entropy (``StreamConfig(entropy_top_fraction=x)``).

A cache with per-row teacher entropy (cache_format FORMAT.md 4.9: ``manifest.entropy``, the
entropy in nats of the teacher's full distribution at each row) lets a trainer distill on the
positions where the teacher is least certain only, as SE-KD does (arXiv 2602.01395: the top 20%
of positions by entropy; the paper ranks by the *student's* entropy, computed online, and reports
it usually beats teacher-side signals; a cache can only offer the teacher's).

The rule, per sequence and independent of packing, cutting, order and ranks:

* the candidate rows of a record are those its stored loss mask keeps (FORMAT.md 4.6; all of
  them when it has none), ``n`` of them;
* the selected rows are the ``ceil(x n)`` candidates of highest stored entropy (float16 values
  as stored; ties: the lower row index first), so every sequence with a candidate keeps at least
  one row;
* the item's ``loss_mask`` is false on every other row (``labels`` keep their tokens), so every
  loss given ``mask=batch["loss_mask"]`` trains on the selected rows only.

Per sequence rather than one threshold over the corpus: the choice of a row depends on its own
sequence only, so it needs no pass over the cache, no state (a resumed loader selects the same
rows: the loader state stays its few integers), and the same fraction of every sequence is
trained on (a global threshold would drop whole low-entropy documents).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
from logitcache.cache_format import SequenceRecord

from .errors import ConfigError

if TYPE_CHECKING:
    from logitcache.cache_format import Manifest


def check_fraction(fraction: float | None) -> float | None:
    """``fraction`` if ``None`` or a number in ``(0, 1]``; :class:`ConfigError` otherwise."""
    if fraction is None:
        return None
    if isinstance(fraction, bool) or not isinstance(fraction, int | float):
        raise ConfigError(f"entropy_top_fraction must be a number in (0, 1], got {fraction!r}")
    if not 0.0 < float(fraction) <= 1.0:
        raise ConfigError(f"entropy_top_fraction must be in (0, 1], got {fraction}")
    return float(fraction)


def check_cache(manifest: Manifest, fraction: float | None) -> None:
    """A :class:`ConfigError` when a selection is asked of a cache without per-row entropy."""
    if fraction is not None and not getattr(manifest, "entropy", False):
        raise ConfigError(
            "entropy_top_fraction needs a cache with per-row teacher entropy (manifest "
            "entropy=true, FORMAT.md 4.9); this cache has none: score it with entropy on"
        )


def selected_rows(
    entropy: np.ndarray, fraction: float, mask: np.ndarray | None = None
) -> np.ndarray:
    """Bool ``[rows]``: the rows the rule of the module docstring selects, for a record's
    ``entropy`` and stored loss ``mask`` (``None``: every row is a candidate)."""
    ent = np.asarray(entropy, dtype=np.float32)
    cand = np.ones(len(ent), bool) if mask is None else np.asarray(mask).astype(bool)
    idx = np.flatnonzero(cand)
    keep = np.zeros(len(ent), bool)
    if len(idx):
        n = math.ceil(fraction * len(idx))
        order = np.argsort(-ent[idx], kind="stable")  # ties: the lower row first
        keep[idx[order[:n]]] = True
    return keep


def select(records: dict[int, Any], fraction: float | None) -> dict[int, Any]:
    """``records`` with each record's loss mask narrowed to its selected rows (new records
    sharing the arrays; the records themselves are not changed). ``None``: ``records``."""
    if fraction is None:
        return records
    out = {}
    for seq, rec in records.items():
        if rec.entropy is None:
            raise ConfigError(f"sequence {rec.key!r} has no entropy (the cache must keep it)")
        keep = selected_rows(rec.entropy, fraction, rec.loss_mask).astype(np.uint8)
        out[seq] = SequenceRecord.trusted(
            rec.key,
            rec.input_ids,
            rec.topk_ids,
            rec.topk_logprobs,
            rec.tail_mass,
            keep,
            rec.entropy,
            rec.actual_logprob,
        )
    return out

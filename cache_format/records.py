"""In-memory records: one sequence (:class:`SequenceRecord`) or a block of rows (:class:`RowBlock`).

Alignment (DESIGN.md): a sequence of ``L >= 2`` tokens has ``L - 1`` rows; row ``j`` is the
teacher's distribution of token ``j + 1`` given tokens ``0..j``. Within a row the ``k`` ids are
distinct and sorted by descending logprob; ``tail_mass[j] = clip(1 - sum(exp(topk_logprobs[j])),
0, 1)``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._tail import tail_float64, tail_numpy
from .errors import RecordError


def content_key(input_ids: np.ndarray) -> str:
    """Content key of a token sequence: ``"sha256:" + hex(sha256(int32 little-endian bytes))``."""
    data = np.ascontiguousarray(np.asarray(input_ids, dtype="<i4")).tobytes()
    return "sha256:" + hashlib.sha256(data).hexdigest()


def tail_from_logprobs(topk_logprobs: np.ndarray) -> np.ndarray:
    """``clip(1 - sum_k exp(logprob), 0, 1)`` per row, as float32.

    Computed in float32 without cancellation, with ``m`` the row's first (largest) logprob:
    ``tail = -expm1(m + log1p(sum_{j>0} exp(lp_j - m)))`` (``tests/format/test_format_tail.py``
    bounds the error against the float64 sum). Unsorted rows and non-float32 input use the float64
    sum."""
    lp = np.asarray(topk_logprobs)
    if lp.dtype != np.float32 or lp.ndim == 0 or lp.shape[-1] == 0:
        return tail_float64(lp)
    if (
        lp.ndim == 2
        and lp.strides[1] == 4
        and lp.strides[0] % 4 == 0
        and lp.strides[0] >= lp.shape[1] * 4
    ):
        from . import fastencode  # compiled passes, the same bits

        got = fastencode.tail_rows(lp)
        if got is not None:
            return got
    return tail_numpy(lp)


def computed_tail(rows: Any) -> np.ndarray:
    """:func:`tail_from_logprobs` of ``rows.topk_logprobs``, computed once per object (kept in
    its ``__dict__``, also for frozen dataclasses; do not modify the array it returns)."""
    got = rows.__dict__.get("_computed_tail")
    if got is None:
        got = tail_from_logprobs(rows.topk_logprobs)
        object.__setattr__(rows, "_computed_tail", got)
    return got


def known_tail(rows: Any) -> np.ndarray | None:
    """What :func:`computed_tail` computed for ``rows`` so far (``None``: nothing yet)."""
    return rows.__dict__.get("_computed_tail")


def keep_tail(rows: Any, tail: np.ndarray) -> None:
    """Give ``rows`` its tail mass computed elsewhere (the same formula, e.g. on the device
    that made the rows): :func:`computed_tail` then returns it."""
    object.__setattr__(rows, "_computed_tail", tail)


def rows_array(value: Any, dtype: Any) -> np.ndarray:
    """``value`` as a ``dtype`` array: itself when its rows each lie contiguous in memory (e.g.
    columns ``1..k`` of a ``[n, k + 1]`` buffer: no copy), else a C-ordered copy."""
    arr = np.asarray(value)
    if (
        arr.dtype == dtype
        and arr.ndim == 2
        and arr.strides[1] == arr.itemsize
        and arr.strides[0] >= arr.shape[1] * arr.itemsize
        and arr.strides[0] % arr.itemsize == 0
    ):
        return arr
    return np.ascontiguousarray(arr, dtype=dtype)


def _as_int32(name: str, value: Any, key: str | None) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype.kind not in "iu":
        raise RecordError(f"{name} must be integers, got dtype {arr.dtype}", key=key)
    if arr.size and arr.dtype != np.int32:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < -(2**31) or hi >= 2**31:
            raise RecordError(f"{name} values outside int32 range [{lo}, {hi}]", key=key)
    return rows_array(arr, np.int32)


def _as_float32(name: str, value: Any, key: str | None) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype.kind not in "fiu":
        raise RecordError(f"{name} must be numbers, got dtype {arr.dtype}", key=key)
    return rows_array(arr, np.float32)


def _as_mask(value: Any, rows: int, key: str | None) -> np.ndarray:
    """A loss mask as uint8 ``[rows]`` of 0/1 (bools or integers 0/1; else RecordError)."""
    arr = np.asarray(value)
    if arr.dtype.kind not in "biu":
        raise RecordError(f"loss_mask must be bools or 0/1 ints, got dtype {arr.dtype}", key=key)
    if arr.shape != (rows,):
        raise RecordError(f"loss_mask must be [L-1={rows}], got {arr.shape}", key=key)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 1):
        raise RecordError("loss_mask values must be 0 or 1", key=key)
    return np.ascontiguousarray(arr, dtype=np.uint8)


def _as_entropy(value: Any, rows: int, key: str | None) -> np.ndarray:
    """Per-row teacher entropy as float32 ``[rows]``, finite and ``>= 0`` nats (else
    RecordError); the store keeps it as float16 (FORMAT.md 4.9)."""
    arr = _as_float32("entropy", value, key)
    if arr.shape != (rows,):
        raise RecordError(f"entropy must be [L-1={rows}], got {arr.shape}", key=key)
    if arr.size and not (np.isfinite(arr).all() and float(arr.min()) >= 0.0):
        raise RecordError("entropy values must be finite and >= 0 (nats)", key=key)
    return arr


def _as_actual(value: Any, rows: int, key: str | None) -> np.ndarray:
    """The logprob of each row's actual next token as float32 ``[rows]``, ``<= 0`` and not NaN
    (``-inf`` allowed; else RecordError; FORMAT.md 4.12)."""
    arr = _as_float32("actual_logprob", value, key)
    if arr.shape != (rows,):
        raise RecordError(f"actual_logprob must be [L-1={rows}], got {arr.shape}", key=key)
    if arr.size and (np.isnan(arr).any() or float(arr.max()) > 0.0):
        raise RecordError("actual_logprob values must be <= 0 and not NaN", key=key)
    return arr


class TopkRows:
    """Sizes derived from a ``topk_ids [rows, k]`` array (shared by every holder of rows, e.g.
    :class:`SequenceRecord` and the server's ``TeacherScores``)."""

    topk_ids: np.ndarray

    @property
    def num_rows(self) -> int:
        """Number of rows (``L - 1`` for a sequence of ``L`` tokens)."""
        return int(self.topk_ids.shape[0])

    @property
    def k(self) -> int:
        """Top-k ids per row."""
        return int(self.topk_ids.shape[1])


def checked_tokens(key: str | None, input_ids: Any) -> np.ndarray:
    """A record's ``input_ids`` as int32 ``[L]``, ``L >= 2``, after checking its ``key`` (a
    non-empty str or ``None``); a :class:`RecordError` otherwise."""
    if key is not None and (not isinstance(key, str) or not key):
        raise RecordError(f"key must be a non-empty str or None, got {key!r}")
    ids = _as_int32("input_ids", input_ids, key)
    if ids.ndim != 1 or ids.shape[0] < 2:
        raise RecordError(f"input_ids must be 1-D with L >= 2 tokens, got {ids.shape}", key=key)
    return ids


@dataclass(frozen=True, eq=False)
class SequenceRecord(TopkRows):
    """One cached sequence.

    ``key`` (``None``: the content key of ``input_ids``), ``input_ids`` ``[L]`` int32, ``topk_ids``
    ``[L-1, k]`` int32, ``topk_logprobs`` ``[L-1, k]`` float32 (float16 when a reader is asked for
    it), ``tail_mass`` ``[L-1]`` float32 or ``None`` (computed from the logprobs), and the optional
    rows ``loss_mask`` (uint8 0/1, FORMAT.md 4.6), ``entropy`` (nats, 4.9) and ``actual_logprob``
    (the logprob of ``input_ids[j + 1]``, 4.12). Construction coerces dtypes and checks shapes
    (:class:`RecordError`); value checks against a manifest are :func:`check_record`'s."""

    key: str | None
    input_ids: np.ndarray
    topk_ids: np.ndarray
    topk_logprobs: np.ndarray
    tail_mass: np.ndarray | None = None
    loss_mask: np.ndarray | None = None
    entropy: np.ndarray | None = None
    actual_logprob: np.ndarray | None = None

    def __post_init__(self) -> None:
        key = self.key
        ids = checked_tokens(key, self.input_ids)
        rows = ids.shape[0] - 1
        topk = _as_int32("topk_ids", self.topk_ids, key)
        lp = _as_float32("topk_logprobs", self.topk_logprobs, key)
        if topk.ndim != 2 or topk.shape[0] != rows or topk.shape[1] < 1:
            raise RecordError(f"topk_ids must be [L-1={rows}, k], got {topk.shape}", key=key)
        if lp.shape != topk.shape:
            raise RecordError(
                f"topk_logprobs shape {lp.shape} != topk_ids shape {topk.shape}", key=key
            )
        tail = self.tail_mass
        if tail is not None:
            tail = _as_float32("tail_mass", tail, key)
            if tail.shape != (rows,):
                raise RecordError(f"tail_mass must be [L-1={rows}], got {tail.shape}", key=key)
        if self.loss_mask is not None:
            object.__setattr__(self, "loss_mask", _as_mask(self.loss_mask, rows, key))
        if self.entropy is not None:
            object.__setattr__(self, "entropy", _as_entropy(self.entropy, rows, key))
        if self.actual_logprob is not None:
            actual = _as_actual(self.actual_logprob, rows, key)
            object.__setattr__(self, "actual_logprob", actual)
        object.__setattr__(self, "input_ids", ids)
        object.__setattr__(self, "topk_ids", topk)
        object.__setattr__(self, "topk_logprobs", lp)
        object.__setattr__(self, "tail_mass", tail)
        if key is None:
            object.__setattr__(self, "key", content_key(ids))

    @classmethod
    def trusted(
        cls,
        key: str,
        input_ids: np.ndarray,
        topk_ids: np.ndarray,
        topk_logprobs: np.ndarray,
        tail_mass: np.ndarray | None,
        loss_mask: np.ndarray | None,
        entropy: np.ndarray | None = None,
        actual_logprob: np.ndarray | None = None,
    ) -> SequenceRecord:
        """A record of arrays that already are what construction would make of them (a reader's
        decoded arrays), without the coercion and checks."""
        rec = object.__new__(cls)
        rec.__dict__.update(  # the fields a frozen dataclass's __init__ would set
            key=key,
            input_ids=input_ids,
            topk_ids=topk_ids,
            topk_logprobs=topk_logprobs,
            tail_mass=tail_mass,
            loss_mask=loss_mask,
            entropy=entropy,
            actual_logprob=actual_logprob,
        )
        return rec

    @property
    def length(self) -> int:
        """Number of tokens ``L``."""
        return int(self.input_ids.shape[0])

    @property
    def labels(self) -> np.ndarray:
        """``labels[j] = input_ids[j + 1]``: the token row ``j`` predicts."""
        return self.input_ids[1:]

    def tail_or_computed(self) -> np.ndarray:
        """The given tail mass, or the one implied by the top-k logprobs (computed once)."""
        if self.tail_mass is not None:
            return self.tail_mass
        return computed_tail(self)

    def equals(self, other: SequenceRecord) -> bool:
        """Bit-exact equality of key and every array (``None`` tail equals only ``None``)."""
        if self.key != other.key:
            return False
        pairs = [
            (self.input_ids, other.input_ids),
            (self.topk_ids, other.topk_ids),
            (self.topk_logprobs, other.topk_logprobs),
        ]
        for mine, theirs in (
            (self.tail_mass, other.tail_mass),
            (self.loss_mask, other.loss_mask),
            (self.entropy, other.entropy),
            (self.actual_logprob, other.actual_logprob),
        ):
            if (mine is None) != (theirs is None):
                return False
            if mine is not None and theirs is not None:
                pairs.append((mine, theirs))
        return all(a.shape == b.shape and a.tobytes() == b.tobytes() for a, b in pairs)

    def to_torch(self) -> dict[str, Any]:
        """Tensors of every field the record has (ids as int64, ``loss_mask`` as bool, ``labels``
        added); imports torch lazily."""
        import torch

        out = {
            "key": self.key,
            "input_ids": torch.from_numpy(self.input_ids.astype(np.int64)),
            "labels": torch.from_numpy(self.labels.astype(np.int64)),
            "topk_ids": torch.from_numpy(self.topk_ids.astype(np.int64)),
            "topk_logprobs": torch.from_numpy(self.topk_logprobs),
            "tail_mass": torch.from_numpy(self.tail_or_computed()),
        }
        return _with_extras(out, self)


@dataclass(frozen=True, eq=False)
class RowBlock:
    """Rows ``[start, stop)`` of the flat row arrays (may span several sequences)."""

    start: int
    topk_ids: np.ndarray  # [n, k] int32
    topk_logprobs: np.ndarray  # [n, k] float32
    tail_mass: np.ndarray  # [n] float32
    loss_mask: np.ndarray | None = None  # [n] uint8 0/1, loss_mask stores only (FORMAT.md 4.6)
    entropy: np.ndarray | None = None  # [n] float16 nats, entropy stores only (FORMAT.md 4.9)
    actual_logprob: np.ndarray | None = None  # [n] float32, actual_logprob stores only (4.12)

    @property
    def stop(self) -> int:
        return self.start + int(self.topk_ids.shape[0])

    def to_torch(self) -> dict[str, Any]:
        """Tensors of the block (ids as int64); imports torch lazily."""
        import torch

        out = {
            "topk_ids": torch.from_numpy(self.topk_ids.astype(np.int64)),
            "topk_logprobs": torch.from_numpy(self.topk_logprobs),
            "tail_mass": torch.from_numpy(self.tail_mass),
        }
        return _with_extras(out, self)


def _with_extras(out: dict[str, Any], rows: Any) -> dict[str, Any]:
    """``out`` plus the optional per-row arrays ``rows`` has: the loss mask as bool, the others
    as float32 tensors."""
    import torch

    if rows.loss_mask is not None:
        out["loss_mask"] = torch.from_numpy(rows.loss_mask.astype(bool))
    for name in ("entropy", "actual_logprob"):
        value = getattr(rows, name)
        if value is not None:
            out[name] = torch.from_numpy(value.astype(np.float32))
    return out


def _row_pairs(a: np.ndarray, op: Any) -> bool:
    """Whether ``op(a[:, j + 1], a[:, j])`` holds anywhere in ``[n, k]`` ``a``: one pass over the
    flat array, the pairs that straddle two rows masked out."""
    flat = np.ascontiguousarray(a).reshape(-1)
    hit = op(flat[1:], flat[:-1])
    hit[a.shape[1] - 1 :: a.shape[1]] = False
    return bool(hit.any())


def rows_pass(
    input_ids: np.ndarray,
    topk_ids: np.ndarray,
    topk_logprobs: np.ndarray,
    tails: np.ndarray | None,
    *,
    vocab_size: int,
) -> bool:
    """Whether :func:`check_record` passes every record of a batch whose arrays are given here
    concatenated (``input_ids`` ``[T]``, ``topk_ids``/``topk_logprobs`` ``[R, k]``, ``tails``: the
    given tail masses or ``None``). Each check tests single rows or an extremum, so it holds for
    the concatenation iff it holds for every record; on ``False`` the caller checks record by
    record for the error."""
    return _problem(input_ids, topk_ids, topk_logprobs, tails, vocab_size) is None


def _problem(
    input_ids: np.ndarray,
    topk_ids: np.ndarray,
    lp: np.ndarray,
    tails: np.ndarray | None,
    vocab_size: int,
) -> str | None:
    """The first check of :func:`check_record` these rows fail (its message), or ``None``."""
    from .spec import LOGPROB_TOLERANCE, TAIL_TOLERANCE

    for name, arr in (("input_ids", input_ids), ("topk_ids", topk_ids)):
        if arr.size:
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0 or hi >= vocab_size:
                return f"{name} outside vocab [0, {vocab_size}): min {lo}, max {hi}"
    k = topk_ids.shape[1]
    if k > 1:
        srt = np.sort(topk_ids, axis=1)
        if _row_pairs(srt, np.equal):
            row = int(np.nonzero((srt[:, 1:] == srt[:, :-1]).any(axis=1))[0][0])
            return f"row {row}: repeated token id in top-k"
    if not bool(np.isfinite(lp).all()):
        return "topk_logprobs contain NaN or inf"
    if lp.size and float(lp.max()) > LOGPROB_TOLERANCE:
        return f"topk_logprobs > 0 (max {float(lp.max())})"
    if k > 1 and _row_pairs(lp, np.greater):
        row = int(np.nonzero((lp[:, 1:] > lp[:, :-1]).any(axis=1))[0][0])
        return f"row {row}: logprobs not sorted descending"
    if tails is not None and tails.size:
        if not bool(np.isfinite(tails).all()):
            return "tail_mass contains NaN or inf"
        lo_t, hi_t = float(tails.min()), float(tails.max())
        if lo_t < -TAIL_TOLERANCE or hi_t > 1 + TAIL_TOLERANCE:
            return f"tail_mass outside [0, 1]: [{lo_t}, {hi_t}]"
    return None


def check_record(rec: SequenceRecord, *, k: int, vocab_size: int, index: int | None = None) -> None:
    """Value checks of one record against a cache's ``k`` and ``vocab_size`` (RecordError): ids
    in ``[0, vocab_size)`` and distinct within a row; logprobs finite, ``<= LOGPROB_TOLERANCE``
    and non-increasing; tail mass (if given) finite and within
    ``[-TAIL_TOLERANCE, 1 + TAIL_TOLERANCE]``."""
    if rec.k != k:
        raise RecordError(
            f"k mismatch: record has {rec.k}, cache has {k}", key=rec.key, index=index
        )
    got = _problem(rec.input_ids, rec.topk_ids, rec.topk_logprobs, rec.tail_mass, vocab_size)
    if got is not None:
        raise RecordError(got, key=rec.key, index=index)

"""Checking and encoding an append's records into the stored arrays (FORMAT.md W1, 4.1-4.3): the
compiled pass (:mod:`.fastencode`) where numba runs, else NumPy (the reference), both giving the
same bytes; nothing is written here."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _kernels as kernels
from . import _rowextra, fastencode, spec
from ._manifest import Manifest
from .errors import RecordError
from .quant import F16_MIN, encode_logprobs, row_delta
from .records import SequenceRecord, check_record, rows_pass, tail_from_logprobs


@dataclass
class Encoded:
    """One validated record, in storage dtypes."""

    key: str
    input_ids: np.ndarray
    arrays: dict[str, np.ndarray]  # row arrays by name


def encode_record(rec: SequenceRecord, manifest: Manifest, index: int | None = None) -> Encoded:
    """Validate ``rec`` against ``manifest`` and convert to the stored dtypes (RecordError)."""
    if not isinstance(rec, SequenceRecord):
        raise RecordError(f"expected SequenceRecord, got {type(rec).__name__}", index=index)
    check_record(rec, k=manifest.k, vocab_size=manifest.vocab_size, index=index)
    if manifest.logprob_dtype == "float16":
        arrays = {spec.TOPK_LOGPROBS: _float16_row_delta(rec.topk_logprobs)}
    else:
        arrays = encode_logprobs(rec.topk_logprobs, manifest.logprob_dtype)
    arrays[spec.TOPK_IDS] = np.ascontiguousarray(rec.topk_ids)
    arrays[spec.TAIL_MASS] = rec.tail_or_computed().clip(0.0, 1.0).astype(manifest.tail_mass_dtype)
    if manifest.loss_mask:  # FORMAT.md 4.6: no mask means every row is trained on
        mask = rec.loss_mask
        arrays[spec.LOSS_MASK] = np.ones(rec.num_rows, np.uint8) if mask is None else mask
    elif rec.loss_mask is not None:
        raise RecordError(
            "record has a loss_mask but the store has none (create it with loss_mask=True)",
            key=rec.key,
            index=index,
        )
    arrays.update(_rowextra.encode(rec, manifest, index))  # FORMAT.md 4.9, 4.12
    assert rec.key is not None  # SequenceRecord.__post_init__ sets the content key
    return Encoded(rec.key, rec.input_ids, arrays)


@dataclass
class Batch:
    """The validated records of one append, in storage dtypes, each array concatenated over
    the batch (rows and tokens in record order)."""

    keys: list[str]
    lengths: np.ndarray  # int64 [S]: tokens of each record
    input_ids: np.ndarray  # [T] int32
    arrays: dict[str, np.ndarray]  # row arrays by name, [R, ...]

    @classmethod
    def of(cls, encoded: list[Encoded]) -> Batch:
        """The batch of records encoded one by one (:func:`encode_record`)."""
        return cls(
            [e.key for e in encoded],
            np.array([len(e.input_ids) for e in encoded], dtype=np.int64),
            np.concatenate([e.input_ids for e in encoded]),
            {n: np.concatenate([e.arrays[n] for e in encoded]) for n in encoded[0].arrays},
        )

    def select(self, keep: list[int]) -> Batch:
        """The records ``keep`` (indices, ascending) of this batch."""
        if len(keep) == len(self.keys):
            return self
        rows = self.lengths - 1
        row_end, tok_end = np.cumsum(rows), np.cumsum(self.lengths)
        r = np.concatenate([np.arange(row_end[i] - rows[i], row_end[i]) for i in keep])
        t = np.concatenate([np.arange(tok_end[i] - self.lengths[i], tok_end[i]) for i in keep])
        return Batch(
            [self.keys[i] for i in keep],
            self.lengths[keep],
            self.input_ids[t],
            {n: a[r] for n, a in self.arrays.items()},
        )


#: Top-k entries (rows * k) of the records that :func:`encode_batch` checks and encodes at once:
#: 2 MiB of int32 / float32 temporaries per step, which the allocator reuses from group to group.
#: Whole-batch temporaries (26 MB each at 65K rows, k=100) were fresh pages every append: page
#: faults and zeroing, system time.
ENCODE_GROUP_VALUES = 1 << 19


def _groups(records: list[SequenceRecord], rows_per_group: int) -> list[tuple[int, int]]:
    """Consecutive ``[lo, hi)`` ranges of records of up to ``rows_per_group`` rows (at least one
    record each)."""
    out: list[tuple[int, int]] = []
    lo = n = 0
    for i, r in enumerate(records):
        if n and n + r.num_rows > rows_per_group:
            out.append((lo, i))
            lo, n = i, 0
        n += r.num_rows
    out.append((lo, len(records)))
    return out


def encode_batch(
    records: list[Any], manifest: Manifest, out: fastencode.Outputs | None = None
) -> Batch | None:
    """Validate every record of ``records`` against ``manifest`` and convert the batch to the
    stored dtypes, concatenated (``None`` for an empty batch). With ``out``, the compiled pass
    writes the top-k ids and logprobs into its arrays (valid until ``out`` is taken again).

    Accepts and refuses exactly what :func:`encode_record` does record by record, with the same
    :class:`~.errors.RecordError` (the first bad record's, with its index): the value checks run
    once per group of records (:data:`ENCODE_GROUP_VALUES`) over their concatenated rows
    (:func:`.records.rows_pass`), and only a batch that fails them is checked again record by
    record, for the error. The stored arrays are bit-identical to :func:`encode_record`'s
    concatenated (a few numpy calls per group instead of per record).
    """
    if not records:
        return None
    if manifest.hidden is not None:  # FORMAT.md 4.10: hidden rows, no top-k entries
        from .hidden import encode_rows

        arrays = encode_rows(records, manifest.hidden, manifest.vocab_size, manifest.loss_mask)
        inp = arrays.pop("input_ids")
        lengths = np.array([r.length for r in records], dtype=np.int64)
        return Batch([r.key for r in records], lengths, inp, arrays)
    k, mask = manifest.k, manifest.loss_mask
    got = None
    if all(
        isinstance(r, SequenceRecord) and r.k == k and (mask or r.loss_mask is None)
        for r in records
    ) and _rowextra.batch_matches(records, manifest):
        got = _encode_groups(records, manifest, out)
    if got is None:
        for i, r in enumerate(records):
            encode_record(r, manifest, i)  # raises the first bad record's error
        raise RecordError("the batch fails its checks but none of its records does")
    arrays, inp = got
    if mask:  # FORMAT.md 4.6: no mask means every row is trained on
        arrays[spec.LOSS_MASK] = np.concatenate(
            [np.ones(r.num_rows, np.uint8) if r.loss_mask is None else r.loss_mask for r in records]
        )
    arrays.update(_rowextra.batch_arrays(records, manifest))  # FORMAT.md 4.9, 4.12
    keys = [r.key for r in records]
    lengths = np.array([r.length for r in records], dtype=np.int64)
    return Batch(keys, lengths, inp, arrays)


def _encode_groups(
    records: list[SequenceRecord], manifest: Manifest, out: fastencode.Outputs | None = None
) -> tuple[dict[str, np.ndarray], np.ndarray] | None:
    """The row arrays and input ids of checked ``records`` (all of the cache's ``k``), or
    ``None`` as soon as a group fails :func:`.records.rows_pass`. float16 stores with a
    vocabulary of up to :data:`.fastencode.MAX_VOCAB` take the compiled pass
    (:func:`_encode_fused`) where numba is available."""
    if (
        FAST_ENCODE
        and manifest.logprob_dtype == "float16"
        and manifest.vocab_size <= fastencode.MAX_VOCAB
        and fastencode.ready()
    ):
        return _encode_fused(records, manifest, out)
    k = manifest.k
    row_end = np.cumsum([r.num_rows for r in records])
    tok_end = np.cumsum([r.length for r in records])
    inp = np.concatenate([r.input_ids for r in records])
    total = int(row_end[-1])
    ids = np.empty((total, k), dtype=np.int32)
    tails = np.empty(total, dtype=np.float32)
    half = manifest.logprob_dtype == "float16"
    stored = np.empty((total, k), dtype=np.uint16) if half else None
    lps: list[np.ndarray] = []  # other encodings: encoded once, over the batch
    for lo, hi in _groups(records, max(1, ENCODE_GROUP_VALUES // k)):
        part = records[lo:hi]
        a, b = (int(row_end[lo - 1]) if lo else 0), int(row_end[hi - 1])
        ta, tb = (int(tok_end[lo - 1]) if lo else 0), int(tok_end[hi - 1])
        np.concatenate([r.topk_ids for r in part], out=ids[a:b])
        lp = np.concatenate([r.topk_logprobs for r in part])
        given = [r.tail_mass for r in part if r.tail_mass is not None]
        t_given = np.concatenate(given) if given else None
        if not rows_pass(inp[ta:tb], ids[a:b], lp, t_given, vocab_size=manifest.vocab_size):
            return None
        if stored is not None:
            stored[a:b] = _float16_row_delta(lp)
        else:
            lps.append(lp)
        if t_given is not None and len(given) == len(part):
            tails[a:b] = t_given
        elif t_given is None:
            tails[a:b] = tail_from_logprobs(lp)
        else:
            tails[a:b] = np.concatenate([r.tail_or_computed() for r in part])
    arrays: dict[str, np.ndarray]
    if stored is not None:
        arrays = {spec.TOPK_LOGPROBS: stored}
    else:
        arrays = encode_logprobs(np.concatenate(lps), manifest.logprob_dtype)
    arrays[spec.TOPK_IDS] = ids
    arrays[spec.TAIL_MASS] = tails.clip(0.0, 1.0).astype(manifest.tail_mass_dtype)
    return arrays, inp


#: Use :mod:`.fastencode` when it is ready (False: the numpy path, for tests and A/B runs).
FAST_ENCODE = True
_tables: dict[int, fastencode.StampTable] = {}  # by vocabulary size, reused between appends
_tables_lock = threading.Lock()


def _encode_fused(
    records: list[SequenceRecord], manifest: Manifest, out: fastencode.Outputs | None = None
) -> tuple[dict[str, np.ndarray], np.ndarray] | None:
    """:func:`_encode_groups`'s result through :func:`.fastencode.encode_rows`: one compiled
    call per record checks its rows and writes its ids and float16 row deltas straight into the
    batch's arrays (no concatenated copies, no temporaries); the input ids and tail masses are
    checked as :func:`.records.rows_pass` checks them. Same bytes, same accepted batches."""
    from .spec import LOGPROB_TOLERANCE, TAIL_TOLERANCE

    k, vocab = manifest.k, manifest.vocab_size
    inp = np.concatenate([r.input_ids for r in records])
    if inp.size and (int(inp.min()) < 0 or int(inp.max()) >= vocab):
        return None
    total = sum(r.num_rows for r in records)
    if out is not None:  # faulted in once, reused (fastencode.Outputs)
        ids, stored = out.take(total, k)
    else:
        ids, stored = np.empty((total, k), np.int32), np.empty((total, k), np.uint16)
    tails = np.empty(total, dtype=np.float32)
    with _tables_lock:  # one table per writer thread at a time
        table = _tables.pop(vocab, None) or fastencode.StampTable(vocab)
    try:
        a = 0
        for r in records:
            b = a + r.num_rows
            lp = r.topk_logprobs
            if not fastencode.encode_rows(
                r.topk_ids, lp, ids[a:b], stored[a:b], table, LOGPROB_TOLERANCE
            ):
                return None
            tails[a:b] = r.tail_or_computed()  # after the kernel: its rows are in cache
            a = b
    finally:
        with _tables_lock:
            _tables[vocab] = table
    given = [r.tail_mass for r in records if r.tail_mass is not None]
    if given:
        t = np.concatenate(given) if len(given) > 1 else given[0]
        if not bool(np.isfinite(t).all()):
            return None
        if float(t.min()) < -TAIL_TOLERANCE or float(t.max()) > 1 + TAIL_TOLERANCE:
            return None
    arrays: dict[str, np.ndarray] = {spec.TOPK_LOGPROBS: stored, spec.TOPK_IDS: ids}
    arrays[spec.TAIL_MASS] = tails.clip(0.0, 1.0).astype(manifest.tail_mass_dtype)
    return arrays, inp


def _float16_row_delta(lp: np.ndarray) -> np.ndarray:
    """``encode_logprobs(lp, "float16")``'s stored array, bit for bit (clipped to
    ``[-65504, 0]``, rounded to float16, row deltas of the bit patterns), with the float16
    cast through :func:`._kernels.float_to_half` (0.93 -> 0.23 CPU-us/position at k=100)."""
    c = np.minimum(np.asarray(lp, dtype=np.float32), np.float32(0.0))
    np.maximum(c, np.float32(F16_MIN), out=c)
    return row_delta(kernels.float_to_half(c).view(np.uint16))

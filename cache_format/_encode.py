"""Checking and encoding an append's records into the stored arrays (FORMAT.md W1, 4.1-4.3): the
compiled pass (:mod:`.fastencode`) where numba runs, else NumPy (the reference), both giving the
same bytes; nothing is written here."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NoReturn

import numpy as np

from . import _kernels as kernels
from . import _keyindex as keyindex
from . import _rowextra, fastencode, spec
from ._keyruns import hash_order
from ._manifest import Manifest
from ._seqbatch import SequenceBatch, give_tails
from .errors import RecordError
from .quant import F16_MIN, encode_logprobs, row_delta
from .records import (
    SequenceRecord,
    check_record,
    keep_tail,
    known_tail,
    rows_pass,
    tail_from_logprobs,
)


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
    """The validated records of one append in storage dtypes, each array concatenated over the
    batch, with the keys' UTF-8 bytes and lengths, their hashes (:func:`._keyindex.byte_hashes`) and
    the order that sorts them (:func:`._keyruns.hash_order`)."""

    keys: list[str]
    lengths: np.ndarray  # int64 [S]: tokens of each record
    input_ids: np.ndarray  # [T] int32
    arrays: dict[str, np.ndarray]  # row arrays by name, [R, ...]
    key_bytes: np.ndarray = field(init=False)  # uint8, the keys' UTF-8 bytes back to back
    key_lens: np.ndarray = field(init=False)  # int64 [S]
    hashes: np.ndarray = field(init=False)  # int64 [S]
    order: np.ndarray = field(init=False)  # int64 [S]: hashes[order] ascending, ties by position

    def __post_init__(self) -> None:
        keys = self.keys
        text = "".join(keys)
        try:
            raw = text.encode("utf-8")
        except UnicodeEncodeError as e:
            i = next(j for j, k in enumerate(keys) if not k.isascii() and _no_utf8(k))
            raise RecordError(f"key is not valid UTF-8 text ({e.reason})", index=i) from None
        lens = keyindex.utf8_lengths(keys, raw, "strict")
        self.key_bytes, self.key_lens = np.frombuffer(raw, np.uint8), lens
        self.hashes = keyindex.byte_hashes(self.key_bytes, np.cumsum(lens))
        self.order = hash_order(self.hashes)

    def fresh(self, stored: np.ndarray) -> Batch | None:
        """The records to append: those not ``stored`` (bool per record), each key's first
        (``None``: none)."""
        keep = ~stored & first_of_each(self.keys, self.hashes, self.order)
        if keep.all():
            return self
        if not keep.any():
            return None
        rows = self.lengths - 1
        out = object.__new__(Batch)
        out.keys = [k for k, kept in zip(self.keys, keep.tolist(), strict=True) if kept]
        out.lengths = self.lengths[keep]
        out.input_ids = self.input_ids[np.repeat(keep, self.lengths)]
        row_keep = np.repeat(keep, rows)
        out.arrays = {n: a[row_keep] for n, a in self.arrays.items()}
        out.key_bytes = self.key_bytes[np.repeat(keep, self.key_lens)]
        out.key_lens, out.hashes = self.key_lens[keep], self.hashes[keep]
        kept = self.order[keep[self.order]]  # still sorted by hash, ties by position
        out.order = (np.cumsum(keep) - 1)[kept]
        return out


def _no_utf8(key: str) -> bool:
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def first_of_each(keys: list[str], hashes: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Whether each key is the first of its value in ``keys`` (bool; ``hashes``: the keys'
    :func:`._keyindex.byte_hashes`, ``order``: their :func:`._keyruns.hash_order`): keys of
    equal hash compared as strings."""
    first = np.ones(len(keys), bool)
    hs = hashes[order]
    same = np.flatnonzero(hs[1:] == hs[:-1])
    if not len(same):
        return first
    group_of = np.cumsum(np.concatenate([[True], hs[1:] != hs[:-1]]))
    seen: dict[tuple[int, str], int] = {}
    for j in np.unique(np.concatenate([same, same + 1])).tolist():
        i = int(order[j])
        if seen.setdefault((int(group_of[j]), keys[i]), i) != i:
            first[i] = False
    return first


#: Top-k entries (rows * k) checked, encoded or given a tail mass at once by the NumPy passes:
#: 2 MiB of int32 / float32 temporaries per step, which the allocator reuses from group to group
#: (whole-batch temporaries would be fresh pages every append: page faults and zeroing).
ENCODE_GROUP_VALUES = 1 << 19


def encode_batch(
    records: list[Any] | SequenceBatch, manifest: Manifest, out: fastencode.Outputs | None = None
) -> Batch | None:
    """Validate an append (a :class:`~._seqbatch.SequenceBatch`, a list of them, or records) against
    ``manifest`` and convert it to the stored dtypes, concatenated (``None`` for an empty append).
    With ``out``, the compiled pass writes the top-k ids and logprobs into its arrays.

    Accepts and refuses exactly what :func:`encode_record` does record by record, with the same
    :class:`~.errors.RecordError`: the checks run over the batch's flat arrays, and only a batch
    that fails them is checked record by record for the error. The stored arrays are bit-identical
    to :func:`encode_record`'s concatenated."""
    recs: list[Any] | None = None
    if isinstance(records, SequenceBatch):
        if manifest.hidden is not None:
            raise RecordError('a targets="hidden" store takes HiddenRecord, got SequenceBatch')
        batch = records
    else:
        recs = list(records)
        if not recs:
            return None
        if isinstance(recs[0], SequenceBatch):
            return _encode_parts(recs, manifest, out)
        if manifest.hidden is not None:  # FORMAT.md 4.10: hidden rows, no top-k entries
            return _hidden_batch(recs, manifest)
        k, mask = manifest.k, manifest.loss_mask
        if not (
            all(
                isinstance(r, SequenceRecord) and r.k == k and (mask or r.loss_mask is None)
                for r in recs
            )
            and _rowextra.batch_matches(recs, manifest)
        ):
            _raise_first(recs.__getitem__, len(recs), manifest, 0)
        batch = SequenceBatch.of_records(recs, None if out is None else out.take_rows)
    if batch.num_sequences == 0:
        return None
    arrays = _encode_rows(batch, manifest, out)
    if arrays is None:
        get = batch.record if recs is None else recs.__getitem__
        _raise_first(get, batch.num_sequences, manifest, _first_bad(batch, manifest))
    if recs is not None:
        give_tails(recs, batch)
    return Batch(batch.key_list(), batch.lengths, batch.input_ids, arrays)


def _encode_parts(
    parts: list[Any], manifest: Manifest, out: fastencode.Outputs | None
) -> Batch | None:
    """:func:`encode_batch` of :class:`~._seqbatch.SequenceBatch` ``parts`` appended as one: each
    part's top-k rows are encoded straight into its rows of the append's arrays (never joined
    first); the same bytes, checks and errors as one batch of all the sequences."""
    for i, p in enumerate(parts):
        if not isinstance(p, SequenceBatch):
            raise RecordError(f"an append of SequenceBatch parts got {type(p).__name__}", index=i)
    if manifest.hidden is not None:
        raise RecordError('a targets="hidden" store takes HiddenRecord, got SequenceBatch')
    parts = [p for p in parts if p.num_sequences]
    if len(parts) <= 1:
        return encode_batch(parts[0], manifest, out) if parts else None
    k, total = manifest.k, sum(p.num_rows for p in parts)
    into: tuple[np.ndarray, np.ndarray] | None = None
    compiled = _compiled(manifest, total * k)
    if compiled:
        into = out.take(total, k) if out is not None else _new_outputs(total, k)
    encoded, row, first = [], 0, 0
    for p in parts:
        part = slice(row, row + p.num_rows)
        arrays = _encode_rows(
            p, manifest, None, None if into is None else (into[0][part], into[1][part]), compiled
        )
        if arrays is None:  # the error names the sequence's place in the whole append
            start = first + _first_bad(p, manifest)
            _raise_first(partial(_shifted, p, first), first + p.num_sequences, manifest, start)
        encoded.append(arrays)
        row, first = part.stop, first + p.num_sequences
    placed = {} if into is None else {spec.TOPK_IDS: into[0], spec.TOPK_LOGPROBS: into[1]}
    joined = {  # the compiled pass wrote the parts' top-k rows in place
        n: placed[n] if n in placed else np.concatenate([e[n] for e in encoded]) for n in encoded[0]
    }
    keys = [key for p in parts for key in p.key_list()]
    lengths = np.concatenate([p.lengths for p in parts])
    return Batch(keys, lengths, np.concatenate([p.input_ids for p in parts]), joined)


def _shifted(b: SequenceBatch, first: int, i: int) -> SequenceRecord:
    """Sequence ``i`` of an append whose part ``b`` starts at sequence ``first``."""
    return b.record(i - first)


def _hidden_batch(records: list[Any], manifest: Manifest) -> Batch:
    from .hidden import encode_rows

    assert manifest.hidden is not None
    arrays = encode_rows(records, manifest.hidden, manifest.vocab_size, manifest.loss_mask)
    inp = arrays.pop("input_ids")
    lengths = np.array([r.length for r in records], dtype=np.int64)
    return Batch([r.key for r in records], lengths, inp, arrays)


def _raise_first(get: Callable[[int], Any], n: int, manifest: Manifest, start: int) -> NoReturn:
    """Raise the first bad record's error, checking records ``get(i)`` one by one, ``i`` from
    ``start`` to ``n``."""
    for i in range(start, n):
        encode_record(get(i), manifest, i)
    raise RecordError("the batch fails its checks but none of its records does")


def _first_bad(b: SequenceBatch, manifest: Manifest) -> int:
    """The first sequence of ``b`` that fails a value check of :func:`.records.check_record`
    (0 when the batch and the store disagree on ``k`` or an optional array)."""
    from .spec import LOGPROB_TOLERANCE, TAIL_TOLERANCE

    k, vocab, ids, lp = manifest.k, manifest.vocab_size, b.topk_ids, b.topk_logprobs
    if b.k != k or _extras(b, manifest) is None:
        return 0
    with np.errstate(invalid="ignore"):
        bad = ((ids < 0) | (ids >= vocab)).any(axis=1) | (~np.isfinite(lp)).any(axis=1)
        bad |= (lp > LOGPROB_TOLERANCE).any(axis=1)
        if k > 1:
            srt = np.sort(ids, axis=1)
            bad |= (srt[:, 1:] == srt[:, :-1]).any(axis=1) | (lp[:, 1:] > lp[:, :-1]).any(axis=1)
        t = b.tail_mass
        if t is not None:
            bad |= ~np.isfinite(t) | (t < -TAIL_TOLERANCE) | (t > 1 + TAIL_TOLERANCE)
    tok = (b.input_ids < 0) | (b.input_ids >= vocab)
    at = [np.searchsorted(b.offsets, np.flatnonzero(tok)[:1], "right") - 1]
    at.append(np.searchsorted(b.row_offsets, np.flatnonzero(bad)[:1], "right") - 1)
    return int(min(np.concatenate(at).tolist(), default=0))


def _extras(b: SequenceBatch, manifest: Manifest) -> dict[str, np.ndarray] | None:
    """The batch's loss mask and optional row arrays as stored (``None``: the batch has one
    the store lacks, or lacks one the store keeps)."""
    if b.loss_mask is not None and not manifest.loss_mask:
        return None
    out = {}
    if manifest.loss_mask:  # FORMAT.md 4.6: no mask means every row is trained on
        mask = b.loss_mask
        out[spec.LOSS_MASK] = np.ones(b.num_rows, np.uint8) if mask is None else mask
    for x in _rowextra.EXTRAS:  # FORMAT.md 4.9, 4.12
        value = getattr(b, x.name)
        if (value is None) == bool(getattr(manifest, x.name)):
            return None
        if value is not None:
            out[x.name] = value.astype(x.dtype)
    return out


#: Use :mod:`.fastencode` when it is wanted (False: the numpy path, for tests and A/B runs).
FAST_ENCODE = True
_tables: dict[int, fastencode.StampTable] = {}  # by vocabulary size, reused between appends
_tables_lock = threading.Lock()


def _compiled(manifest: Manifest, values: int) -> bool:
    """Whether an append of ``values`` top-k values to a store of ``manifest`` takes the compiled
    pass (:func:`_encode_rows`; the kernels load when worth it: :func:`.fastencode.wanted`)."""
    return (
        FAST_ENCODE
        and manifest.logprob_dtype == "float16"
        and manifest.vocab_size <= fastencode.MAX_VOCAB
        and fastencode.wanted(values)
    )


def _new_outputs(rows: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    return np.empty((rows, k), np.int32), np.empty((rows, k), np.uint16)


def _encode_rows(
    b: SequenceBatch,
    manifest: Manifest,
    out: fastencode.Outputs | None = None,
    into: tuple[np.ndarray, np.ndarray] | None = None,
    compiled: bool | None = None,
) -> dict[str, np.ndarray] | None:
    """The stored row arrays of batch ``b``, or ``None`` when it fails a check
    (:func:`.records.rows_pass`'s). float16 stores with a vocabulary of up to
    :data:`.fastencode.MAX_VOCAB` take the compiled pass where it is loaded or worth loading
    (:func:`_compiled`, or ``compiled`` decided by the caller), into ``into``'s or ``out``'s
    arrays; the others NumPy's, in groups of :data:`ENCODE_GROUP_VALUES`."""
    from .spec import LOGPROB_TOLERANCE, TAIL_TOLERANCE

    k, vocab, rows = manifest.k, manifest.vocab_size, b.num_rows
    extras = None if b.k != k else _extras(b, manifest)
    if extras is None:
        return None
    inp, t = b.input_ids, b.tail_mass
    if inp.size and (int(inp.min()) < 0 or int(inp.max()) >= vocab):
        return None
    if t is not None and t.size:
        if not bool(np.isfinite(t).all()):
            return None
        if float(t.min()) < -TAIL_TOLERANCE or float(t.max()) > 1 + TAIL_TOLERANCE:
            return None
    step = max(1, ENCODE_GROUP_VALUES // k)
    lp = b.topk_logprobs
    tails = np.empty(rows, np.float32) if t is None and known_tail(b) is None else None
    if compiled if compiled is not None else _compiled(manifest, rows * k):
        if into is not None:
            ids, stored = into
        elif out is not None:  # faulted in once, reused (fastencode.Outputs)
            ids, stored = out.take(rows, k)
        else:
            ids, stored = _new_outputs(rows, k)
        with _tables_lock:  # one table per writer thread at a time
            table = _tables.pop(vocab, None) or fastencode.StampTable(vocab)
        try:
            for a in range(0, rows, step):
                part = slice(a, a + step)
                if not fastencode.encode_rows(
                    b.topk_ids[part], lp[part], ids[part], stored[part], table, LOGPROB_TOLERANCE
                ):
                    return None
                if tails is not None:  # after the kernel: its rows are in cache
                    tails[part] = tail_from_logprobs(lp[part])
        finally:
            with _tables_lock:
                _tables[vocab] = table
        arrays = {spec.TOPK_LOGPROBS: stored, spec.TOPK_IDS: ids}
    else:
        got = _encode_numpy(b, manifest, step)
        if got is None:
            return None
        arrays = got
        for a in range(0, rows if tails is not None else 0, step):  # no batch-sized temporaries
            tails[a : a + step] = tail_from_logprobs(lp[a : a + step])  # type: ignore[index]
    if tails is not None:
        keep_tail(b, tails)
    arrays[spec.TAIL_MASS] = b.tail_or_computed().clip(0.0, 1.0).astype(manifest.tail_mass_dtype)
    arrays.update(extras)
    return arrays


def _encode_numpy(b: SequenceBatch, manifest: Manifest, step: int) -> dict[str, np.ndarray] | None:
    """The top-k arrays of :func:`_encode_rows` with NumPy alone (checked in groups of ``step``
    rows; ``None`` when one fails)."""
    ids, lp, rows = b.topk_ids, b.topk_logprobs, b.num_rows
    half = manifest.logprob_dtype == "float16"
    stored = np.empty((rows, manifest.k), np.uint16) if half else None
    no_tokens = np.zeros(0, np.int32)
    for a in range(0, rows, step):
        part = lp[a : a + step]
        if not rows_pass(no_tokens, ids[a : a + step], part, None, vocab_size=manifest.vocab_size):
            return None
        if stored is not None:
            stored[a : a + step] = _float16_row_delta(part)
    arrays = {spec.TOPK_LOGPROBS: stored} if stored is not None else None
    if arrays is None:
        arrays = encode_logprobs(lp, manifest.logprob_dtype)
    arrays[spec.TOPK_IDS] = np.ascontiguousarray(ids)
    return arrays


def _float16_row_delta(lp: np.ndarray) -> np.ndarray:
    """``encode_logprobs(lp, "float16")``'s stored array, bit for bit (clipped to
    ``[-65504, 0]``, rounded to float16, row deltas of the bit patterns), with the float16
    cast through :func:`._kernels.float_to_half`."""
    c = np.minimum(np.asarray(lp, dtype=np.float32), np.float32(0.0))
    np.maximum(c, np.float32(F16_MIN), out=c)
    return row_delta(kernels.float_to_half(c).view(np.uint16))

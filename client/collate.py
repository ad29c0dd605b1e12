"""Align cached sequences into fixed token-budget items (padding or packing).

Alignment contract (DESIGN.md)
------------------------------
A cached sequence ``x_0 .. x_{L-1}`` carries ``L - 1`` rows; row ``j`` is the teacher's distribution
of ``x_{j+1}`` given ``x_0 .. x_j``. In an item, **position t's target is token t+1 of the same
sequence, and its teacher row is row t of that sequence**::

    input_ids[t]  = x_{s+t}              labels[t] = x_{s+t+1}  (or -100)
    topk_ids[t]   = row (s+t).topk_ids   loss_mask[t] = labels[t] != -100

``labels`` is ``-100`` (``IGNORE_INDEX``) at each sequence's last token (it has no next token, so no
row) and on padding. So ``student_logits[t]`` is trained against ``topk_*[t]`` and ``labels[t]``
with no further shift.

Items
-----
A *piece* is a token range ``[start, stop)`` of one sequence. A sequence longer than the budget
``T`` is cut into pieces of ``T`` tokens (``long_sequences="split"``: no row is lost, piece
``[aT, (a+1)T)`` ends with the label ``x_{(a+1)T}``) or keeps only its first ``T`` tokens
(``"truncate"``). Pieces without any row are dropped. A cut sequence's later pieces start at
position 0, but their cached rows are the teacher's distribution given the whole prefix, which
the student does not see there (:func:`cut_rows` counts them; ``CacheDataset`` warns with
:class:`~logitcache.client.errors.CutSequenceWarning`): for exact targets, score the corpus in
pieces of at most ``T`` tokens or train with ``T`` >= the longest sequence.

* ``mode="pad"``: one piece per item, right-padded to ``T``.
* ``mode="pack"``: pieces are packed greedily in stream order; a piece that does not fit in the
  current item closes it (padding its rest) and starts the next one. Pieces are never split across
  items. Boundaries survive packing: ``position_ids`` restart at 0 at every piece and
  ``segment_ids`` numbers the pieces of an item ``1, 2, ...`` (``0`` on padding), so a
  block-diagonal (document) attention mask is ``segment_ids[:, None] == segment_ids[None, :]``
  restricted to non-padding, and ``cu_seqlens`` for varlen attention are the positions where
  ``position_ids == 0`` and ``attention_mask == 1``, plus the number of real tokens (padding is
  one trailing run per item, with ``position_ids = 0``).

Fields of an item (``T`` = budget, ``k`` = top-k width; a batch adds a leading ``B``):
``input_ids`` [T] int64, ``labels`` [T] int64, ``attention_mask`` [T] int64 (1 = token, 0 = pad),
``position_ids`` [T] int64, ``segment_ids`` [T] int64, ``topk_ids`` [T, k] int64 (or int32),
``topk_logprobs`` [T, k] float32, ``tail_mass`` [T] float32, ``loss_mask`` [T] bool.
A sampled cache's batches may keep fewer columns (``trim_sampled``: :func:`trim_padding_columns`).
Positions without a row hold ``topk_ids = 0``, ``topk_logprobs = 0``, ``tail_mass = 0`` and
``loss_mask = False``: mask them (``loss_mask``) in every loss. A record with a stored loss mask
(chat data, cache_format FORMAT.md 4.6: row ``j`` trained on iff ``record.loss_mask[j] = 1``)
also has ``loss_mask = False`` on its masked rows (e.g. the prompt), so every loss that takes
``mask=batch["loss_mask"]`` trains on the response rows only; ``labels`` keep the tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from .errors import ConfigError, SourceError

__all__ = [
    "IGNORE_INDEX",
    "ItemPlan",
    "plan_items",
    "build_batch",
    "trim_padding_columns",
    "PADDING_LOGPROB_MAX",
]

IGNORE_INDEX = -100

#: A column of a sampled row whose logprob is at most this is padding (weight ``exp(lp) = 0``
#: exactly, in float32 and float64 alike): the format pads sampled rows with ``-65504``
#: (cache_format FORMAT.md 4.4; ``-inf`` is padding too), and no drawn id's weight is that small.
PADDING_LOGPROB_MAX = -1.0e4

Mode = Literal["pad", "pack"]
LongPolicy = Literal["split", "truncate"]


@dataclass(frozen=True)
class ItemPlan:
    """Pieces of a stream of items, in CSR form.

    Item ``i`` is made of pieces ``item_offsets[i] : item_offsets[i + 1]``; piece ``p`` is tokens
    ``piece_start[p] : piece_stop[p]`` of cache sequence ``piece_seq[p]`` and carries
    ``piece_rows[p]`` rows (one fewer than its tokens when it ends at its sequence's last token).
    """

    piece_seq: np.ndarray
    piece_start: np.ndarray
    piece_stop: np.ndarray
    piece_rows: np.ndarray
    item_offsets: np.ndarray

    @property
    def num_items(self) -> int:
        """Number of items in the plan."""
        return len(self.item_offsets) - 1

    def item_pieces(self, item: int) -> slice:
        """Slice of the piece arrays that make item ``item``."""
        return slice(int(self.item_offsets[item]), int(self.item_offsets[item + 1]))

    def sequences_of(self, items: Sequence[int] | np.ndarray) -> np.ndarray:
        """Sorted unique cache sequence indices the given items need."""
        if len(items) == 0:
            return np.zeros(0, dtype=np.int64)
        parts = [self.piece_seq[self.item_pieces(int(i))] for i in items]
        return np.unique(np.concatenate(parts))

    @property
    def num_rows(self) -> int:
        """Supervised positions (teacher rows) in the whole plan."""
        return int(self.piece_rows.sum())


def cut_rows(lengths: np.ndarray, tokens_per_item: int) -> int:
    """Rows that ``long_sequences="split"`` puts in a piece after its sequence's first: rows
    whose cached target conditions on tokens the student does not see in that piece. A sequence
    of ``L`` tokens has ``L - 1`` rows and its first piece holds ``T`` of them."""
    rows = np.maximum(np.asarray(lengths, dtype=np.int64) - 1, 0)
    return int(np.maximum(rows - int(tokens_per_item), 0).sum())


def plan_items(
    order: np.ndarray,
    lengths: np.ndarray,
    tokens_per_item: int,
    mode: Mode = "pack",
    long_sequences: LongPolicy = "split",
) -> ItemPlan:
    """Plan the items of a stream of sequences (``order`` = cache indices, read in that order).

    Depends only on the lengths, so every rank and worker computes the same plan without reading
    data. ``lengths[i]`` is the token count ``L`` of cache sequence ``i``.
    """
    if tokens_per_item < 2:
        raise ConfigError(f"tokens_per_item must be >= 2, got {tokens_per_item}")
    if mode not in ("pad", "pack"):
        raise ConfigError(f"mode must be 'pad' or 'pack', got {mode!r}")
    if long_sequences not in ("split", "truncate"):
        raise ConfigError(f"long_sequences must be 'split' or 'truncate', got {long_sequences!r}")
    T = int(tokens_per_item)
    order = np.asarray(order, dtype=np.int64)
    seq_len = np.asarray(lengths, dtype=np.int64)[order]
    rows = np.maximum(seq_len - 1, 0)
    if long_sequences == "split":
        count = -(-rows // T)  # pieces that hold at least one row
    else:
        count = (rows > 0).astype(np.int64)
    piece_seq = np.repeat(order, count)
    first = np.cumsum(count) - count
    piece_rank = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(first, count)
    piece_start = piece_rank * T
    piece_stop = np.minimum(piece_start + T, np.repeat(seq_len, count))
    sizes = piece_stop - piece_start
    piece_rows = np.minimum(piece_stop, np.repeat(rows, count)) - piece_start
    if mode == "pad":
        item_offsets = np.arange(len(sizes) + 1, dtype=np.int64)
    else:
        item_offsets = _greedy_pack(sizes, T)
    return ItemPlan(piece_seq, piece_start, piece_stop, piece_rows, item_offsets)


def _greedy_pack(sizes: np.ndarray, budget: int) -> np.ndarray:
    """CSR offsets of items made by packing ``sizes`` in order, a new item when one overflows."""
    offsets = [0]
    fill = 0
    for p, size in enumerate(sizes.tolist()):
        if fill + size > budget:
            offsets.append(p)
            fill = 0
        fill += size
    if len(sizes):
        offsets.append(len(sizes))
    return np.asarray(offsets, dtype=np.int64)


def build_batch(
    plan: ItemPlan,
    items: Sequence[int] | np.ndarray,
    records: Mapping[int, Any],
    tokens_per_item: int,
    k: int,
    *,
    pad_token_id: int = 0,
    ids_dtype: Any = np.int64,
    hidden_dim: int | None = None,
) -> dict[str, np.ndarray]:
    """Assemble ``items`` of ``plan`` into arrays with a leading batch dimension ``B = len(items)``.

    ``records`` maps cache sequence index -> ``SequenceRecord`` (``input_ids [L]``,
    ``topk_ids [L-1, k0]``, ``topk_logprobs [L-1, k0]``, ``tail_mass [L-1] | None``) with
    ``k0 >= k``. When ``k < k0`` the first ``k`` columns are kept (rows are sorted by descending
    logprob) and the dropped columns' mass moves to the tail: ``tail' = tail + sum exp(dropped)``.
    A missing ``tail_mass`` is derived as ``clip(1 - sum(exp(topk_logprobs)), 0, 1)``, its
    definition.

    ``hidden_dim``: records of a hidden cache (FORMAT.md 4.10, ``hidden [L-1, d]`` as bfloat16
    bit patterns): the batch has ``hidden`` ``[B, T, d]`` uint16 (zeros where there is no
    row) in place of the top-k arrays.
    """
    B, T = len(items), int(tokens_per_item)
    out = {
        "input_ids": np.full((B, T), pad_token_id, dtype=np.int64),
        "labels": np.full((B, T), IGNORE_INDEX, dtype=np.int64),
        "attention_mask": np.zeros((B, T), dtype=np.int64),
        "position_ids": np.zeros((B, T), dtype=np.int64),
        "segment_ids": np.zeros((B, T), dtype=np.int64),
    }
    if hidden_dim is None:
        out["topk_ids"] = np.zeros((B, T, k), dtype=ids_dtype)
        out["topk_logprobs"] = np.zeros((B, T, k), dtype=np.float32)
        out["tail_mass"] = np.zeros((B, T), dtype=np.float32)
    else:
        out["hidden"] = np.zeros((B, T, hidden_dim), dtype=np.uint16)
    keep = np.ones((B, T), dtype=bool)  # False on rows a record's stored loss mask excludes
    for b, item in enumerate(items):
        offset = 0
        span = plan.item_pieces(int(item))
        for segment, (seq, start, stop) in enumerate(
            zip(
                plan.piece_seq[span].tolist(),
                plan.piece_start[span].tolist(),
                plan.piece_stop[span].tolist(),
                strict=True,
            ),
            start=1,
        ):
            record = records.get(seq)
            if record is None:
                raise SourceError(f"source did not return sequence {seq}")
            _place(out, b, offset, record, start, stop, segment, k)
            row_mask = getattr(record, "loss_mask", None)
            if row_mask is not None:
                rows = np.asarray(row_mask)[start : min(stop, len(record.input_ids) - 1)]
                keep[b, offset : offset + len(rows)] = rows.astype(bool)
            offset += stop - start
    out["loss_mask"] = (out["labels"] != IGNORE_INDEX) & keep
    return out


def _place(
    out: dict[str, np.ndarray],
    b: int,
    offset: int,
    record: Any,
    start: int,
    stop: int,
    segment: int,
    k: int,
) -> None:
    """Copy tokens ``[start, stop)`` of ``record`` and their rows to item ``b`` at ``offset``."""
    ids = np.asarray(record.input_ids)
    n_tok = stop - start
    if len(ids) < stop:
        raise SourceError(f"sequence {record.key!r} has {len(ids)} tokens, plan needs {stop}")
    row_stop = min(stop, len(ids) - 1)
    n_rows = row_stop - start
    sl = slice(offset, offset + n_tok)
    rl = slice(offset, offset + n_rows)
    out["input_ids"][b, sl] = ids[start:stop]
    out["attention_mask"][b, sl] = 1
    out["position_ids"][b, sl] = np.arange(n_tok)
    out["segment_ids"][b, sl] = segment
    out["labels"][b, rl] = ids[start + 1 : row_stop + 1]
    if "hidden" in out:  # a hidden cache's rows (FORMAT.md 4.10)
        h = np.asarray(record.hidden)
        if h.dtype != np.uint16 or h.shape[0] != len(ids) - 1:
            raise SourceError(f"sequence {record.key!r}: hidden rows {h.dtype} {h.shape}")
        out["hidden"][b, rl] = h[start:row_stop]
        return
    topk_ids = np.asarray(record.topk_ids)
    topk_lp = np.asarray(record.topk_logprobs)
    if topk_ids.shape[0] != len(ids) - 1 or topk_lp.shape != topk_ids.shape:
        raise SourceError(
            f"sequence {record.key!r}: {len(ids)} tokens but topk arrays of shape "
            f"{topk_ids.shape} / {topk_lp.shape} (need [L-1, k])"
        )
    if topk_ids.shape[1] < k:
        raise SourceError(f"sequence {record.key!r} has k={topk_ids.shape[1]} < requested {k}")
    lp = topk_lp[start:row_stop]
    out["topk_ids"][b, rl] = topk_ids[start:row_stop, :k]
    out["topk_logprobs"][b, rl] = lp[:, :k]
    tail = record.tail_mass
    if tail is None:
        tail_rows = 1.0 - np.exp(lp[:, :k].astype(np.float64)).sum(axis=1)
    else:
        tail_rows = np.asarray(tail, dtype=np.float64)[start:row_stop]
        if k < lp.shape[1]:
            tail_rows = tail_rows + np.exp(lp[:, k:].astype(np.float64)).sum(axis=1)
    out["tail_mass"][b, rl] = np.clip(tail_rows, 0.0, 1.0)


def trim_padding_columns(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Drop the trailing ``topk_*`` columns that are padding in every row of a batch.

    Sampled rows (cache_format FORMAT.md 4.4) store their distinct draws first, then padding of
    log-weight ``-65504`` (weight 0). The width kept is ``1 +`` the last column holding a value
    above :data:`PADDING_LOGPROB_MAX` in a position with a teacher row (at least one column);
    only trailing columns go, so the loss (``targets="sampled"``) has the same value and
    gradients up to float summation order. Returns a new dict; trimmed arrays are contiguous
    copies, the others the same objects.
    """
    lp = arrays["topk_logprobs"]
    rows = arrays["labels"] != IGNORE_INDEX
    used = ~(lp <= PADDING_LOGPROB_MAX) & rows[..., None]  # NaN is kept (the loss refuses it)
    used = used.reshape(-1, lp.shape[-1]).any(axis=0)
    nz = np.flatnonzero(used)
    width = int(nz[-1]) + 1 if len(nz) else 1
    if width == lp.shape[-1]:
        return dict(arrays)
    out = dict(arrays)
    out["topk_ids"] = np.ascontiguousarray(arrays["topk_ids"][..., :width])
    out["topk_logprobs"] = np.ascontiguousarray(lp[..., :width])
    return out

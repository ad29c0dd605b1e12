"""What a :class:`~logitcache.client.dataset.CacheDataset` streams, and how it reads it.

Two frozen dataclasses, apart on purpose:

* :class:`StreamConfig`: the stream itself (packing, order, sharding, the item tensors). Its
  order-shaping fields are fingerprinted into the loader state, so a resume with another
  stream is refused.
* :class:`ReadOptions`: read tuning (prefetch, threads). The items and their order never
  depend on it.

Where to read from (a path, ``s3://...``, a server URL with its cache name, storage options,
an API key, HTTP transport settings) is the source's business:
:func:`~logitcache.client.sources.open_source`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .collate import LongPolicy, Mode
from .errors import ConfigError
from .selection import check_fraction

__all__ = ["ReadOptions", "StreamConfig", "TRAINER_SHUFFLE"]

#: The full shuffle measured on a 16-core trainer host (benchmarks/results/loader.md): blocks of
#: 64 sequences, windows of 4 blocks (a batch draws from 4 random regions of the cache), 24 lanes
#: (so 1, 2, 3, 4, 6, 8, 12 or 24 DataLoader workers each decode only their own blocks). Holds
#: about ``24 * 5`` blocks of decoded records per rank (~4.5 GB at 735 tokens per sequence, k=100),
#: split among the workers. ``StreamConfig(**TRAINER_SHUFFLE, ids_dtype=torch.int32)``.
#: In one process (no DataLoader workers) ``lanes=1`` starts faster: with 24 lanes every lane's
#: first window is read before the 24th batch.
TRAINER_SHUFFLE: dict[str, int] = {"shuffle_block_size": 64, "shuffle_window": 4, "lanes": 24}


@dataclass(frozen=True)
class StreamConfig:
    """The item stream of a :class:`~logitcache.client.dataset.CacheDataset`.

    Attributes
    ----------
    tokens_per_item:
        Positions per item ``T``.
    mode:
        ``"pack"`` (several sequences per item, boundaries kept) or ``"pad"`` (one per item).
    long_sequences:
        ``"split"`` sequences longer than ``T`` into ``T``-token pieces, or ``"truncate"`` them.
        Split pieces after a sequence's first are trained against rows the teacher scored with
        the whole prefix in view, which the student does not see there: the dataset warns
        (:class:`~logitcache.client.errors.CutSequenceWarning`, with the share of rows).
    batch_size:
        ``None``: yield single items (tensors ``[T, ...]``). An int ``B``: yield batches
        ``[B, T, ...]`` of consecutive items (the last one may be smaller).
    seed, shuffle, shuffle_block_size, shuffle_window:
        Order of sequences per epoch (:func:`~logitcache.client.order.epoch_order`; the
        randomness of each mode: :mod:`logitcache.client.order`). ``shuffle_block_size=1``
        (default): a uniform full shuffle, one small store read per sequence. ``b > 1``: blocks
        of ``b`` neighbours, one contiguous read each; ``shuffle_window=w`` mixes ``w`` random
        blocks at a time, so a batch draws from ``w`` distant regions (each iterating process
        holds about ``w + 1`` blocks). Measured rates: benchmarks/results/loader.md.
    lanes:
        Cut this rank's epoch stream into ``lanes`` parts planned separately whose units
        (batches) are interleaved, unit ``u`` from lane ``u mod lanes``
        (:func:`~logitcache.client.order.lane_item_order`). With ``num_workers`` dividing
        ``lanes``, each DataLoader worker reads only its own lanes' blocks. The stream depends
        on ``lanes``, not on ``num_workers``. ``24`` suits 1, 2, 3, 4, 6, 8, 12 and 24 workers.
    rank, world_size:
        Explicit sharding; default ``torch.distributed``'s when initialised, else ``(0, 1)``.
    even_ranks:
        Cut every rank's epoch to the item count of the shortest rank (DDP steps must match);
        drops at most a few items per epoch. Off by default: then ranks cover every sequence.
    topk:
        Keep the first ``topk <= k`` columns of each row (their dropped mass goes to the tail).
    ids_dtype:
        dtype of ``topk_ids`` (``torch.int64`` default, or ``torch.int32``).
    pad_token_id:
        ``input_ids`` value on padding.
    trim_sampled:
        For a ``targets="sampled"`` cache (FORMAT.md 4.4): cut each unit's ``topk_ids`` /
        ``topk_logprobs`` to the columns some row of that unit uses
        (:func:`~logitcache.client.collate.trim_padding_columns`): the loss does less work, its
        value and gradients are unchanged (a dropped column has weight 0). The width then varies
        from unit to unit (at most ``k``); ``False`` keeps a fixed ``[..., k]`` shape
        (``torch.compile`` without dynamic shapes, CUDA graphs). Top-k caches are never trimmed.
    follow:
        Follow a cache that a running job is still filling: every ``set_epoch`` first adopts the
        sequences committed since (under ``torch.distributed`` the ranks agree on the smallest
        count any of them sees, so call ``set_epoch`` on every rank). Epoch ``e`` is planned over
        the sequences committed when it was set, and the loader state records that count.
    entropy_top_fraction:
        ``x`` in ``(0, 1]``: train on the ``ceil(x n)`` highest teacher-entropy rows of each
        sequence only (``loss_mask`` false on the others; the rule:
        :mod:`logitcache.client.selection`). Needs a cache with per-row entropy (FORMAT.md 4.9).
        ``None`` (default): every row.
    """

    tokens_per_item: int = 2048
    mode: Mode = "pack"
    long_sequences: LongPolicy = "split"
    batch_size: int | None = None
    seed: int = 0
    shuffle: bool = True
    shuffle_block_size: int = 1
    shuffle_window: int = 1
    lanes: int = 1
    rank: int | None = None
    world_size: int | None = None
    even_ranks: bool = False
    topk: int | None = None
    ids_dtype: torch.dtype = torch.int64
    pad_token_id: int = 0
    trim_sampled: bool = True
    follow: bool = False
    entropy_top_fraction: float | None = None

    def __post_init__(self) -> None:
        check_fraction(self.entropy_top_fraction)
        if self.batch_size is not None and self.batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1 or None, got {self.batch_size}")
        if self.lanes < 1:
            raise ConfigError(f"lanes must be >= 1, got {self.lanes}")
        if self.ids_dtype not in (torch.int64, torch.int32):
            raise ConfigError(f"ids_dtype must be torch.int64 or torch.int32, got {self.ids_dtype}")
        if self.seed < 0:
            raise ConfigError(f"seed must be >= 0, got {self.seed}")
        if self.shuffle_block_size < 1 or self.shuffle_window < 1:
            raise ConfigError(
                "shuffle_block_size and shuffle_window must be >= 1, got "
                f"{self.shuffle_block_size}, {self.shuffle_window}"
            )
        if self.topk is not None and self.topk < 1:
            raise ConfigError(f"topk must be >= 1, got {self.topk}")

    def fingerprint_fields(self) -> dict[str, object]:
        """The settings that shape the item stream (beside the cache and its lengths), as the
        loader state's fingerprint hashes them. ``seed`` is checked on its own; the window and
        the lanes appear only when not 1, so states saved before they existed still match."""
        fields: dict[str, object] = {
            "tokens_per_item": self.tokens_per_item,
            "mode": self.mode,
            "long_sequences": self.long_sequences,
            "shuffle": self.shuffle,
            "shuffle_block_size": self.shuffle_block_size,
            "even_ranks": self.even_ranks,
        }
        if self.shuffle_window != 1:
            fields["shuffle_window"] = self.shuffle_window
        if self.lanes != 1:
            fields["lanes"] = self.lanes
        if self.entropy_top_fraction is not None:
            fields["entropy_top_fraction"] = self.entropy_top_fraction
        return fields


@dataclass(frozen=True)
class ReadOptions:
    """How a :class:`~logitcache.client.dataset.CacheDataset` reads (never what it yields).

    Attributes
    ----------
    prefetch:
        Units prepared ahead by the background thread of each iterating process.
    read_threads:
        Store reads (``source.fetch`` calls) each iterating process runs at once, ahead of the
        units that need them (:class:`~logitcache.client.readahead.ReadAhead`; decoding releases
        the GIL). ``None``: :func:`~logitcache.client.readahead.default_read_threads` (4 in the
        trainer process of a 16-core host, 2 in each of 8 DataLoader workers).
    decode_threads:
        ``1`` (default): each store read is decoded in the thread that issued it. ``n > 1``
        (a LocalSource or an :class:`~logitcache.client.sources.HttpSource`): the reader
        decodes the arrays of each fetch on ``n`` threads; it pays when few fetches are in
        flight and cores are idle.
    """

    prefetch: int = 4
    read_threads: int | None = None
    decode_threads: int = 1

    def __post_init__(self) -> None:
        if self.prefetch < 1:
            raise ConfigError(f"prefetch must be >= 1, got {self.prefetch}")
        if self.read_threads is not None and self.read_threads < 1:
            raise ConfigError(f"read_threads must be >= 1 or None, got {self.read_threads}")
        if self.decode_threads < 1:
            raise ConfigError(f"decode_threads must be >= 1, got {self.decode_threads}")

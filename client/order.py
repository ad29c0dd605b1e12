"""The order in which a rank reads a cache: pure numpy functions of (seed, epoch, world).

Contract
--------
* :func:`epoch_order` is a permutation of ``range(num_sequences)`` that depends only on
  ``(num_sequences, seed, epoch, block_size, window)``. The index range is cut into contiguous
  blocks of ``b = block_size`` sequences, the blocks are permuted uniformly, the permuted block
  list is cut into consecutive *windows* of ``w = window`` blocks, and the sequences of each
  window (``w * b`` of them, from ``w`` random places of the cache) are permuted uniformly. So:

  - ``b = 1`` (any ``w``): a uniform random permutation of all sequences (full shuffle); every
    sequence is a separate small read.
  - ``b > 1, w = 1``: block shuffle; the items of a batch come from one or two blocks of ``b``
    neighbouring sequences; every block is one contiguous read.
  - ``b > 1, w > 1``: windowed shuffle; each window's sequences are in uniform random order, so
    a batch draws from ``w`` random, distant regions of the cache, while the reader still reads
    ``w`` whole blocks per window (one contiguous read each) and holds one window in memory.
    Which sequences share a window is random, but neighbours in a block always share one
    (``w * b >= num_sequences`` is a uniform full shuffle again).
* :func:`rank_partition` cuts that permutation into ``world_size`` contiguous spans whose sizes
  differ by at most one (``numpy.array_split``). The spans are disjoint and their union is the whole
  permutation, so within one epoch no sequence reaches two ranks and none is dropped.
* Lanes (optional, ``lanes = L > 1``): the rank's span is cut into ``L`` contiguous parts
  (``numpy.array_split``), each planned into items on its own, and :func:`lane_item_order`
  interleaves their *units*: unit ``r`` of lane 0, unit ``r`` of lane 1, ..., then unit ``r + 1``
  (partial last units of each lane go to the end). Unit ``u`` then comes from lane ``u mod L``
  (until lanes of unequal length run out), so with ``n`` DataLoader workers, ``n`` dividing
  ``L``, worker ``w`` only ever needs the sequences of lanes ``w, w + n, ...``: each shuffle block
  is read and decoded by one worker, not by all of them. The stream depends on ``L``, never on
  ``n``.
* :func:`worker_units` deals the units (items or batches) of one rank's stream to DataLoader
  workers round-robin: worker ``w`` of ``n`` gets units ``w, w + n, w + 2n, ...``. PyTorch's
  DataLoader (``in_order=True``, the default) takes one unit from each live worker in turn, so the
  stream the trainer sees is the rank's stream in its original order, whatever ``num_workers`` is.
"""

from __future__ import annotations

import numpy as np

from .errors import ConfigError

__all__ = ["epoch_order", "lane_item_order", "rank_partition", "worker_units"]


def epoch_order(
    num_sequences: int, seed: int, epoch: int, block_size: int = 1, window: int = 1
) -> np.ndarray:
    """Return the epoch's permutation of sequence indices (``int64``, length ``num_sequences``).

    ``block_size`` and ``window``: see the module docstring (``window=1``: blocks in plain
    permutation order). The generator is
    ``numpy.random.default_rng([seed, epoch])`` (PCG64 seeded through ``SeedSequence``): the same
    ``(seed, epoch)`` gives the same order on every machine running the same numpy major
    version, and different epochs give independent orders.
    """
    if num_sequences < 0:
        raise ConfigError(f"num_sequences must be >= 0, got {num_sequences}")
    if block_size < 1 or window < 1:
        raise ConfigError(f"block_size and window must be >= 1, got {block_size}, {window}")
    if seed < 0 or epoch < 0:
        raise ConfigError(f"seed and epoch must be >= 0, got seed={seed}, epoch={epoch}")
    rng = np.random.default_rng([seed, epoch])
    if block_size == 1:
        return rng.permutation(num_sequences).astype(np.int64)
    num_blocks = -(-num_sequences // block_size)
    blocks = rng.permutation(num_blocks)
    parts = []
    for w in range(0, num_blocks, window):
        members = np.concatenate(
            [
                np.arange(b * block_size, min((b + 1) * block_size, num_sequences))
                for b in blocks[w : w + window].tolist()
            ]
        )
        parts.append(members[rng.permutation(len(members))])
    if not parts:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate(parts).astype(np.int64)


def rank_partition(order: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """Return rank ``rank``'s contiguous span of ``order`` (spans differ in size by at most one)."""
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank must be in [0, {world_size}), got {rank}")
    return np.array_split(order, world_size)[rank]


def worker_units(num_units: int, worker: int, num_workers: int) -> np.ndarray:
    """Return the unit indices worker ``worker`` of ``num_workers`` produces, in order."""
    if num_workers < 1:
        raise ConfigError(f"num_workers must be >= 1, got {num_workers}")
    if not 0 <= worker < num_workers:
        raise ConfigError(f"worker must be in [0, {num_workers}), got {worker}")
    return np.arange(worker, num_units, num_workers, dtype=np.int64)


def lane_item_order(item_counts: list[int], unit: int) -> np.ndarray:
    """Item order that interleaves the units of lanes (see the module docstring).

    Lane ``l`` owns items ``[o_l, o_l + item_counts[l])`` with ``o_l = sum(item_counts[:l])``.
    Consecutive groups of ``unit`` items of the returned order are whole units of one lane, lane
    after lane in turn; the items of each lane's partial last unit come last, lane by lane. The
    result is a permutation of ``range(sum(item_counts))``.
    """
    if unit < 1:
        raise ConfigError(f"unit must be >= 1, got {unit}")
    counts = [int(c) for c in item_counts]
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    full = [c // unit for c in counts]
    parts: list[np.ndarray] = []
    for r in range(max(full, default=0)):
        for lane, f in enumerate(full):
            if r < f:
                first = offsets[lane] + r * unit
                parts.append(np.arange(first, first + unit, dtype=np.int64))
    for lane, f in enumerate(full):
        parts.append(np.arange(offsets[lane] + f * unit, offsets[lane + 1], dtype=np.int64))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

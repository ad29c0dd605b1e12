"""Shuffle modes of the loader: window order exactness, coverage, partition, resume, read counts.

Real stores written through ``CacheWriter``; the read-count test uses a real ``LocalSource``
that records what it was asked for.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from client_support import (
    K,
    build_cache,
    collect,
    make_dataset,
    make_sequences,
    same_stream,
    segments,
)
from logitcache.client import CacheDataLoader, CacheDataset, ReadOptions, StreamConfig
from logitcache.client.errors import StateError
from logitcache.client.order import epoch_order, lane_item_order, rank_partition
from logitcache.client.sources import LocalSource

NUM_SEQ = 45


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list]:
    url = str(tmp_path_factory.mktemp("shuffle") / "cache")
    return url, build_cache(url, make_sequences(NUM_SEQ, seed=9, max_len=40))


def _block_order_reference(n: int, seed: int, epoch: int, b: int) -> np.ndarray:
    """The block shuffle as written before windows existed (states saved then must still load)."""
    rng = np.random.default_rng([seed, epoch])
    parts = []
    for block in rng.permutation(-(-n // b)):
        start = int(block) * b
        parts.append(start + rng.permutation(min(start + b, n) - start))
    return np.concatenate(parts)


@pytest.mark.parametrize("n,b,w", [(101, 7, 3), (100, 10, 4), (5, 2, 9)])
def test_window_order_is_whole_blocks_mixed_per_window(n: int, b: int, w: int) -> None:
    order = epoch_order(n, seed=3, epoch=1, block_size=b, window=w)
    assert sorted(order.tolist()) == list(range(n))
    assert np.array_equal(order, epoch_order(n, seed=3, epoch=1, block_size=b, window=w))
    assert not np.array_equal(order, epoch_order(n, seed=3, epoch=2, block_size=b, window=w))
    # cut the order where each window ends: every window is exactly the union of w whole blocks
    pos = 0
    windows = 0
    while pos < n:
        blocks: set[int] = set()
        size = 0
        while len(blocks) < w and pos + size < n:
            # every block met in the prefix, plus the one of the next sequence
            blocks |= {int(i) // b for i in order[pos : pos + size + 1]}
            size = sum(min((k + 1) * b, n) - k * b for k in blocks)
        members = order[pos : pos + size]
        assert {int(i) // b for i in members} == blocks
        assert len(members) == len(set(members.tolist())) == size
        pos += size
        windows += 1
    num_blocks = -(-n // b)
    assert windows == -(-num_blocks // w)
    # the sequences of a window are interleaved, not block after block (not a block shuffle)
    if w > 1 and n > b * w:
        assert not np.array_equal(order, _block_order_reference(n, 3, 1, b))


@pytest.mark.parametrize("b", [1, 7])
def test_window_one_is_the_earlier_block_order(b: int) -> None:
    for epoch in range(3):
        assert np.array_equal(
            epoch_order(101, seed=5, epoch=epoch, block_size=b, window=1),
            _block_order_reference(101, 5, epoch, b),
        )


@pytest.mark.parametrize("world_size", [1, 3])
def test_windowed_ranks_cover_every_sequence_once(cache: tuple[str, list], world_size: int) -> None:
    url, records = cache
    per_rank = []
    for rank in range(world_size):
        ds = CacheDataset(
            url,
            StreamConfig(
                tokens_per_item=64,
                seed=2,
                shuffle_block_size=4,
                shuffle_window=3,
                rank=rank,
                world_size=world_size,
            ),
        )
        per_rank.append(Counter(s for u in collect(ds) for s in segments(u)))
    assert sum(per_rank, Counter()) == Counter(tuple(r.input_ids.tolist()) for r in records)
    for a in range(world_size):
        for c in range(a + 1, world_size):
            assert not set(per_rank[a]) & set(per_rank[c])


@pytest.mark.parametrize("block,window,lanes", [(1, 1, 1), (4, 3, 1), (4, 2, 2)])
def test_resume_mid_epoch_with_workers(
    cache: tuple[str, list], block: int, window: int, lanes: int
) -> None:
    url, _ = cache

    def loader(workers: int) -> CacheDataLoader:
        ds = CacheDataset(
            url,
            StreamConfig(
                tokens_per_item=40,
                batch_size=2,
                seed=8,
                shuffle_block_size=block,
                shuffle_window=window,
                lanes=lanes,
            ),
        )
        ds.set_epoch(1)
        return CacheDataLoader(ds, num_workers=workers)

    full = collect(loader(0))
    assert len(full) > 6
    assert same_stream(collect(loader(2)), full)
    first = loader(2)
    head = []
    for unit in first:
        head.append({k: v.numpy().copy() for k, v in unit.items()})
        if len(head) == 4:
            break
    state = json.loads(json.dumps(first.state_dict()))
    resumed = loader(2)
    resumed.load_state_dict(state)
    assert same_stream(head, full[:4])
    assert same_stream(collect(resumed), full[4:])
    # the window is part of the configuration a state belongs to
    other = CacheDataset(
        url,
        StreamConfig(
            tokens_per_item=40,
            batch_size=2,
            seed=8,
            shuffle_block_size=block,
            shuffle_window=window + 1,
            lanes=lanes,
        ),
    )
    with pytest.raises(StateError):
        other.load_state_dict(state)


class _CountingSource(LocalSource):
    """A real LocalSource that records every index it was asked to fetch."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.asked: Counter[int] = Counter()
        self.calls: list[list[int]] = []

    def fetch(self, indices):  # noqa: ANN001, ANN201 - LocalSource.fetch's signature
        indices = list(indices)
        self.asked.update(int(i) for i in indices)
        self.calls.append(sorted(int(i) for i in indices))
        return super().fetch(indices)


@pytest.mark.parametrize("block,window", [(4, 1), (4, 3), (5, 20)])
def test_block_and_window_modes_read_each_sequence_once(
    cache: tuple[str, list], block: int, window: int
) -> None:
    url, _ = cache
    source = _CountingSource(url)
    ds = CacheDataset(
        source,
        StreamConfig(tokens_per_item=48, seed=4, shuffle_block_size=block, shuffle_window=window),
    )
    assert len(collect(ds)) == ds.num_items()
    assert source.asked == Counter(range(NUM_SEQ))


@pytest.mark.parametrize(
    "settings",
    [
        {"shuffle": False},
        {"shuffle_block_size": 1},
        {"shuffle_block_size": 4, "shuffle_window": 3, "lanes": 3, "batch_size": 2},
    ],
)
def test_read_threads_do_not_change_the_stream_and_read_once(
    cache: tuple[str, list], settings: dict
) -> None:
    """ReadAhead runs reads in threads ahead of the units: same stream, each sequence read once."""
    url, _ = cache
    streams = []
    for threads in (1, 3):
        source = _CountingSource(url)
        ds = make_dataset(source, tokens_per_item=48, seed=6, read_threads=threads, **settings)
        streams.append(collect(ds))
        assert source.asked == Counter(range(NUM_SEQ)), threads
    assert len(streams[0]) == len(make_dataset(url, tokens_per_item=48, seed=6, **settings))
    assert same_stream(streams[0], streams[1])


def test_read_ahead_frees_each_read_after_its_last_unit_and_passes_errors(
    cache: tuple[str, list],
) -> None:
    from logitcache.client.errors import SourceError
    from logitcache.client.readahead import ReadAhead

    url, _ = cache
    units = [np.arange(a, min(a + 3, NUM_SEQ)) for a in range(0, NUM_SEQ, 3)]
    source = _CountingSource(url)
    reads = ReadAhead(source, units, block=5, num_sequences=NUM_SEQ, threads=2, ahead=2)
    try:
        for u, seqs in enumerate(units):
            got = reads.records(u)
            assert set(seqs.tolist()) <= set(got)
            live = {r for r in reads._done}
            assert len(live) <= 2, (u, live)  # only the blocks the next units still need
    finally:
        reads.close()
    blocks = [list(range(b, b + 5)) for b in range(0, NUM_SEQ, 5)]
    assert sorted(source.calls) == blocks  # one read per block of 5 sequences, each read once

    class Broken(LocalSource):
        def fetch(self, indices):  # noqa: ANN001, ANN201 - LocalSource.fetch's signature
            raise SourceError("store unreachable")

    ds = CacheDataset(
        Broken(url), StreamConfig(tokens_per_item=48), read=ReadOptions(read_threads=2)
    )
    with pytest.raises(SourceError, match="unreachable"):
        collect(ds)


def test_bad_window_is_refused(tmp_path: Path, cache: tuple[str, list]) -> None:
    from logitcache.client.errors import ConfigError

    with pytest.raises(ConfigError, match="shuffle_window"):
        CacheDataset(cache[0], StreamConfig(shuffle_window=0))


def test_lane_item_order_interleaves_whole_units() -> None:
    # lanes of 5, 3, 4 items, units of 2: full units round-robin, partial last units at the end
    got = lane_item_order([5, 3, 4], 2)
    assert got.tolist() == [0, 1, 5, 6, 8, 9, 2, 3, 10, 11, 4, 7]
    assert lane_item_order([], 3).size == 0
    big = lane_item_order([17, 0, 9, 12], 4)
    assert sorted(big.tolist()) == list(range(38))


def test_lanes_cover_every_sequence_and_unit_u_reads_lane_u_mod_l(cache: tuple[str, list]) -> None:
    url, records = cache
    lanes, batch = 3, 2
    ds = CacheDataset(
        url,
        StreamConfig(
            tokens_per_item=48,
            batch_size=batch,
            seed=6,
            shuffle_block_size=4,
            shuffle_window=2,
            lanes=lanes,
        ),
    )
    got = Counter(s for u in collect(ds) for s in segments(u))
    assert got == Counter(tuple(r.input_ids.tolist()) for r in records)
    order = epoch_order(NUM_SEQ, 6, 0, 4, 2)
    parts = np.array_split(rank_partition(order, 0, 1), lanes)
    plan = ds.plan()
    units = ds._units(0, 1)
    full = min(len(p) for p in parts) // 40 + 1  # a few rounds where every lane has units
    for u in range(min(len(units), lanes * full)):
        seqs = set(plan.sequences_of(units[u]).tolist())
        assert seqs <= set(parts[u % lanes].tolist()), u
    # lanes are part of the configuration; a bad count is refused
    assert (
        ds.config_fingerprint()
        != CacheDataset(
            url,
            StreamConfig(
                tokens_per_item=48, batch_size=batch, seed=6, shuffle_block_size=4, shuffle_window=2
            ),
        ).config_fingerprint()
    )
    from logitcache.client.errors import ConfigError

    with pytest.raises(ConfigError, match="lanes"):
        CacheDataset(url, StreamConfig(lanes=0))


def test_trainer_shuffle_settings_run_and_match_the_benchmark(cache: tuple[str, list]) -> None:
    """The settings the docs tell users to copy give a full epoch."""
    import torch
    from logitcache.client.dataset import TRAINER_SHUFFLE

    url, records = cache
    # exactly the settings benchmarks/results/loader.md tells users to copy
    ds = make_dataset(
        url, **TRAINER_SHUFFLE, ids_dtype=torch.int32, tokens_per_item=2048, batch_size=8
    )
    units = collect(CacheDataLoader(ds, num_workers=8, pin_memory=True, prefetch_factor=4))
    got = Counter(s for u in units for s in segments(u))
    assert got == Counter(tuple(r.input_ids.tolist()) for r in records)
    assert units[0]["topk_ids"].dtype == np.int32 and units[0]["topk_ids"].shape[-2:] == (2048, K)

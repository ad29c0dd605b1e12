"""Resume is right by construction (issue #14): a trainer loop that calls ``set_epoch`` at every
epoch start, the resumed one included, continues the interrupted epoch exactly, also with
``follow=True`` over a cache that grew between the save and the resume."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from client_support import (
    build_cache,
    collect,
    make_dataset,
    manifest,
    record_for,
    same_stream,
    segments,
)
from logitcache.cache_format import CacheWriter
from logitcache.client import CacheDataLoader, CacheDataset
from logitcache.client.errors import ConfigError

OPTS = {"tokens_per_item": 48, "mode": "pack", "seed": 11}


def _seqs(first: int, count: int) -> list[np.ndarray]:
    """Sequences whose first two tokens name them (i // 97, i % 97), of varied lengths."""
    return [
        np.array([i // 97, i % 97, *range(5, 5 + (i * 7) % 31)], dtype=np.int32)
        for i in range(first, first + count)
    ]


def _grow(url: str, first: int, count: int) -> None:
    records = [record_for(s, key=f"seq-{first + j}") for j, s in enumerate(_seqs(first, count))]
    with CacheWriter.open(url, manifest()) as writer:
        writer.append(records)


@pytest.fixture
def url(tmp_path: Path) -> str:
    path = str(tmp_path / "cache")
    build_cache(path, _seqs(0, 40))
    return path


def _head(units: object, stop: int) -> list[dict]:
    head = []
    for unit in units:  # type: ignore[attr-defined]
        head.append({k: v.numpy().copy() for k, v in unit.items()})
        if len(head) == stop:
            break
    return head


def _state_after(url: str, epoch: int, items: int) -> dict:
    """The dataset state after ``items`` items of ``epoch`` were iterated (num_workers=0)."""
    ds = make_dataset(url, **OPTS)
    ds.set_epoch(epoch)
    it = iter(ds)
    _ = [next(it) for _ in range(items)]
    return ds.state_dict()


@pytest.mark.parametrize("num_workers,batch_size", [(0, None), (0, 2), (2, 2)])
def test_set_epoch_of_the_restored_epoch_keeps_the_position(
    url: str, num_workers: int, batch_size: int | None
) -> None:
    def loader() -> CacheDataLoader:
        return CacheDataLoader(
            make_dataset(url, batch_size=batch_size, **OPTS), num_workers=num_workers
        )

    first = loader()
    first.dataset.set_epoch(1)
    full = collect(first)
    assert len(full) > 5
    interrupted = loader()
    interrupted.dataset.set_epoch(1)
    head = _head(interrupted, 4)
    state = json.loads(json.dumps(interrupted.state_dict()))
    assert state["epoch"] == 1 and state["items_consumed"] == 4 * (batch_size or 1)

    resumed = loader()
    resumed.load_state_dict(state)
    for _ in range(2):  # a trainer's epoch-start hook, and e.g. a second one (HF Trainer)
        resumed.dataset.set_epoch(1)
    assert resumed.state_dict() == state  # nothing moved before the iteration
    rest = collect(resumed)
    assert same_stream(head, full[:4]) and same_stream(rest, full[4:])
    assert resumed.state_dict()["items_consumed"] == resumed.dataset.num_items(1)
    # once the restored stream was read, set_epoch(same) is an ordinary epoch start again
    resumed.dataset.set_epoch(1)
    assert same_stream(collect(resumed), full)


def test_set_epoch_on_the_dataset_itself_after_load_state_dict(url: str) -> None:
    ds = make_dataset(url, **OPTS)
    ds.set_epoch(2)
    full = collect(ds)
    state = _state_after(url, 2, 5)
    again = make_dataset(url, **OPTS)
    again.load_state_dict(state)
    again.set_epoch(2)
    assert again.resume_point == 5 and same_stream(collect(again), full[5:])


def test_set_epoch_of_another_epoch_starts_it_fresh(url: str) -> None:
    state = _state_after(url, 2, 3)
    fresh = make_dataset(url, **OPTS)
    fresh.set_epoch(3)
    want = collect(fresh)
    resumed = make_dataset(url, **OPTS)
    resumed.load_state_dict(state)
    resumed.set_epoch(3)
    assert resumed.resume_point == 0 and resumed.state_dict()["items_consumed"] == 0
    assert same_stream(collect(resumed), want)
    resumed.set_epoch(2)  # the restored epoch after another one: from its beginning too
    assert resumed.resume_point == 0


def test_follow_resume_keeps_the_snapshot_of_a_grown_cache(url: str) -> None:
    """Saved mid-epoch over 40 sequences; the cache grows to 55; the resumed run's
    ``set_epoch(same)`` keeps 40 (the rest of the epoch equals the uninterrupted run's), the
    next epoch adopts 55."""

    def ds() -> CacheDataset:
        return make_dataset(url, batch_size=2, follow=True, **OPTS)

    uninterrupted = ds()
    uninterrupted.set_epoch(1)
    full = collect(uninterrupted)
    interrupted = ds()
    interrupted.set_epoch(1)
    it = iter(interrupted)
    _ = [next(it) for _ in range(3)]
    state = interrupted.state_dict()
    assert state["num_sequences"] == 40
    _grow(url, 40, 15)

    resumed = ds()
    assert resumed.num_sequences == 55  # a new dataset sees the grown cache...
    resumed.load_state_dict(state)
    resumed.set_epoch(1)  # ...the resumed epoch keeps the state's snapshot
    assert resumed.num_sequences == 40
    assert same_stream(collect(resumed), full[3:])
    resumed.set_epoch(2)
    assert resumed.num_sequences == 55
    seen = sorted(t[0] * 97 + t[1] for u in collect(resumed) for t in segments(u))
    assert seen == list(range(55))  # the next epoch covers the sequences committed since


def test_set_epoch_refuses_bad_epochs(url: str) -> None:
    ds = make_dataset(url, **OPTS)
    for bad in (-1, "1", True, 1.0):
        with pytest.raises(ConfigError, match="epoch"):
            ds.set_epoch(bad)  # type: ignore[arg-type]
    assert ds.epoch == 0 and ds.resume_point == 0


@pytest.mark.parametrize("context", ["fork", pytest.param("spawn", marks=pytest.mark.subprocess)])
def test_plain_dataloader_workers_clear_the_restored_mark(url: str, context: str) -> None:
    """A plain ``DataLoader(num_workers=2)`` iterates copies of the dataset in its workers; the
    restored position must still be spent once they read it: repeating the epoch with
    ``set_epoch(same)`` then yields the whole epoch, not the restored tail again."""
    from torch.utils.data import DataLoader

    ds = make_dataset(url, batch_size=2, **OPTS)
    ds.set_epoch(1)
    full = collect(ds)
    resumed = make_dataset(url, batch_size=2, **OPTS)
    resumed.load_state_dict(_state_after_batches(url, 1, 3))
    resumed.set_epoch(1)
    loader = DataLoader(resumed, batch_size=None, num_workers=2, multiprocessing_context=context)
    assert same_stream(collect(loader), full[3:])
    resumed.set_epoch(1)  # the epoch again: the restored stream was read in the workers
    assert resumed.resume_point == 0
    assert same_stream(collect(loader), full)


def _state_after_batches(url: str, epoch: int, batches: int) -> dict:
    ds = make_dataset(url, batch_size=2, **OPTS)
    ds.set_epoch(epoch)
    it = iter(ds)
    _ = [next(it) for _ in range(batches)]
    return ds.state_dict()


def test_a_pickled_dataset_carries_the_pending_mark(url: str) -> None:
    """Outside a worker start the mark travels by value: the copy keeps the resume."""
    import pickle

    resumed = make_dataset(url, **OPTS)
    resumed.load_state_dict(_state_after(url, 2, 5))
    copy = pickle.loads(pickle.dumps(resumed))
    copy.set_epoch(2)
    assert copy.resume_point == 5

"""CacheDataset on real hand-built Zarr caches: alignment, order, sharding, resume, guards."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from client_support import (
    FINGERPRINT,
    PROBS,
    VOCAB,
    K,
    build_cache,
    collect,
    make_dataset,
    make_sequences,
    manifest,
    record_for,
    same_stream,
    segments,
)
from format_support import ZarrReader
from logitcache.cache_format import CacheWriter, tokenizer_fingerprint
from logitcache.client import CacheDataLoader, CacheDataset, StreamConfig
from logitcache.client.errors import ConfigError, IncompatibleCacheError, StateError
from logitcache.client.order import epoch_order, rank_partition, worker_units

NUM_SEQ = 80


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list]:
    url = str(tmp_path_factory.mktemp("client") / "cache")
    records = build_cache(url, make_sequences(NUM_SEQ, seed=3, max_len=50))
    return url, records


# -- pure order functions ------------------------------------------------------------------


@pytest.mark.parametrize("block", [1, 7])
def test_epoch_order_is_a_deterministic_permutation(block: int) -> None:
    a = epoch_order(101, seed=5, epoch=2, block_size=block)
    assert sorted(a.tolist()) == list(range(101))
    assert np.array_equal(a, epoch_order(101, seed=5, epoch=2, block_size=block))
    assert not np.array_equal(a, epoch_order(101, seed=5, epoch=3, block_size=block))
    assert not np.array_equal(a, epoch_order(101, seed=6, epoch=2, block_size=block))
    if block > 1:  # each block stays contiguous as a set
        for start in range(0, 101, block * 3):
            first = a[start] // block
            assert set(a[a // block == first]) == set(
                range(first * block, min(first * block + block, 101))
            )


def test_rank_partition_and_worker_units_cover_everything_once() -> None:
    order = epoch_order(103, seed=0, epoch=0)
    spans = [rank_partition(order, r, 4) for r in range(4)]
    assert sorted(np.concatenate(spans).tolist()) == list(range(103))
    assert max(map(len, spans)) - min(map(len, spans)) <= 1
    units = [worker_units(10, w, 3) for w in range(3)]
    assert sorted(np.concatenate(units).tolist()) == list(range(10))
    with pytest.raises(ConfigError):
        rank_partition(order, 4, 4)


# -- alignment -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mode,budget,long_sequences",
    [("pad", 64, "split"), ("pack", 64, "split"), ("pack", 16, "split"), ("pad", 16, "split")],
)
def test_alignment_is_exact(
    cache: tuple[str, list], mode: str, budget: int, long_sequences: str
) -> None:
    url, records = cache
    ds = CacheDataset(
        url, StreamConfig(tokens_per_item=budget, mode=mode, long_sequences=long_sequences, seed=1)
    )
    items = collect(ds)
    assert len(items) == len(ds) == ds.num_items()
    by_tokens = {tuple(r.input_ids.tolist()): r for r in records}
    rows_seen = 0
    for it in items:
        T = budget
        assert it["input_ids"].shape == (T,) and it["topk_ids"].shape == (T, K)
        assert it["topk_ids"].dtype == np.int64 and it["topk_logprobs"].dtype == np.float32
        m = it["loss_mask"]
        assert np.array_equal(m, it["labels"] != -100)
        # the hand-built cache puts the next token first: top-1 == label wherever there is a loss
        assert np.array_equal(it["topk_ids"][m, 0], it["labels"][m])
        np.testing.assert_allclose(
            np.exp(it["topk_logprobs"][m]), np.tile(PROBS, (m.sum(), 1)), rtol=1e-6
        )
        np.testing.assert_allclose(it["tail_mass"][m], 1 - PROBS.sum(), rtol=1e-5)
        assert (it["topk_logprobs"][~m] == 0).all() and (it["tail_mass"][~m] == 0).all()
        pad = it["segment_ids"] == 0
        assert np.array_equal(it["attention_mask"] == 0, pad)
        assert (it["labels"][pad] == -100).all()
        # labels[t] == input_ids[t+1] inside a segment; position ids restart at 0 per segment
        for s in range(1, it["segment_ids"].max() + 1):
            where = np.flatnonzero(it["segment_ids"] == s)
            assert np.array_equal(where, np.arange(where[0], where[-1] + 1))
            assert np.array_equal(it["position_ids"][where], np.arange(len(where)))
            inside = where[:-1]
            assert np.array_equal(it["labels"][inside], it["input_ids"][inside + 1])
        if mode == "pad":
            assert it["segment_ids"].max() == 1
        rows_seen += int(m.sum())
        if budget >= 50:  # every segment is a whole cached sequence
            for seg in segments(it):
                assert seg in by_tokens
    # every row of the cache is delivered exactly once per epoch
    assert rows_seen == sum(r.num_rows for r in records)


def test_split_pieces_reassemble_to_the_cached_sequences(cache: tuple[str, list]) -> None:
    url, records = cache
    ds = CacheDataset(url, StreamConfig(tokens_per_item=8, mode="pad", shuffle=False))
    pieces = [seg for it in collect(ds) for seg in segments(it)]
    joined, rebuilt = [], []
    for r in records:
        n = -(-(r.length - 1) // 8)
        joined.append(tuple(t for p in pieces[:n] for t in p))
        pieces = pieces[n:]
        # a final token that would sit alone in a piece has no row: it only appears as a label
        rebuilt.append(tuple(r.input_ids[: min(r.length, n * 8)].tolist()))
    assert joined == rebuilt and not pieces


def test_batches_topk_truncation_and_int32_ids(cache: tuple[str, list]) -> None:
    url, _ = cache
    ds = CacheDataset(
        url, StreamConfig(tokens_per_item=32, batch_size=4, topk=2, ids_dtype=torch.int32, seed=2)
    )
    units = collect(ds)
    assert units[0]["topk_ids"].shape == (4, 32, 2) and units[0]["topk_ids"].dtype == np.int32
    assert sum(u["input_ids"].shape[0] for u in units) == ds.num_items()
    m = units[0]["loss_mask"]
    # the two dropped columns' mass moves to the tail
    np.testing.assert_allclose(units[0]["tail_mass"][m], 1 - PROBS[:2].sum(), rtol=1e-5)
    with pytest.raises(ConfigError):
        CacheDataset(url, StreamConfig(topk=K + 1))


# -- order, sharding, resume ---------------------------------------------------------------


def test_shuffle_is_deterministic_per_seed_and_epoch(cache: tuple[str, list]) -> None:
    url, _ = cache
    a = collect(CacheDataset(url, StreamConfig(tokens_per_item=64, seed=7)))
    b = collect(CacheDataset(url, StreamConfig(tokens_per_item=64, seed=7)))
    assert same_stream(a, b)
    ds = CacheDataset(url, StreamConfig(tokens_per_item=64, seed=7))
    ds.set_epoch(1)
    c = collect(ds)
    assert not same_stream(a, c)
    assert Counter(s for u in a for s in segments(u)) == Counter(s for u in c for s in segments(u))


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_partition_the_sequences(cache: tuple[str, list], world_size: int) -> None:
    url, records = cache
    per_rank = []
    for rank in range(world_size):
        ds = CacheDataset(
            url,
            StreamConfig(tokens_per_item=64, mode="pack", seed=4, rank=rank, world_size=world_size),
        )
        per_rank.append(Counter(s for u in collect(ds) for s in segments(u)))
    union = sum(per_rank, Counter())
    assert union == Counter(tuple(r.input_ids.tolist()) for r in records)  # union = all, once
    for a in range(world_size):
        for b in range(a + 1, world_size):
            assert not set(per_rank[a]) & set(per_rank[b])  # disjoint


def test_even_ranks_equalises_item_counts(cache: tuple[str, list]) -> None:
    url, _ = cache
    counts = [
        len(
            collect(
                CacheDataset(
                    url, StreamConfig(tokens_per_item=64, rank=r, world_size=3, even_ranks=True)
                )
            )
        )
        for r in range(3)
    ]
    assert len(set(counts)) == 1 and counts[0] > 0


@pytest.mark.parametrize("num_workers,batch_size", [(0, None), (0, 3), (2, None), (2, 3)])
def test_resume_gives_the_identical_remaining_stream(
    cache: tuple[str, list], num_workers: int, batch_size: int | None
) -> None:
    url, _ = cache

    def loader() -> CacheDataLoader:
        ds = CacheDataset(
            url, StreamConfig(tokens_per_item=48, mode="pack", batch_size=batch_size, seed=11)
        )
        ds.set_epoch(2)
        return CacheDataLoader(ds, num_workers=num_workers)

    full = collect(loader())
    assert len(full) > 6
    if num_workers:  # workers deal units round-robin: the trainer sees the in-process order
        in_process = CacheDataset(
            url, StreamConfig(tokens_per_item=48, batch_size=batch_size, seed=11)
        )
        in_process.set_epoch(2)
        assert same_stream(full, collect(in_process))
    stop = 5
    first = loader()
    head = []
    for unit in first:
        head.append({k: v.numpy().copy() for k, v in unit.items()})
        if len(head) == stop:
            break
    state = json.loads(json.dumps(first.state_dict()))  # survives JSON
    assert state["epoch"] == 2 and state["items_consumed"] == stop * (batch_size or 1)
    resumed = loader()
    resumed.dataset.set_epoch(0)  # load_state_dict restores the epoch
    resumed.load_state_dict(state)
    rest = collect(resumed)
    assert same_stream(head, full[:stop])
    assert same_stream(rest, full[stop:])
    assert resumed.state_dict()["items_consumed"] == resumed.dataset.num_items()


def test_dataset_state_dict_counts_in_process_and_rejects_foreign_state(
    cache: tuple[str, list],
) -> None:
    url, _ = cache
    ds = CacheDataset(url, StreamConfig(tokens_per_item=48, seed=1))
    it = iter(ds)
    taken = [next(it) for _ in range(3)]
    state = ds.state_dict()
    assert state["items_consumed"] == 3 and len(taken) == 3
    rest = collect(it)
    again = CacheDataset(url, StreamConfig(tokens_per_item=48, seed=1))
    again.load_state_dict(state)
    assert same_stream(collect(again), rest)
    for other in (
        CacheDataset(url, StreamConfig(tokens_per_item=32, seed=1)),
        CacheDataset(url, StreamConfig(tokens_per_item=48, seed=2)),
        CacheDataset(url, StreamConfig(tokens_per_item=48, seed=1, rank=1, world_size=2)),
    ):
        with pytest.raises(StateError):
            other.load_state_dict(state)
    with pytest.raises(StateError):
        again.load_state_dict({**state, "items_consumed": 10_000})
    with pytest.raises(StateError):
        again.load_state_dict({k: v for k, v in state.items() if k != "epoch"})


def test_resume_survives_a_grown_cache(tmp_path: Path) -> None:
    url = str(tmp_path / "grow")
    seqs = make_sequences(30, seed=9)
    build_cache(url, seqs[:20])
    ds = CacheDataset(url, StreamConfig(tokens_per_item=32, seed=0))
    it = iter(ds)
    for _ in range(4):
        next(it)
    state = ds.state_dict()
    rest = collect(it)
    with CacheWriter.open(url, manifest()) as w:  # a job appends more sequences meanwhile
        w.append([record_for(s, key=f"seq-{i}") for i, s in enumerate(seqs[20:], start=20)])
    grown = CacheDataset(url, StreamConfig(tokens_per_item=32, seed=0))
    assert grown.num_sequences == 30
    grown.load_state_dict(state)
    assert same_stream(collect(grown), rest)


# -- guards --------------------------------------------------------------------------------


def _word_tokenizer(words: list[str]):  # noqa: ANN202 - a real tokenizers.Tokenizer
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = Whitespace()
    return tok


def test_mismatched_tokenizer_or_vocab_is_refused_with_reasons(tmp_path: Path) -> None:
    teacher_tok = _word_tokenizer(["<unk>", "a", "b", "c"])
    student_tok = _word_tokenizer(["<unk>", "a", "b", "d"])
    url = str(tmp_path / "guarded")
    build_cache(url, make_sequences(5), tokenizer_fingerprint=tokenizer_fingerprint(teacher_tok))

    ds = CacheDataset(url, tokenizer=teacher_tok, vocab_size=VOCAB)  # same tokenizer: accepted
    assert ds.mismatches == []
    with pytest.raises(IncompatibleCacheError) as err:
        CacheDataset(url, tokenizer=student_tok, vocab_size=VOCAB + 3)
    assert len(err.value.reasons) == 2
    assert "tokenizer fingerprint differs" in str(err.value) and "vocab size differs" in str(
        err.value
    )
    with pytest.raises(
        IncompatibleCacheError, match="vocab size differs: cache has 97, student has 50"
    ):
        CacheDataset(url, vocab_size=type("Cfg", (), {"vocab_size": 50})())
    forced = CacheDataset(url, tokenizer=student_tok, allow_mismatch=True)
    assert len(forced.mismatches) == 1 and len(collect(forced)) > 0


def test_fingerprint_string_and_bad_arguments(cache: tuple[str, list]) -> None:
    url, _ = cache
    assert CacheDataset(url, tokenizer=FINGERPRINT).mismatches == []
    for bad in (
        {"tokens_per_item": 1},
        {"mode": "zip"},
        {"batch_size": 0},
        {"long_sequences": "x"},
    ):
        with pytest.raises(ConfigError):
            make_dataset(url, **bad)
    with pytest.raises(ConfigError):
        CacheDataLoader(CacheDataset(url), batch_size=4)


def test_items_feed_the_distillation_loss(cache: tuple[str, list]) -> None:
    from logitcache.client.loss import topk_distill_loss

    url, _ = cache
    batch = next(
        iter(CacheDataLoader(CacheDataset(url, StreamConfig(tokens_per_item=64, batch_size=4))))
    )
    torch.manual_seed(0)
    hidden = torch.randn(*batch["input_ids"].shape, 16, requires_grad=True)
    weight = torch.randn(VOCAB, 16, requires_grad=True)
    args = (hidden, weight, batch["topk_ids"], batch["topk_logprobs"], batch["tail_mass"])
    by_labels = topk_distill_loss(*args, labels=batch["labels"], impl="dense")
    by_mask = topk_distill_loss(*args, mask=batch["loss_mask"], impl="dense")
    assert torch.isfinite(by_labels) and torch.allclose(by_labels, by_mask)
    by_labels.backward()
    # positions without a row (last token, padding) get no gradient
    assert (hidden.grad[~batch["loss_mask"]] == 0).all()
    assert (hidden.grad[batch["loss_mask"]].abs().sum(-1) > 0).all()


# -- range reads shared by the client and the server ----------------------------------------


def test_read_ranges_equals_per_sequence_reads(cache) -> None:
    from logitcache.cache_format import CacheReader
    from logitcache.client.sources import LocalSource

    url, records = cache
    reader = CacheReader(url)
    ranges = [(5, 9), (0, 2), (30, 30), (78, 80), (6, 7)]
    got = reader.read_ranges(ranges)
    want = [i for a, b in ranges for i in range(a, b)]
    assert len(got) == len(want)
    for i, rec in zip(want, got, strict=True):
        ref = reader.sequence(i)
        assert rec.equals(ref), i
        assert rec.key == records[i].key
    with pytest.raises(IndexError):
        reader.read_ranges([(3, NUM_SEQ + 1)])
    with pytest.raises(IndexError):
        reader.read_ranges([(4, 3)])
    assert reader.read_ranges([]) == []
    # the client's source reads through it and drops the unwanted sequences between runs
    src = LocalSource(url, max_gap_tokens=10**6)
    fetched = src.fetch([3, 7, 8, 40])
    assert sorted(fetched) == [3, 7, 8, 40]
    assert all(fetched[i].equals(reader.sequence(i)) for i in fetched)
    # decoding one call's arrays in threads gives the same records
    threaded = CacheReader(url, decode_threads=3)
    picks = [17, 3, 60, 3, 79, 0]
    for a, b in zip(threaded.sequences(picks), reader.sequences(picks), strict=True):
        assert a.equals(b)
    assert all(a.equals(b) for a, b in zip(threaded.read_ranges(ranges), got, strict=True))
    with pytest.raises(ValueError):
        CacheReader(url, decode_threads=0)


def test_complete_shard_index_is_read_once_per_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A partial read of a complete shard (all rows committed) reuses its parsed index: one index
    read fewer per such array; the per-chunk path reads an incomplete shard's index again at
    every call, the compiled path keeps it with the shard's open descriptor (the version it
    opened: fastdecode._open); a new commit drops them."""
    from logitcache.cache_format import CacheReader, spec
    from logitcache.cache_format import _fastdecode as fastdecode
    from logitcache.cache_format import _shardread as shardread

    url = str(tmp_path / "big")
    rng = np.random.default_rng(2)
    seqs = [rng.integers(0, VOCAB, size=1000).astype(np.int32) for _ in range(70)]
    build_cache(url, seqs[:69])  # 68,931 rows: row shard 0 (65,536 rows) is complete
    calls: list[int] = []  # one entry per shard index read and parsed (local pread or store get)
    real = shardread.parse_index

    def counting(raw: np.ndarray, n: int, where: str) -> np.ndarray:
        calls.append(n)
        return real(raw, n, where)

    monkeypatch.setattr(shardread, "parse_index", counting)
    reader, ref = CacheReader(url), ZarrReader(url)
    first = reader.sequence(3)
    n_first = len(calls)
    second = reader.sequence(5)
    # topk_ids, topk_logprobs and input_ids (69,000 tokens: its 65,536-token shard 0 is complete)
    # are cached; the per-row arrays' 524,288-row shard 0 is incomplete: read again per chunk,
    # kept by the compiled path
    again = 0 if fastdecode.AVAILABLE and fastdecode.ready() else n_first - 3
    assert n_first >= 4 and len(calls) - n_first == again
    assert set(reader._opened.direct[spec.TOPK_IDS].index_cache) == {0}
    assert first.equals(ref.sequence(3)) and second.equals(ref.sequence(5))
    assert reader.sequence(68).equals(ref.sequence(68))  # in the incomplete shard 1
    assert set(reader._opened.direct[spec.TOPK_LOGPROBS].index_cache) == {0}
    with CacheWriter.open(url, manifest()) as w:
        w.append([record_for(seqs[69], key="seq-69")])
    assert reader.refresh()
    assert reader._opened.direct[spec.TOPK_IDS].index_cache == {}  # new snapshot, new layouts
    assert reader.sequence(3).equals(first)


# -- follow a cache a job is still filling ---------------------------------------------------

_WRITER = """
import sys, time
import numpy as np
from client_support import manifest, record_for
from logitcache.cache_format import CacheWriter

url, first, total, batch, pause = sys.argv[1], *map(int, sys.argv[2:5]), float(sys.argv[5])
rng = np.random.default_rng(first)
with CacheWriter.open(url, manifest(), fsync=False) as w:
    for a in range(first, total, batch):
        recs = []
        for i in range(a, min(a + batch, total)):
            body = rng.integers(0, 97, size=int(rng.integers(1, 20))).astype(np.int32)
            recs.append(record_for(np.concatenate([[i // 97, i % 97], body]), key=f"seq-{i}"))
        w.append(recs)
        time.sleep(pause)
"""


def _indices(units: list[dict[str, np.ndarray]]) -> list[int]:
    """Sequence index of every segment (tokens 0 and 1 of sequence i are i // 97, i % 97)."""
    return [t[0] * 97 + t[1] for u in units for t in segments(u)]


@pytest.mark.subprocess
def test_follow_adopts_sequences_a_concurrent_writer_commits_and_resumes_exactly(
    tmp_path: Path,
) -> None:
    """A writer process appends while the loader runs epochs with ``follow=True``: every epoch
    covers exactly the sequences committed when it was set (each once, values aligned), counts
    grow, and a state taken mid-epoch resumes to the identical remainder after more commits."""
    import os
    import subprocess
    import sys
    import time

    url = str(tmp_path / "filling")
    head = [np.array([i // 97, i % 97, *range(5, 15)], dtype=np.int32) for i in range(12)]
    build_cache(url, head)
    tests = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    total = 42
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, url, "12", str(total), "6", "0.05"], env=env
    )
    try:
        ds = CacheDataset(url, StreamConfig(tokens_per_item=32, seed=4, follow=True))
        counts, resumed_checks = [], 0
        deadline = time.monotonic() + 120
        epoch = 0
        while time.monotonic() < deadline:
            ds.set_epoch(epoch)
            n = ds.num_sequences
            counts.append(n)
            loader = iter(CacheDataLoader(ds, num_workers=0))
            first = [next(loader) for _ in range(2)]
            state = ds.state_dict(items_consumed=2)
            rest = collect(loader)
            units = collect(first) + rest
            seen = _indices(units)
            assert sorted(seen) == list(range(n)), (epoch, n)  # exactly the committed prefix
            for u in units:  # row j's top-1 id is token j + 1 of the same segment
                m = u["loss_mask"].astype(bool)
                assert np.array_equal(u["topk_ids"][..., 0][m], u["labels"][m])
            if 12 < n < total and resumed_checks < 1:  # the writer is still appending
                again = CacheDataset(url, StreamConfig(tokens_per_item=32, seed=4, follow=True))
                again.load_state_dict(state)
                assert again.num_sequences == n
                assert same_stream(collect(again), rest)
                again.set_epoch(epoch + 1)  # the next epoch adopts what was committed since
                assert again.num_sequences >= n
                resumed_checks += 1
            if n == total:
                break
            epoch += 1
        assert counts == sorted(counts) and counts[-1] == total
        assert len(set(counts)) >= 3 and resumed_checks >= 1, counts
    finally:
        writer.wait(60)
    assert writer.returncode == 0


def test_follow_with_ranks_needs_a_process_group(cache: tuple[str, list]) -> None:
    url, _ = cache
    ds = CacheDataset(url, StreamConfig(tokens_per_item=48, follow=True, rank=0, world_size=2))
    with pytest.raises(ConfigError, match="torch.distributed"):
        ds.set_epoch(1)


def _follow_rank(rank: int, url: str, limits: list[int], init: str, out: str) -> None:
    """One DDP rank (gloo) that sees only the first ``limits[rank]`` sequences of the cache."""
    import torch.distributed as dist
    from logitcache.client.sources import LocalSource

    class Partial(LocalSource):
        """A store view lagging behind: a rank whose snapshot is older than the others'."""

        @property
        def lengths(self) -> np.ndarray:
            return super().lengths[: limits[rank]]

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        ds = CacheDataset(Partial(url), StreamConfig(tokens_per_item=48, seed=3, follow=True))
        ds.set_epoch(1)
        seen = [t[0] * 97 + t[1] for u in collect(ds) for t in segments(u)]
        Path(out).write_text(json.dumps({"n": ds.num_sequences, "seen": seen}))
    finally:
        dist.destroy_process_group()


@pytest.mark.subprocess
def test_follow_ranks_agree_on_the_smallest_committed_count(tmp_path: Path) -> None:
    """Two gloo ranks whose snapshots differ plan the epoch over the same (smallest) count and
    together cover it exactly once."""
    import multiprocessing as mp

    url = str(tmp_path / "ranks")
    build_cache(url, [np.array([i // 97, i % 97, 7, 8, 9], dtype=np.int32) for i in range(30)])
    limits = [30, 21]  # rank 1 lags behind
    # spawned, not forked: a forked child would inherit this process's default process group
    # (an in-process vLLM engine of an earlier test makes one); each child opens the store
    ctx = mp.get_context("spawn")
    init = f"file://{tmp_path / 'pg'}"
    outs = [str(tmp_path / f"rank{r}.json") for r in range(2)]
    procs = [ctx.Process(target=_follow_rank, args=(r, url, limits, init, outs[r])) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(180)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    got = [json.loads(Path(o).read_text()) for o in outs]
    assert [g["n"] for g in got] == [21, 21]
    assert sorted(got[0]["seen"] + got[1]["seen"]) == list(range(21))

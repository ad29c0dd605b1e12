"""The one batch pipeline (``server/batch/pipeline.py``) as the Ray shards use it, in-process with
:class:`engine_support.FakeEngine` and real zarr stores: the staged rows are the engine's rows in
input order, a re-run scores nothing, a stop between batches keeps what was committed, and a
writer error reaches the caller."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from engine_support import FakeEngine, fake_logprobs, lazy_records
from logitcache.cache_format import CacheReader, Manifest
from logitcache.server.batch import pipeline, shards
from logitcache.server.inputs import records as inputs
from logitcache.server.serving.caches import expected_manifest

pytestmark = pytest.mark.fast

K = 4
LIMITS = inputs.Limits(vocab_size=300, max_seq_len=512)


def _raws(n: int) -> list[inputs.RawRecord]:
    return [
        inputs.RawRecord(where=f"r{i}", id=f"s{i}", text=None, input_ids=[1, 2 + i, 3, 4 + i, 9])
        for i in range(n)
    ]


def _manifest(engine: FakeEngine) -> Manifest:
    return expected_manifest(engine.info, k=K, logprob_dtype="float32")


def test_a_shard_is_staged_in_input_order_and_a_rerun_scores_nothing(tmp_path: Path) -> None:
    engine = FakeEngine()
    (shard,) = shards.plan_shards(_raws(7), shard_size=10)
    task = shards.ShardTask(shard, str(tmp_path / "stage"), frozenset({"s2"}))
    kw = dict(manifest=_manifest(engine), limits=LIMITS, batch_sequences=2, batch_tokens=1000)
    first = asyncio.run(shards.score_shard(engine, task, inflight_batches=2, **kw))
    assert first.scored_sequences == 6 and first.scored_tokens == 30
    assert engine.calls == [2, 2, 2]  # batches of 2 over the 6 kept sequences
    reader = CacheReader(tmp_path / "stage")
    assert reader.keys == ["s0", "s1", "s3", "s4", "s5", "s6"] == list(first.keys)
    for i, key in ((0, "s0"), (3, "s4")):
        rec = reader.get(key)
        lp = fake_logprobs(rec.input_ids.tolist(), 300)
        top = np.argsort(-lp, axis=1, kind="stable")[:, :K]
        assert np.array_equal(rec.topk_ids, top), i
    again = asyncio.run(shards.score_shard(engine, task, **kw))
    assert again.scored_sequences == 0 and engine.calls == [2, 2, 2]


def test_a_shard_commits_the_batches_waiting_for_its_writer_together(
    tmp_path: Path, monkeypatch
) -> None:
    """A shard's writer groups scored batches as a job's does (pipeline.merge_rows and the
    linger/fill waits, shared): 3 batches of 8 rows with groups of up to 16 rows are 2 commits,
    the rows the same as batch by batch."""
    monkeypatch.setattr(pipeline, "MERGE_ROWS", 16)  # 2 batches of 2 sequences x 4 rows
    monkeypatch.setattr(pipeline, "WRITE_LINGER_S", 60.0)  # the group waits for its 16 rows
    engine = FakeEngine()
    kw = dict(manifest=_manifest(engine), limits=LIMITS, batch_sequences=2, batch_tokens=1000)
    staged = {}
    for name, fill in (("grouped", 60.0), ("alone", 0.0)):
        (shard,) = shards.plan_shards(_raws(6), shard_size=10)
        task = shards.ShardTask(shard, str(tmp_path / name), frozenset())
        if name == "alone":
            monkeypatch.setattr(pipeline, "MERGE_ROWS", 1)  # a group is one batch
        done = asyncio.run(shards.score_shard(engine, task, write_fill_s=fill, **kw))
        assert done.scored_sequences == 6
        staged[name] = CacheReader(tmp_path / name)
    assert staged["grouped"].manifest.generation == staged["alone"].manifest.generation - 1
    assert staged["grouped"].keys == staged["alone"].keys == [f"s{i}" for i in range(6)]
    for key in staged["alone"].keys:
        a, b = staged["grouped"].get(key), staged["alone"].get(key)
        assert np.array_equal(a.topk_ids, b.topk_ids)
        assert np.array_equal(a.topk_logprobs, b.topk_logprobs)


def test_stop_between_batches_keeps_the_committed_batches(tmp_path: Path) -> None:
    engine = FakeEngine()
    seqs = list(inputs.sequences(_raws(6), engine.tokenize, LIMITS))
    written: list[list[str]] = []

    def write(items: list) -> None:
        written.extend([r.key for r in records or []] for _, records in items)

    async def main() -> None:
        await pipeline.run(
            pipeline.plan(seqs, lambda keys: keys, max_sequences=2, max_tokens=1000),
            score=lambda b: pipeline.engine_records(engine, b, K),
            write=write,
            stop=lambda: len(engine.calls) >= 2,
        )

    with pytest.raises(pipeline.Stopped):
        asyncio.run(main())
    assert written == [["s0", "s1"], ["s2", "s3"]]  # scored batches are written before the stop


def test_a_writer_error_reaches_the_caller_and_skipped_batches_keep_their_place() -> None:
    engine = FakeEngine()
    seqs = list(inputs.sequences(_raws(6), engine.tokenize, LIMITS))
    order: list[tuple[bool, list[str]]] = []

    def write(items: list) -> None:
        for batch, records in items:
            order.append((records is not None, [s.key for s in batch.seqs]))
        if len(order) == 3:
            raise OSError("disk full")

    async def main() -> None:
        await pipeline.run(
            pipeline.plan(
                seqs, lambda keys: [k for k in keys if k != "s2"], max_sequences=1, max_tokens=99
            ),
            score=lambda b: pipeline.engine_records(engine, b, K),
            write=write,
            depth=lambda: 3,
        )

    with pytest.raises(OSError, match="disk full"):
        asyncio.run(main())
    assert order == [(True, ["s0"]), (True, ["s1"]), (False, ["s2"])]


def test_the_engine_gets_the_sequences_as_lists_made_once(monkeypatch) -> None:
    """engine_records hands the engine the checked int32 arrays; BaseEngine's check_prompts
    makes the plain int lists the backends take, once (issue #19: a list, an array of it and a
    second list per prompt before)."""
    from logitcache.server.engine import base

    engine = FakeEngine()
    seqs = [inputs.to_sequence(r, engine.tokenize, LIMITS) for r in _raws(3)]
    seen: list[Any] = []
    real = base.check_prompts
    monkeypatch.setattr(base, "check_prompts", lambda p, *a: seen.extend(p) or real(p, *a))
    got: list[list[int]] = []
    original = engine._generate

    async def generate(prompts: list[list[int]], k: int, temperature: float) -> list[Any]:
        got.extend(prompts)
        return await original(prompts, k, temperature)

    monkeypatch.setattr(engine, "_generate", generate)
    records = asyncio.run(pipeline.engine_records(engine, seqs, K))
    assert all(a is s.input_ids for a, s in zip(seen, seqs, strict=True))  # no list in between
    assert [type(p) for p in got] == [list] * 3 and all(type(t) is int for p in got for t in p)
    assert got == [s.input_ids.tolist() for s in seqs]
    assert [r.key for r in records] == [s.key for s in seqs]


def test_a_backend_that_makes_tensors_gets_the_prompts_as_int64_arrays(monkeypatch) -> None:
    """A backend with ``array_prompts`` (the transformers one) gets each checked prompt as one
    int64 array, no Python int per token (its tensors are made from them without one)."""
    engine = FakeEngine()
    monkeypatch.setattr(engine, "array_prompts", True)
    seqs = [inputs.to_sequence(r, engine.tokenize, LIMITS) for r in _raws(3)]
    got: list[Any] = []
    original = engine._generate

    async def generate(prompts: list[Any], k: int, temperature: float) -> list[Any]:
        got.extend(prompts)
        return await original(prompts, k, temperature)

    monkeypatch.setattr(engine, "_generate", generate)
    parts = asyncio.run(pipeline.engine_batches(engine, seqs, K))
    assert [(type(p), p.dtype, p.flags.c_contiguous) for p in got] == [
        (np.ndarray, np.int64, True)
    ] * 3
    assert [p.tolist() for p in got] == [s.input_ids.tolist() for s in seqs]
    assert parts[0].keys == [s.key for s in seqs]


def test_the_writer_computes_a_jobs_tail_mass_once(tmp_path: Path, monkeypatch) -> None:
    """A job's records reach the writer without their tail mass (computed in the writer thread
    next to the encode pass, not on the event loop); each row's tail is computed once, progress
    reads it again without recomputing, and the stored tails are the ones computed up front."""
    from logitcache.cache_format import CacheWriter, _encode
    from logitcache.cache_format import records as recs_mod
    from logitcache.server.engine.protocol import make_scores

    engine = FakeEngine()
    seqs = [inputs.to_sequence(r, engine.tokenize, LIMITS) for r in _raws(4)]
    eager = asyncio.run(pipeline.engine_records(engine, seqs, K))  # answers carry their tail
    assert all(r.tail_mass is not None for r in eager)
    got = asyncio.run(lazy_records(engine, seqs, K))  # a job's
    assert all(r.tail_mass is None for r in got)
    rows: list[int] = []  # rows given a tail, per call
    real = recs_mod.tail_from_logprobs
    counted = lambda lp: rows.append(len(lp)) or real(lp)  # noqa: E731
    monkeypatch.setattr(recs_mod, "tail_from_logprobs", counted)
    monkeypatch.setattr(_encode, "tail_from_logprobs", counted)
    m = expected_manifest(engine.info, k=K, logprob_dtype="float16").model_copy(
        update={"actual_logprob": True}
    )
    with CacheWriter.open(tmp_path / "c", m) as w:
        w.append(got)
    total = sum(len(r.topk_ids) for r in got)
    assert sum(rows) == total  # the encode computed each row's tail once
    tails = [r.tail_or_computed() for r in got]  # as the job's progress reads them
    assert sum(rows) == total  # and progress computed none again
    stored = CacheReader(tmp_path / "c").sequences(range(4))
    for r, t, s in zip(got, tails, stored, strict=True):
        want = make_scores(r.topk_ids, r.topk_logprobs).tail_mass
        assert t.tobytes() == want.tobytes() == s.tail_mass.tobytes()

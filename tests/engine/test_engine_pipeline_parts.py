"""A job's scored batches reach the cache writer as SequenceBatch parts
(``server/batch/parts.py``): views of the engine's flat row buffers (no per-sequence split and
join), and the store they write holds the same bytes as the per-record append they replace."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from engine_support import FakeEngine, lazy_records
from logitcache.cache_format import CacheWriter, SequenceBatch
from logitcache.cache_format.records import tail_from_logprobs
from logitcache.server.batch import pipeline
from logitcache.server.batch.parts import to_batches
from logitcache.server.engine.protocol import make_scores
from logitcache.server.inputs import records as inputs
from logitcache.server.serving.caches import expected_manifest

pytestmark = pytest.mark.fast

K = 4
LIMITS = inputs.Limits(vocab_size=300, max_seq_len=512)


class FlatEngine(FakeEngine):
    """:class:`FakeEngine`'s rows as the transformers backend hands them over: each prompt's
    rows are a range of one flat buffer per ``per_buffer`` prompts (a decoder batch), with the
    tail mass the device computed."""

    per_buffer = 2

    async def _generate(self, prompts: list[list[int]], k: int, temperature: float) -> list[Any]:
        rows = await super()._generate(prompts, k, temperature)
        out = []
        for a in range(0, len(rows), self.per_buffer):
            group = rows[a : a + self.per_buffer]
            ids, lps, act = (
                np.concatenate([getattr(r, n) for r in group])
                for n in ("topk_ids", "topk_logprobs", "actual_logprob")
            )
            tail, start = tail_from_logprobs(lps), 0
            for r in group:
                end = start + r.num_rows
                part = slice(start, end)
                out.append(make_scores(ids[part], lps[part], tail[part], None, act[part]))
                start = end
        return out


def _seqs(engine: FakeEngine, n: int) -> list[inputs.Sequence]:
    raws = [
        inputs.RawRecord(where=f"r{i}", id=f"s{i}", text=None, input_ids=[1, 2 + i, 3, 4 + i, 9])
        for i in range(n)
    ]
    return list(inputs.sequences(raws, engine.tokenize, LIMITS))


def test_rows_of_one_buffer_are_parts_that_view_it() -> None:
    engine = FlatEngine()
    seqs = _seqs(engine, 5)
    scores = asyncio.run(engine.score([s.input_ids for s in seqs], K))
    parts = to_batches(seqs, scores)
    assert [p.keys for p in parts] == [["s0", "s1"], ["s2", "s3"], ["s4"]]
    for p, first in zip(parts, (0, 2, 4), strict=True):
        assert np.shares_memory(p.topk_ids, scores[first].topk_ids)  # no copy of the rows
        assert np.shares_memory(p.topk_logprobs, scores[first].topk_logprobs)
        for i in range(p.num_sequences):
            r, sc = p.record(i), scores[first + i]
            assert np.array_equal(r.topk_ids, sc.topk_ids)
            assert np.array_equal(r.topk_logprobs, sc.topk_logprobs)
            assert r.tail_mass.tobytes() == sc.tail_mass.tobytes()  # the engine's own
            assert np.array_equal(r.input_ids, seqs[first + i].input_ids)
    separate = asyncio.run(FakeEngine().score([s.input_ids for s in seqs], K))
    (joined,) = to_batches(seqs, separate)  # one buffer per sequence: joined once
    assert joined.num_sequences == 5 and joined.tail_mass is None  # the writer's to compute
    with pytest.raises(RuntimeError, match="4 results for 5"):
        to_batches(seqs, scores[:4])


def test_a_long_sequence_in_a_buffer_of_its_own_is_a_part_of_its_own(monkeypatch) -> None:
    """Sequences in separate buffers (vLLM's outputs): one of PART_ROWS rows or more is a view,
    the shorter ones between are joined (one copy, instead of a part's fixed costs each)."""
    from logitcache.server.batch import parts

    monkeypatch.setattr(parts, "PART_ROWS", 6)
    engine = FakeEngine()
    lengths = [5, 5, 9, 5]  # rows 4, 4, 8, 4
    raws = [
        inputs.RawRecord(where=f"r{i}", id=f"s{i}", text=None, input_ids=list(range(1, n + 1)))
        for i, n in enumerate(lengths)
    ]
    seqs = list(inputs.sequences(raws, engine.tokenize, LIMITS))
    scores = asyncio.run(engine.score([s.input_ids for s in seqs], K))
    got = to_batches(seqs, scores)
    assert [p.keys for p in got] == [["s0", "s1"], ["s2"], ["s3"]]
    assert not np.shares_memory(got[0].topk_ids, scores[0].topk_ids)  # joined
    assert np.shares_memory(got[1].topk_ids, scores[2].topk_ids)  # viewed
    assert np.shares_memory(got[2].topk_logprobs, scores[3].topk_logprobs)
    assert np.array_equal(got[0].record(1).topk_ids, scores[1].topk_ids)


def _files(url: Path) -> dict[str, bytes]:
    return {p.relative_to(url).as_posix(): p.read_bytes() for p in url.rglob("*") if p.is_file()}


def _write(url: Path, engine: FakeEngine, seqs: list, score: Any) -> None:
    manifest = expected_manifest(engine.info, k=K, logprob_dtype="float16")
    with CacheWriter.open(url, manifest) as w:
        asyncio.run(
            pipeline.run(
                pipeline.plan(seqs, w.missing, max_sequences=3, max_tokens=1000),
                score=score,
                write=pipeline.Appended(w.append, manifest),
                merge_rows=pipeline.merge_rows(manifest),
                linger=0.05,
                depth=lambda: 2,
            )
        )


@pytest.mark.parametrize(
    ("engine_type", "part_rows"), [(FlatEngine, 512), (FakeEngine, 512), (FakeEngine, 3)]
)
def test_a_job_stores_the_bytes_of_the_per_record_append(
    tmp_path: Path, monkeypatch, engine_type, part_rows
) -> None:
    """The job path's parts (views of shared buffers, joined short sequences, or a part per
    sequence) and the records a job appended before (``engine_records`` with its tail left to
    the writer: the reference) give stores whose every object has the same bytes, those
    recording the commit's time excepted (root attributes, key index runs)."""
    from logitcache.server.batch import parts

    monkeypatch.setattr(parts, "PART_ROWS", part_rows)
    engine = engine_type()
    seqs = _seqs(engine, 8)
    _write(tmp_path / "parts", engine, seqs, lambda b: pipeline.engine_batches(engine, b, K))
    reference = lambda b: lazy_records(engine, b, K)  # noqa: E731
    _write(tmp_path / "records", engine, seqs, reference)
    got, want = _files(tmp_path / "parts"), _files(tmp_path / "records")
    assert got.keys() == want.keys()
    stamped = ("zarr.json", "seq_keys/index/")
    data = [n for n in want if not n.endswith(stamped[0]) and not n.startswith(stamped[1])]
    assert any(n.startswith("topk_ids/") for n in data)
    assert [n for n in data if got[n] != want[n]] == []


def test_parts_reach_the_writer_without_their_dropped_actual_logprob() -> None:
    """A cache without the actual-token array keeps the parts without it (copies; the engine's
    parts untouched), and progress reads the tail the writer computed on them."""
    engine = FakeEngine()
    seqs = _seqs(engine, 3)
    parts = asyncio.run(pipeline.engine_batches(engine, seqs, K))
    assert parts[0].actual_logprob is not None
    manifest = expected_manifest(engine.info, k=K, logprob_dtype="float16")
    got: list[Any] = []
    done = pipeline.Appended(got.extend, manifest)
    stored = done([(pipeline.Batch(seqs), parts)])
    assert all(isinstance(p, SequenceBatch) and p.actual_logprob is None for p in got)
    assert stored == got and parts[0].actual_logprob is not None
    assert done.scored_sequences == 3

"""pipeline.run's writer: batches already waiting for a slow writer are written as one
group (in order, up to ``merge_rows`` rows), every batch exactly once; a writer that keeps up
writes them one by one."""

from __future__ import annotations

import asyncio
import threading

import pytest
from engine_support import FakeEngine
from logitcache.server.batch import pipeline
from logitcache.server.inputs import records as inputs

pytestmark = pytest.mark.fast

K = 4
LIMITS = inputs.Limits(vocab_size=300, max_seq_len=512)


def _seqs(n: int) -> list[inputs.Sequence]:
    raws = [
        inputs.RawRecord(where=f"r{i}", id=f"s{i}", text=None, input_ids=[1, 2 + i, 3, 4 + i, 9])
        for i in range(n)
    ]
    return list(inputs.sequences(raws, FakeEngine().tokenize, LIMITS))


def _run(n: int, merge_rows: int, gate: threading.Event | None) -> list[list[str]]:
    engine = FakeEngine()
    groups: list[list[str]] = []

    def write_many(items: list) -> None:
        if gate is not None:
            gate.wait(5)  # the first group waits until every batch is scored and queued
        groups.append([s.key for b, recs in items for s in b.seqs if recs is not None])

    async def main() -> None:
        await pipeline.run(
            pipeline.plan(_seqs(n), lambda keys: keys, max_sequences=1, max_tokens=99),
            score=lambda b: pipeline.engine_records(engine, b, K),
            write=write_many,
            merge_rows=merge_rows,
            depth=lambda: 2,
            queue_size=8,
        )

    if gate is not None:
        threading.Timer(0.5, gate.set).start()  # all 6 batches are queued well before that
    asyncio.run(main())
    return groups


def test_waiting_batches_are_written_as_one_group_in_order() -> None:
    groups = _run(6, merge_rows=10_000, gate=threading.Event())
    assert [k for g in groups for k in g] == [f"s{i}" for i in range(6)]
    assert len(groups) < 6 and max(len(g) for g in groups) >= 3


def test_merge_rows_bounds_a_group() -> None:
    groups = _run(6, merge_rows=8, gate=threading.Event())  # 4 rows per sequence: 2 per group
    assert [k for g in groups for k in g] == [f"s{i}" for i in range(6)]
    assert all(len(g) <= 2 for g in groups) and len(groups) >= 3


def _slow_run(
    n: int, linger: float, merge_rows: int = 10_000, fill: float = 0.0
) -> tuple[list[list[str]], float]:
    """Batches scored one at a time, 50 ms apart, to a writer that keeps up."""
    import time

    engine = FakeEngine()
    groups: list[list[str]] = []

    async def slow_score(b: list) -> list:
        await asyncio.sleep(0.05)
        return await pipeline.engine_records(engine, b, K)

    async def main() -> None:
        await pipeline.run(
            pipeline.plan(_seqs(n), lambda keys: keys, max_sequences=1, max_tokens=99),
            score=slow_score,
            write=lambda items: groups.append([s.key for b, _ in items for s in b.seqs]),
            merge_rows=merge_rows,
            linger=linger,
            fill=fill,
            depth=lambda: 1,
        )

    t0 = time.monotonic()
    asyncio.run(main())
    return groups, time.monotonic() - t0


def test_linger_gathers_batches_of_a_writer_that_keeps_up() -> None:
    """With ``linger`` the writer waits for more batches (up to ``merge_rows`` rows) instead of
    appending each as it comes; the end of the input ends the wait at once."""
    keys = [f"s{i}" for i in range(6)]
    eager, _ = _slow_run(6, linger=0.0)
    assert [k for g in eager for k in g] == keys and len(eager) == 6  # one append per batch
    lingered, seconds = _slow_run(6, linger=30.0)
    assert lingered == [keys]  # one append for all six
    assert seconds < 10  # not 30: the input's end flushed the group
    bounded, _ = _slow_run(6, linger=30.0, merge_rows=8)  # 4 rows a sequence: 2 per group
    assert bounded == [keys[0:2], keys[2:4], keys[4:6]]


def test_fill_waits_for_a_full_group_when_batches_come_fast_enough() -> None:
    """With ``fill`` a group waits for ``merge_rows`` rows when the batches' arrival rate fills
    it within ``fill`` seconds (here 4 rows every ~50 ms: 8 more rows in ~0.1 s), the first
    batch too (its rate: its rows over the time since the writer started); a rate too slow
    for ``fill`` leaves the writer eager."""
    keys = [f"s{i}" for i in range(6)]
    filled, seconds = _slow_run(6, linger=0.0, merge_rows=12, fill=30.0)
    assert filled == [keys[:3], keys[3:]]
    assert seconds < 10  # not 30: the input's end flushed the last group
    eager, _ = _slow_run(6, linger=0.0, merge_rows=12, fill=0.01)  # 8 rows need ~0.1 s
    assert eager == [[k] for k in keys]


def test_groups_are_written_in_the_writer_thread_never_the_event_loops() -> None:
    """The append (encode, compression, writes) runs in the pipeline's writer thread, never on
    the event loop's thread (a server's main thread): the loop stays free for requests."""
    engine = FakeEngine()
    where: list[threading.Thread] = []

    async def main() -> None:
        await pipeline.run(
            pipeline.plan(_seqs(4), lambda keys: keys, max_sequences=1, max_tokens=99),
            score=lambda b: pipeline.engine_records(engine, b, K),
            write=lambda items: where.append(threading.current_thread()),
            name="writer-under-test",
        )

    asyncio.run(main())
    assert where and all(t is not threading.main_thread() for t in where)
    assert {t.name for t in where} == {"writer-under-test"}

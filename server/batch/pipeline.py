"""The one batch pipeline: checked sequences -> batches -> engine scores -> rows -> append.

Jobs (:mod:`.jobs`) and Ray shards (:mod:`.shards`) run all of it; an on-demand request's
misses are scored by step 2 alone (:mod:`~logitcache.server.serving.cache_hits`).

1. :func:`plan` cuts the sequences into consecutive batches (the same ones on a restart) and
   marks a batch ``todo`` when its cache still lacks any of its keys.
2. :func:`engine_batches` makes one engine call per batch and its rows
   :class:`~logitcache.cache_format.SequenceBatch` parts (:func:`engine_records`: records, to
   answer a request).
3. :func:`run` keeps up to ``depth()`` batches in the engine and hands finished ones, in input
   order, to ``write`` in one writer thread, which appends the waiting ones in one commit
   (:class:`Appended`) before progress is reported. :class:`Stopped` when ``stop()`` turns true:
   scored batches are written first, the ones in the engine cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import queue
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from logitcache.cache_format import Manifest, SequenceBatch, SequenceRecord

from ..engine.protocol import EngineInputError
from ..inputs import records as inputs
from .parts import to_batches

if TYPE_CHECKING:
    from ..engine import SampledTargets, TeacherEngine, TeacherScores
    from ..metrics import TeacherMetrics


T = TypeVar("T")


@dataclass
class Batch:
    """One fixed batch: its sequences (input order), and whether any key is still missing."""

    seqs: list[inputs.Sequence]
    todo: bool = True

    @property
    def tokens(self) -> int:
        return sum(s.length for s in self.seqs)


class Missing(Protocol):
    """What :func:`plan` asks a cache: which of these keys are not committed yet."""

    def __call__(self, keys: Seq[str]) -> Seq[str]: ...


#: Scores one batch's sequences: :class:`~logitcache.cache_format.SequenceBatch` parts or one
#: record per sequence.
ScoreFn = Callable[[list[inputs.Sequence]], Awaitable[list[Any]]]
#: Writes a group of batches in one append (one commit), in order: ``(batch, rows)`` items,
#: ``rows`` ``None`` for a batch that was not scored.
WriteFn = Callable[[list[tuple[Batch, "list[Any] | None"]]], None]


class Stopped(Exception):
    """:func:`run` was stopped between batches (see the module docstring)."""


def plan(
    seqs: Iterable[inputs.Sequence],
    missing: Missing,
    *,
    max_sequences: int,
    max_tokens: int,
) -> Iterator[Batch]:
    """Consecutive batches of ``seqs`` (:func:`.records.batches`), each marked ``todo`` when
    ``missing`` reports any of its keys."""
    for b in inputs.batches(seqs, max_sequences=max_sequences, max_tokens=max_tokens):
        yield Batch(seqs=b, todo=bool(missing([s.key for s in b])))


def to_records(seqs: Seq[inputs.Sequence], scores: Seq[TeacherScores]) -> list[SequenceRecord]:
    """Pair checked sequences with the engine's ``TeacherScores`` (same order)."""
    if len(scores) != len(seqs):
        raise RuntimeError(f"engine returned {len(scores)} results for {len(seqs)} sequences")
    return [
        SequenceRecord(
            key=s.key,
            input_ids=s.input_ids,
            topk_ids=sc.topk_ids,
            topk_logprobs=sc.topk_logprobs,
            tail_mass=sc.tail_mass,
            loss_mask=s.loss_mask,  # chat records of a loss_mask job (server/inputs/chat.py)
            entropy=getattr(sc, "entropy", None),  # an engine built with entropy (FORMAT.md 4.9)
            actual_logprob=getattr(sc, "actual_logprob", None),  # FORMAT.md 4.12
        )
        for s, sc in zip(seqs, scores, strict=True)
    ]


def for_store(records: Seq[Any], manifest: Manifest) -> list[Any]:
    """``records`` (or parts) as a cache with ``manifest`` keeps them: copies without the
    actual-token logprob when the cache has no such array."""
    if manifest.actual_logprob:
        return list(records)
    out = []
    for rec in records:
        if getattr(rec, "actual_logprob", None) is not None:
            rec = copy.copy(rec)
            rec.__dict__["actual_logprob"] = None
        out.append(rec)
    return out


async def call_engine(
    engine: TeacherEngine,
    seqs: Seq[inputs.Sequence],
    k: int,
    targets: SampledTargets | None,
    temperature: float | None = None,
) -> list[TeacherScores]:
    """One engine call: top-``k`` rows, or sampled rows seeded by each sequence's key, at
    ``temperature`` (``None``: the engine's own)."""
    prompts = [s.input_ids for s in seqs]  # int32 arrays: check_prompts makes the lists once
    if targets is None:
        return await engine.score(prompts, k, temperature)
    sample = getattr(engine, "score_sampled", None)
    if sample is None:
        raise EngineInputError("this engine cannot produce sampled targets (targets='sampled')")
    scores: list[TeacherScores] = await sample(prompts, [s.key for s in seqs], targets, temperature)
    return scores


async def timed(
    call: Awaitable[T],
    seqs: Seq[inputs.Sequence],
    metrics: TeacherMetrics | None,
    source: str,
) -> T:
    """``call`` (an engine call on ``seqs``) awaited, its time recorded under ``source``."""
    t0 = time.perf_counter()
    out = await call
    if metrics is not None:
        metrics.scored(
            source,
            sequences=len(seqs),
            tokens=sum(s.length for s in seqs),
            seconds=time.perf_counter() - t0,
        )
    return out


async def engine_records(
    engine: TeacherEngine,
    seqs: Seq[inputs.Sequence],
    k: int,
    *,
    metrics: TeacherMetrics | None = None,
    source: str = "job",
    targets: SampledTargets | None = None,
    temperature: float | None = None,
) -> list[SequenceRecord]:
    """One engine call (:func:`call_engine`) for ``seqs`` and its records, converted in a
    worker thread; its time recorded under ``source``."""
    scores = await timed(call_engine(engine, seqs, k, targets, temperature), seqs, metrics, source)
    return await asyncio.to_thread(to_records, seqs, scores)


async def engine_batches(
    engine: TeacherEngine,
    seqs: Seq[inputs.Sequence],
    k: int,
    *,
    metrics: TeacherMetrics | None = None,
    source: str = "job",
    targets: SampledTargets | None = None,
) -> list[SequenceBatch]:
    """:func:`engine_records` for rows that only go to a cache's writer: views of the engine's
    arrays as :class:`~logitcache.cache_format.SequenceBatch` parts."""
    scores = await timed(call_engine(engine, seqs, k, targets), seqs, metrics, source)
    return await asyncio.to_thread(to_batches, seqs, scores)


async def hidden_records(
    engine: TeacherEngine,
    seqs: Seq[inputs.Sequence],
    *,
    metrics: TeacherMetrics | None = None,
    source: str = "job",
) -> list[Any]:
    """The :class:`~logitcache.cache_format.HiddenRecord` of ``seqs``: one ``score_hidden``
    call, its time recorded under ``source``."""
    from logitcache.cache_format import HiddenRecord

    call = getattr(engine, "score_hidden", None)
    if call is None:
        raise EngineInputError("this engine cannot capture hidden states (targets='hidden')")
    hidden = await timed(call([s.input_ids for s in seqs]), seqs, metrics, source)
    return [
        HiddenRecord(s.key, s.input_ids, h, s.loss_mask) for s, h in zip(seqs, hidden, strict=True)
    ]


#: Most rows, and top-k values (``rows * k``), one writer-thread append commits: every append
#: rewrites partly filled shards whole, so large groups keep a job's CPU per position low.
MERGE_ROWS = 131072
MERGE_VALUES = 13 << 20
#: Seconds the writer thread waits after a scored batch for more (an append costs ~20 ms of CPU
#: whatever its size).
WRITE_LINGER_S = 0.1


class Appended:
    """A writer-thread step: a group's scored rows appended in one commit (:func:`for_store`);
    counts the sequences and tokens written and, of those, scored."""

    def __init__(self, append: Callable[[list[Any]], Any], manifest: Manifest):
        self.append = append
        self.manifest = manifest
        self.sequences = self.tokens = self.scored_sequences = self.scored_tokens = 0

    def __call__(self, items: list[tuple[Batch, list[Any] | None]]) -> list[Any]:
        """Append ``items``' rows; returns them as appended."""
        scored = [r for _, rows in items if rows is not None for r in rows]
        if scored:
            scored = for_store(scored, self.manifest)
            self.append(scored)
        for batch, records in items:
            self.sequences += len(batch.seqs)
            self.tokens += batch.tokens
            if records is not None:
                self.scored_sequences += len(batch.seqs)
                self.scored_tokens += batch.tokens
        return scored


def merge_rows(manifest: Any) -> int:
    """The most rows of one append to a cache of ``manifest``."""
    width = int(manifest.hidden["dim"]) if manifest.hidden is not None else int(manifest.k)
    return min(MERGE_ROWS, MERGE_VALUES // max(width, 1))


def _rows(item: tuple[Batch, list[Any] | None]) -> int:
    return sum(s.length - 1 for s in item[0].seqs)


class _Writer:
    """The writer thread: ``write(group)`` in order, a group being an item and those waiting
    behind it, up to ``merge_rows`` rows. After a group's first item it waits ``linger``
    seconds for more, or ``fill`` when the arrival rate would bring the group to half of
    ``merge_rows`` within that time."""

    def __init__(
        self,
        write: WriteFn,
        maxsize: int,
        name: str,
        merge_rows: int = 0,
        linger: float = 0.0,
        fill: float = 0.0,
    ):
        self._write = write
        self._merge_rows = merge_rows
        self._linger = linger
        self._fill = fill
        self._rate = 0.0  # rows handed over per second (0: not known yet)
        self._last_put = time.monotonic()  # the first batch's rate runs from here
        self.error: BaseException | None = None
        self._queue: queue.Queue[tuple[Batch, list[Any] | None] | None] = queue.Queue(maxsize)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, item: tuple[Batch, list[Any] | None] | None) -> None:
        """Blocking put (call from a worker thread); raises the writer's error if it died."""
        if item is not None:
            self._arrived(_rows(item))
        while True:
            if self.error is not None:
                raise self.error
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _arrived(self, rows: int) -> None:
        """Update the arrival rate with a batch of ``rows`` handed over now."""
        now = time.monotonic()
        if now > self._last_put:
            rate = rows / (now - self._last_put)
            self._rate = rate if not self._rate else 0.5 * (self._rate + rate)
        self._last_put = now

    def _wait(self, rows: int) -> float:
        """Seconds a group of ``rows`` rows waits for more (class doc)."""
        lacking = max(self._merge_rows // 2 - rows, 0)
        if self._fill and self._rate and lacking / self._rate <= self._fill:
            return self._fill
        return self._linger

    def join(self) -> None:
        self.put(None)
        self._thread.join()
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        try:
            while (item := self._queue.get()) is not None:
                group, rows, done = [item], _rows(item), False
                deadline = time.monotonic() + self._wait(rows)
                while rows < self._merge_rows:
                    try:
                        wait = deadline - time.monotonic()
                        more = (
                            self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait()
                        )
                    except queue.Empty:
                        break
                    if more is None:
                        done = True
                        break
                    group.append(more)
                    rows += _rows(more)
                self._write(group)
                if done:
                    break
        except BaseException as e:  # noqa: BLE001 - re-raised to the pipeline, never lost
            self.error = e
            while True:  # unblock a producer waiting on a full queue
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break


async def run(
    batches: Iterator[Batch],
    *,
    score: ScoreFn,
    write: WriteFn,
    depth: Callable[[], int] = lambda: 1,
    stop: Callable[[], bool] = lambda: False,
    queue_size: int = 4,
    name: str = "pipeline-writer",
    merge_rows: int = 0,
    linger: float = 0.0,
    fill: float = 0.0,
) -> None:
    """Score every ``todo`` batch of ``batches`` (drawn in a worker thread) and ``write`` every
    batch in order (:class:`_Writer`). ``depth()`` bounds the batches in the engine,
    ``queue_size`` those waiting for the writer. Raises :class:`Stopped` or the first error of
    scoring or writing, after writing every batch already handed to the writer."""
    writer = _Writer(write, queue_size, name, merge_rows, linger, fill)
    inflight: deque[tuple[Batch, asyncio.Future[list[Any] | None]]] = deque()

    async def drain_one() -> None:
        b, t = inflight.popleft()
        records = await t
        await asyncio.to_thread(writer.put, (b, records if b.todo else None))

    try:
        while True:
            if stop():
                raise Stopped
            batch = await asyncio.to_thread(next, batches, None)
            if batch is None:
                break
            if not batch.todo and not inflight:
                await asyncio.to_thread(writer.put, (batch, None))
                continue
            fut: asyncio.Future[list[Any] | None]
            if batch.todo:
                fut = asyncio.ensure_future(score(batch.seqs))
            else:  # keep its place in the order behind the batches still in the engine
                fut = asyncio.get_running_loop().create_future()
                fut.set_result(None)
            inflight.append((batch, fut))
            limit = depth()
            while len(inflight) >= limit or (inflight and inflight[0][1].done()):
                await drain_one()
        while inflight:
            await drain_one()
    finally:
        for _, t in inflight:
            t.cancel()
        for _, t in inflight:
            with contextlib.suppress(BaseException):
                await t
        await asyncio.to_thread(writer.join)

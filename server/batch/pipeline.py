"""The one batch pipeline: checked sequences -> batches -> engine scores -> rows -> append.

Used by every path that writes scored rows to a cache:

* jobs (:mod:`.jobs`): a whole input, ``job_inflight_batches`` batches in the engine at once
  (one while on-demand requests are scored), progress advanced after each commit;
* on-demand scoring with a cache (:mod:`~logitcache.server.serving.cache_hits`): the misses of
  one request are one batch (:func:`one_batch`), scored under the admission budget, then
  appended with those of concurrent requests (one commit per group:
  :mod:`~logitcache.server.serving.appends`) and answered as stored;
* the Ray shards (:mod:`.shards`): a shard's sequences into its staging cache.

Contract of :func:`run` (jobs and shards; an on-demand batch is scored by step 2 alone):

1. :func:`plan` cuts the sequences into consecutive batches (:func:`.records.batches`: a pure
   function of the sequences and the batch limits, so a restarted run forms the same batches)
   and marks a batch ``todo`` when its cache still lacks any of its keys.
2. :func:`engine_batches` scores one batch: one engine call at ``k`` (:func:`call_engine`,
   rows aligned as in DESIGN.md), then :func:`.parts.to_batches` makes its rows
   :class:`~logitcache.cache_format.SequenceBatch` parts, views of the engine's arrays (an
   on-demand batch is paired per sequence instead, :func:`engine_records`: the records answer
   the request).
3. :func:`run` keeps up to ``depth()`` batches in the engine, and hands the finished batches,
   in input order, to ``write`` in one writer thread: the batches waiting for it as one group
   of ``(batch, rows)`` items (``rows``: the batch's parts, or ``None`` for a batch that was
   not ``todo``), appended in one commit (:class:`Appended`) before progress is reported. A batch is
   therefore committed before any later batch, and the engine is never idle while results are
   converted and written.

Stopping: :func:`run` raises :class:`Stopped` when ``stop()`` turns true between batches; the
batches already scored are written first, the ones still in the engine are cancelled.
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


#: Scores one batch's sequences (engine call + conversion); returns what a cache's writer
#: appends for them: :class:`~logitcache.cache_format.SequenceBatch` parts (top-k rows) or one
#: record per sequence (records to answer a request, hidden-state records).
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
    """Pair checked sequences with the engine's ``TeacherScores`` (same order), each with its
    tail mass (the records answer a request)."""
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
    """``records`` (or :class:`~logitcache.cache_format.SequenceBatch` parts) as a cache with
    ``manifest`` keeps them: copies without the actual-token logprob (FORMAT.md 4.12) when the
    cache has no such array (a cache made without it), the records themselves otherwise."""
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
    """``call`` (an engine call on ``seqs``) awaited, its time recorded under ``source`` with
    ``metrics``."""
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
    """One engine call at ``k`` for ``seqs`` and its records (converted in a worker thread, off
    the event loop). The engine range-checks ``k`` and the ids (nothing computed for bad input).
    With ``metrics``, the engine call's time is recorded under ``source``. With ``targets``,
    sampled rows instead (:func:`call_engine`: seeded by each sequence's key). ``temperature``:
    the engine's ``T`` for these rows (``None``: its own).
    """
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
    """:func:`engine_records`' engine call for rows that only go to a cache's writer: the
    :class:`~logitcache.cache_format.SequenceBatch` parts of :func:`.parts.to_batches` (views
    of the engine's arrays, made in a worker thread; a tail mass not computed yet is the
    writer's)."""
    scores = await timed(call_engine(engine, seqs, k, targets), seqs, metrics, source)
    return await asyncio.to_thread(to_batches, seqs, scores)


async def hidden_records(
    engine: TeacherEngine,
    seqs: Seq[inputs.Sequence],
    *,
    metrics: TeacherMetrics | None = None,
    source: str = "job",
) -> list[Any]:
    """The :class:`~logitcache.cache_format.HiddenRecord` of ``seqs`` (FORMAT.md 4.10): one
    ``score_hidden`` call (the engine checks the ids; a backend without hidden-state capture
    raises its :class:`EngineInputError`), its time recorded under ``source``."""
    from logitcache.cache_format import HiddenRecord

    call = getattr(engine, "score_hidden", None)
    if call is None:
        raise EngineInputError("this engine cannot capture hidden states (targets='hidden')")
    hidden = await timed(call([s.input_ids for s in seqs]), seqs, metrics, source)
    return [
        HiddenRecord(s.key, s.input_ids, h, s.loss_mask) for s, h in zip(seqs, hidden, strict=True)
    ]


#: Rows (positions) of scored batches that a cache's writer thread (a job's, a Ray shard's) may
#: append in one commit (:class:`_Writer`): at most MERGE_ROWS, and at most MERGE_VALUES top-k
#: entries (``rows * k``: a group and one more batch of 16K rows fit the encode's kept outputs,
#: ``fastencode.KEEP_VALUES``). Every append rewrites each partly filled shard object whole
#: (FORMAT.md W3), so large groups keep a long job's CPU per position low
#: (benchmarks/results/service.md).
MERGE_ROWS = 131072
MERGE_VALUES = 13 << 20
#: Seconds the writer thread waits, after taking a scored batch, for more to reach MERGE_ROWS
#: rows (the end of the input ends the wait at once): an append costs ~20 ms of CPU whatever
#: its size, while progress still moves (and a crash loses at most) every 0.1 s.
WRITE_LINGER_S = 0.1


class Appended:
    """A writer-thread step: the scored rows (:class:`~logitcache.cache_format.SequenceBatch`
    parts or records) of a group of ``(batch, rows)`` items appended with ``append`` in one
    commit, as a cache of ``manifest`` keeps them (:func:`for_store`); counts the batches
    written (``sequences``, ``tokens``) and, of those, the ones scored (``scored_sequences``,
    ``scored_tokens``)."""

    def __init__(self, append: Callable[[list[Any]], Any], manifest: Manifest):
        self.append = append
        self.manifest = manifest
        self.sequences = self.tokens = self.scored_sequences = self.scored_tokens = 0

    def __call__(self, items: list[tuple[Batch, list[Any] | None]]) -> list[Any]:
        """Append ``items``' rows; returns them as appended (:func:`for_store`: with the tail
        mass the writer computed)."""
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
    """The :data:`MERGE_ROWS` / :data:`MERGE_VALUES` bound of one append's rows for a cache of
    ``manifest``: values per row are ``k``, or a hidden cache's ``d`` (FORMAT.md 4.10)."""
    width = int(manifest.hidden["dim"]) if manifest.hidden is not None else int(manifest.k)
    return min(MERGE_ROWS, MERGE_VALUES // max(width, 1))


def _rows(item: tuple[Batch, list[Any] | None]) -> int:
    return sum(s.length - 1 for s in item[0].seqs)


class _Writer:
    """The writer thread: ``write(group)`` off the loop, in order, where a group is an item and
    the items already waiting when it is taken, up to ``merge_rows`` rows: one append and one
    commit for the group (its fixed costs, array metadata, fsyncs, the commit, rewriting partly
    filled shards, paid once per group). With
    ``linger`` (seconds) the writer waits that long after a group's first item for more, until
    the group holds ``merge_rows`` rows or the input ends; with ``fill`` (seconds), up to
    ``fill`` instead when the arrival rate (rows per second over the last batches; for the
    first batch, its rows over the time since the writer started) brings the group to half of
    ``merge_rows`` within that time (a fast engine: its first batch is not an append of its
    own), so a slow one still commits every ``linger`` seconds."""

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
        """Seconds a group of ``rows`` rows waits for more after its first item: ``fill`` when
        the arrival rate brings it to half of ``merge_rows`` within ``fill`` seconds, else
        ``linger``."""
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
    """Score every ``todo`` batch of ``batches`` and ``write`` every batch, in order, in groups
    bounded by ``merge_rows``, ``linger`` and ``fill`` (see :class:`_Writer`).

    ``batches`` is drawn in a worker thread (forming a batch reads the input and asks the cache).
    ``depth()`` (read after each batch is handed out) bounds the batches in the engine;
    ``queue_size`` bounds the scored batches waiting for the writer thread. Raises
    :class:`Stopped` when ``stop()`` is true before a batch is drawn, and re-raises the first
    error of scoring or writing; either way every batch already handed to the writer is written
    before this returns or raises.
    """
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


async def one_batch(seqs: list[inputs.Sequence], *, score: ScoreFn) -> list[SequenceRecord]:
    """The pipeline for one batch (an on-demand request's misses): the scored records of
    ``seqs`` (input order). Storing them is the cache's group committer's
    (:mod:`~logitcache.server.serving.appends`), which commits the misses of concurrent
    requests together."""
    if not seqs:
        return []
    return await score(seqs)

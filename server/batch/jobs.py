"""Background batch jobs: score an input into a named cache, restart-safe, without blocking HTTP.

Submission (:meth:`JobRunner.submit`) checks everything before a job exists (cache name, k,
teacher identity, every input record); a rejected job writes nothing and leaves no row.
Running (one job at a time, a loaded teacher's first) is :func:`.pipeline.run` over the checked
sequences (kept in memory up to ``job_keep_input_tokens``, else read again and checked against
the input's digest); progress advances after each commit.

Resume: a job left ``running`` is queued again at start-up; the same batches are formed and a
batch whose keys are all committed is skipped. Cancel: a queued job at once; a running one
stops handing batches to the engine, writes what it has scored, and ends ``cancelled``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from logitcache.cache_format import Manifest, fastencode
from logitcache.cache_format.errors import StoreNotFoundError
from logitcache.cache_format.layout import parse_root, read_root_attrs
from logitcache.protocol import JobCreate, JobState, JobStatus, SamplingOptions

from ..engine import EngineUnavailableError, SupervisedEngine
from ..errors import ConflictError, PayloadTooLargeError, ServiceError
from ..inputs import jsonids
from ..inputs import records as inputs
from ..inputs.chat import ChatTokenize
from ..serving import targets
from ..serving.caches import CacheRegistry, WriterHandle, check_name
from ..serving.scoring import ScoringService
from . import pipeline
from .job_store import JobRecord
from .progress import Progress, RunStats

if TYPE_CHECKING:
    from ..metrics import Metrics
    from ..serving.teachers import TeacherPool
    from ..settings import ServerSettings
    from .job_store import JobStore

log = logging.getLogger("logitcache.server.jobs")


def numpy_hugepages_off() -> bool:
    """Stop numpy asking for transparent huge pages in this process unless
    ``NUMPY_MADVISE_HUGEPAGE`` is set (a job's arrays are written and read once); returns whether
    numpy asked for them before."""
    import os

    import numpy as np

    multiarray = getattr(getattr(np, "_core", None), "multiarray", None)
    setter = getattr(multiarray, "_set_madvise_hugepage", None)
    if setter is None or "NUMPY_MADVISE_HUGEPAGE" in os.environ:
        return False
    return bool(setter(False))


def _kind_of(kind: str, sampling: dict[str, Any] | None) -> tuple[str, SamplingOptions | None]:
    """``(targets, sampling)`` of a job from a manifest's ``targets`` and ``sampling`` object."""
    if kind == "hidden":  # FORMAT.md 4.10
        return "hidden", None
    if kind != "sampled" or sampling is None:
        return "topk", None
    return "sampled", SamplingOptions.from_manifest(sampling)


def _limits(scoring: ScoringService, spec: JobCreate) -> inputs.Limits:
    """The teacher's limits with the job's long-sequence rule (``on_long``)."""
    return inputs.job_limits(scoring.limits, spec.on_long, spec.split_overlap)


def _tokenize(scoring: ScoringService, spec: JobCreate) -> ChatTokenize:
    """The teacher's tokenize, able to render the job's chat records (server/inputs/chat.py)."""
    return ChatTokenize.of(scoring.engine, spec.chat_template, spec.loss_mask)


#: Queued jobs looked through for one of a loaded teacher before the oldest is taken.
QUEUE_SCAN = 256

#: Engine deaths in a row without a committed sequence after which a job fails (the engine
#: crashes on its input) instead of waiting for the restarted engine again.
MAX_ENGINE_DEATHS = 3


#: The fields of a job's status that are its table row's own (id, cache, state, counts, ...).
_ROW_FIELDS = tuple(
    f.name for f in dataclasses.fields(JobRecord) if f.name in JobStatus.model_fields
)


class JobRunner:
    """Owns the job loop: submit, list, status, cancel; runs queued jobs in the background."""

    def __init__(
        self,
        *,
        store: JobStore,
        teachers: TeacherPool,
        caches: CacheRegistry,
        settings: ServerSettings,
        metrics: Metrics,
    ):
        self.store = store
        self.teachers = teachers
        self.caches = caches
        self.settings = settings
        self.metrics = metrics
        self._wake = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._current: str | None = None
        self._cancel = threading.Event()
        self._stats: dict[str, RunStats] = {}
        self._kinds: dict[str, tuple[str, SamplingOptions | None]] = {}  # job id -> targets
        # job id -> (sequences done, engine deaths in a row at that count)
        self._engine_deaths: dict[str, tuple[int, int]] = {}
        # job id -> (tokens, sequences): the checked input of a job not yet started
        self._kept: dict[str, tuple[int, list[inputs.Sequence]]] = {}
        self._models: dict[str, str | None] = {}  # job id -> the teacher its spec names
        metrics.watch_job_states(self.store.count_by_state)
        numpy_hugepages_off()  # this process runs the jobs: see the function

    # --- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Warm the writer's compiled encode pass and the JSONL reader, queue jobs interrupted by
        the last shutdown, start the loop."""
        await asyncio.to_thread(fastencode.ready)
        fast = await asyncio.to_thread(jsonids.ready)  # its JSONL reading, compiled or loaded
        log.info("JSONL input ids: %s", "msgspec + numba" if fast else "json (no msgspec/numba)")
        n = self.store.requeue_interrupted()
        if n:
            log.info("resuming %d interrupted job(s)", n)
        self._task = asyncio.create_task(self._loop(), name="job-runner")

    async def stop(self) -> None:
        """Stop after the running job's in-flight batches; it stays queued for the next start."""
        self._stopping = True
        self._cancel.set()
        self._wake.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # --- API --------------------------------------------------------------------------------

    async def submit(self, req: JobCreate) -> JobStatus:
        """Check a job completely against the teacher its ``model`` names (nothing written on
        failure), store it queued, wake the loop."""
        async with self.teachers.checking(req.model) as (teacher, scoring):
            return await self._submit(req.model_copy(update={"model": teacher.name}), scoring)

    async def _submit(self, req: JobCreate, scoring: ScoringService) -> JobStatus:
        name = check_name(req.cache)
        if req.records is not None and len(req.records) > self.settings.max_inline_records:
            raise PayloadTooLargeError(
                f"{len(req.records)} inline records exceed the limit of "
                f"{self.settings.max_inline_records}; use an input file"
            )
        await asyncio.to_thread(self.caches.check_writable, name)
        manifest = await asyncio.to_thread(self._manifest, scoring, name, req, req.k)
        if req.layout is not None:
            await asyncio.to_thread(self._check_layout, name, req.layout)
        kept: list[inputs.Sequence] = []
        summary, digest = await asyncio.to_thread(self._scan, scoring, req, kept)
        counts = summary.counts.as_dict()
        job = await asyncio.to_thread(  # job-table writes off the event loop (fsync'd)
            self.store.create,
            cache=name,
            k=manifest.k,
            spec=req.model_dump(mode="json"),
            input_digest=digest,
            sequences_total=summary.sequences,
            tokens_total=summary.tokens,
            layout=req.layout,
        )
        await asyncio.to_thread(self.store.set_input_counts, job.id, counts)
        if len(kept) == summary.sequences:  # the whole input fits in the budget
            self._kept[job.id] = (summary.tokens, kept)
        self._kinds[job.id] = _kind_of(manifest.targets, manifest.sampling)  # as resolved
        self._models[job.id] = req.model
        self._wake.set()
        return await asyncio.to_thread(self.status, job.id)

    def _scan(
        self, scoring: ScoringService, req: JobCreate, keep: list[inputs.Sequence]
    ) -> tuple[inputs.InputSummary, str]:
        """The input's summary and digest from one reading; its checked sequences go to ``keep``
        when they fit in what ``job_keep_input_tokens`` leaves."""
        file, records, data_dir = req.file, req.records, self.settings.data_dir
        if file is not None:  # a bad path is its own error, before any record is read
            inputs.resolve_input_path(data_dir, file.path)
        tok, limits = _tokenize(scoring, req), _limits(scoring, req)
        digest = inputs.InputDigest()
        raws = inputs.raw_records(
            file=file,
            records=records,
            data_dir=data_dir,
            digest=digest,
            max_line_bytes=inputs.line_limit(limits),
        )
        kept = sum(t for t, _ in list(self._kept.values()))
        budget = self.settings.job_keep_input_tokens - kept
        summary = inputs.scan(raws, tok, limits, keep=keep, keep_tokens=budget)
        return summary, digest.value(file=file, records=records, data_dir=data_dir)

    def _manifest(
        self, scoring: ScoringService, cache: str, spec: JobCreate, k: int | None
    ) -> Manifest:
        """The manifest the job writes ``cache`` with; with ``loss_mask`` a new cache gets the array
        and an existing cache without one is a 409."""
        asked = targets.of_request(spec)
        k = scoring.check_k(k) if asked is None else None
        manifest = scoring.target_manifest(cache, k, spec.dataset or "", asked)
        if not spec.loss_mask:
            return manifest
        stored = scoring.stored_manifest(cache)
        if stored is None:
            return manifest.model_copy(update={"loss_mask": True})
        if not stored.loss_mask:
            raise ConflictError(
                f"cache {cache!r} was created without a loss mask and cannot store one: "
                "write the job to a new cache, or submit it without loss_mask"
            )
        return manifest

    def _check_layout(self, name: str, layout: str) -> None:
        """An existing cache must have the layout preset the job names (it is fixed when the
        cache is created): :class:`ConflictError` otherwise."""
        if self.caches.manifest(name) is None:
            return
        have = self.caches.reader(name).layout_name
        if have != layout:
            raise ConflictError(
                f"cache {name!r} has the layout preset {have!r}, the job asks for {layout!r} "
                "(a cache's layout is fixed when it is created)"
            )

    def status(self, job_id: str) -> JobStatus:
        return self._status(self.store.get(job_id))

    def list(
        self, *, limit: int | None = None, offset: int = 0, state: JobState | None = None
    ) -> list[JobStatus]:
        """Job statuses, oldest first (a page of :meth:`JobStore.list`)."""
        return [self._status(j) for j in self.store.list(limit=limit, offset=offset, state=state)]

    def cancel(self, job_id: str) -> JobStatus:
        job = self.store.request_cancel(job_id)
        if job.state == JobState.running and self._current == job_id:
            self._cancel.set()
        elif job.state == JobState.cancelled:
            self._kept.pop(job_id, None)
        return self._status(job)

    def _status(self, job: JobRecord) -> JobStatus:
        stats = self._stats.get(job.id)
        rate = stats.rate() if stats is not None else None
        eta = None
        if rate and job.state == JobState.running:
            eta = max(job.tokens_total - job.tokens_done, 0) / rate
        kind, sampling = self._kind(job)
        return JobStatus(
            **{f: getattr(job, f) for f in _ROW_FIELDS},
            targets=kind,
            sampling=sampling,
            tokens_per_s=rate,
            coverage=stats.coverage() if stats is not None else None,
            eta_s=eta,
            error=job.errors[-1] if job.errors else None,
            input=self.store.input_counts(job.id),
        )

    def _kind(self, job: JobRecord) -> tuple[str, SamplingOptions | None]:
        """What ``job`` writes (``targets`` and sampled parameters): as resolved at submission, else
        from its spec (a sampled spec without parameters takes its cache's or the defaults)."""
        got = self._kinds.get(job.id)
        if got is not None:
            return got
        spec = job.spec if job.spec_json is not None else self.store.get(job.id).spec
        kind = spec.get("targets") or "topk"
        sampling = None
        if kind == "sampled":
            if spec.get("sampling") is not None:
                sampling = SamplingOptions.model_validate(spec["sampling"])
            else:
                try:  # the cache's root zarr.json only (no reader, no sequence index)
                    attrs = read_root_attrs(self.caches.store(job.cache))
                    stored = parse_root(attrs) if attrs is not None else None
                except (StoreNotFoundError, FileNotFoundError):  # no cache yet: the defaults
                    stored = None
                except Exception:  # noqa: BLE001 - a broken cache: parameters unknown for now
                    return kind, None
                chosen = targets.cache_or_default(stored)
                sampling = _kind_of("sampled", chosen.manifest())[1]
        got = self._kinds[job.id] = (kind, sampling)
        return got

    # --- the loop ---------------------------------------------------------------------------

    async def _loop(self) -> None:
        # job-table calls run in worker threads: the store's lock is held by the job writer
        # through each fsync'd commit, and the event loop must never wait for it
        while not self._stopping:
            self._wake.clear()  # before the read: a submit during it is not missed
            job = await asyncio.to_thread(self._next)
            if job is None:
                await self._wake.wait()
                continue
            try:
                model = self._model(job.id)
                async with self.teachers.use(model) as teacher:
                    if not await asyncio.to_thread(self.store.start, job.id):
                        continue
                    self._current = job.id
                    self._cancel.clear()
                    try:
                        assert teacher.scoring is not None
                        await self._run_job(
                            await asyncio.to_thread(self.store.get, job.id), teacher.scoring
                        )
                    finally:
                        self._current = None
                        self.metrics.job_ended(job.id)
            except ServiceError as e:  # e.g. a teacher no longer served, or one failing to load
                log.warning("job %s failed: %s", job.id, e.message)
                await asyncio.to_thread(self.store.finish, job.id, JobState.failed, e.message)

    def _model(self, job_id: str) -> str | None:
        """The teacher job ``job_id`` names (``None``: the default)."""
        if job_id not in self._models:
            self._models[job_id] = self.store.get(job_id).spec.get("model")
        return self._models[job_id]

    def _next(self) -> JobRecord | None:
        """The oldest queued job of a loaded teacher (its jobs run while it is loaded), else
        the oldest queued job."""
        queued = self.store.list(state=JobState.queued, limit=QUEUE_SCAN)
        loaded = set(self.teachers.resident())
        for job in queued:
            model = self._model(job.id)
            if (model or self.teachers.default.name) in loaded:
                return job
        return queued[0] if queued else None

    async def _run_job(self, job: JobRecord, scoring: ScoringService) -> None:
        stats = self._stats[job.id] = RunStats()
        try:
            await self._pipeline(job, stats, scoring)
        except pipeline.Stopped:
            if self._stopping and not await asyncio.to_thread(self.store.cancel_requested, job.id):
                await asyncio.to_thread(self.store.requeue_interrupted)  # resume at next start
            else:
                await asyncio.to_thread(self.store.finish, job.id, JobState.cancelled)
        except asyncio.CancelledError:
            raise
        except EngineUnavailableError as e:
            if not isinstance(scoring.engine, SupervisedEngine):  # nothing restarts it
                log.warning("job %s failed: %s", job.id, e)
                await asyncio.to_thread(self.store.finish, job.id, JobState.failed, str(e))
                return
            # the engine died mid-job and is being restarted: the job waits and resumes from
            # its committed sequences, unless the engine keeps dying on it without progress
            done = (await asyncio.to_thread(self.store.get, job.id)).sequences_done
            last, deaths = self._engine_deaths.get(job.id, (-1, 0))
            deaths = deaths + 1 if done == last else 1
            self._engine_deaths[job.id] = (done, deaths)
            if deaths >= MAX_ENGINE_DEATHS:
                error = f"the engine died {deaths} times on this job without progress: {e}"
                log.warning("job %s failed: %s", job.id, error)
                await asyncio.to_thread(self.store.finish, job.id, JobState.failed, error)
                return
            log.warning("job %s paused: %s", job.id, e)
            await asyncio.to_thread(self.store.requeue_interrupted)
            while not self._stopping and not scoring.engine.alive:
                await asyncio.sleep(0.5)
        except ServiceError as e:
            log.warning("job %s failed: %s", job.id, e.message)
            await asyncio.to_thread(self.store.finish, job.id, JobState.failed, e.message)
        except Exception as e:  # noqa: BLE001 - any failure ends the job, with its message
            log.exception("job %s failed", job.id)
            error = f"{type(e).__name__}: {e}"
            await asyncio.to_thread(self.store.finish, job.id, JobState.failed, error)
        else:
            await asyncio.to_thread(self.store.finish, job.id, JobState.succeeded)
        finally:
            stats.ended = time.monotonic()

    async def _pipeline(self, job: JobRecord, stats: RunStats, scoring: ScoringService) -> None:
        spec = JobCreate.model_validate(job.spec)
        kept = self._kept.pop(job.id, None)
        if kept is None:  # read again (a resumed job, or an input too large to keep)
            digest = await asyncio.to_thread(
                inputs.input_digest,
                file=spec.file,
                records=spec.records,
                data_dir=self.settings.data_dir,
            )
            if digest != job.input_digest:
                raise ServiceError("the input file changed since the job was submitted")
        manifest = await asyncio.to_thread(self._manifest, scoring, job.cache, spec, job.k)
        head = scoring.teacher_head() if manifest.hidden is not None else None
        cm = self.caches.writer(job.cache, manifest, spec.layout, head)  # new: the preset
        handle = await asyncio.to_thread(cm.__enter__)
        try:
            await self._stream(job, spec, handle, stats, scoring, None if kept is None else kept[1])
        finally:
            await asyncio.to_thread(cm.__exit__, None, None, None)

    def _batches(
        self,
        spec: JobCreate,
        handle: WriterHandle,
        scoring: ScoringService,
        kept: list[inputs.Sequence] | None = None,
    ) -> Iterator[pipeline.Batch]:
        """The job's batches (a generator: the input is read in the pipeline's worker thread),
        from the sequences its submission checked when they were ``kept``."""
        seqs: Iterator[inputs.Sequence]
        if kept is not None:
            seqs = iter(kept)
        else:
            limits = _limits(scoring, spec)
            raws = inputs.raw_records(
                file=spec.file,
                records=spec.records,
                data_dir=self.settings.data_dir,
                max_line_bytes=inputs.line_limit(limits),
            )
            seqs = inputs.sequences(raws, _tokenize(scoring, spec), limits)
        yield from pipeline.plan(
            seqs,
            handle.missing,
            max_sequences=self.settings.job_batch_sequences,
            max_tokens=self.settings.job_batch_tokens,
        )

    async def _stream(
        self,
        job: JobRecord,
        spec: JobCreate,
        handle: WriterHandle,
        stats: RunStats,
        scoring: ScoringService,
        kept: list[inputs.Sequence] | None = None,
    ) -> None:
        """The job's batches through :func:`.pipeline.run` (depth 1 while on-demand work runs)."""
        progress = Progress(job, handle, self.store, self.metrics, stats)
        depth = self.settings.job_inflight_batches
        sampled = targets.targets_of(handle.manifest)  # None: top-k rows

        def score(seqs: list[inputs.Sequence]) -> Any:
            if handle.manifest.hidden is not None:  # FORMAT.md 4.10
                return pipeline.hidden_records(scoring.engine, seqs, metrics=scoring.metrics)
            return pipeline.engine_batches(
                scoring.engine,
                seqs,
                job.k,
                metrics=scoring.metrics,  # labelled with the job's teacher
                source="job",
                targets=sampled,
            )

        await pipeline.run(
            self._batches(spec, handle, scoring, kept),
            score=score,
            write=progress,
            merge_rows=pipeline.merge_rows(handle.manifest),
            linger=pipeline.WRITE_LINGER_S,
            fill=self.settings.job_write_fill_s,
            depth=lambda: 1 if scoring.active else depth,
            stop=self._cancel.is_set,
            queue_size=self.settings.job_write_queue,
            name=f"job-writer-{job.id}",
        )

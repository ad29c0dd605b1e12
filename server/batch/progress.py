"""A job's progress in this process: its run's throughput and coverage (:class:`RunStats`) and
the writer-thread step that appends a scored batch and then advances the committed progress
(:class:`Progress`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from logitcache.cache_format import SequenceRecord

from ..metrics import Metrics
from ..serving.caches import WriterHandle
from . import pipeline
from .job_store import JobRecord, JobStore


@dataclass
class RunStats:
    """Throughput of the current (or last) run of a job, in this process."""

    started: float = field(default_factory=time.monotonic)
    ended: float | None = None
    tokens_scored: int = 0
    tail_sum: float = 0.0
    tail_rows: int = 0

    def coverage(self) -> float | None:
        """Mean top-k mass (``1 - mean tail mass``) of the rows this run has written."""
        return 1.0 - self.tail_sum / self.tail_rows if self.tail_rows else None

    def rate(self) -> float | None:
        elapsed = (self.ended or time.monotonic()) - self.started
        if elapsed <= 0 or self.tokens_scored == 0:
            return None
        return self.tokens_scored / elapsed


class Progress:
    """A job's writer-thread step: append a scored batch, then advance the committed progress
    (job table, metrics, live coverage)."""

    def __init__(
        self,
        job: JobRecord,
        writer: WriterHandle,
        store: JobStore,
        metrics: Metrics,
        stats: RunStats,
    ):
        self.job = job
        self.writer = writer
        self.store = store
        self.metrics = metrics
        self.stats = stats
        self.sequences_done = 0
        self.tokens_done = 0

    def write(self, batch: pipeline.Batch, records: list[SequenceRecord] | None) -> None:
        self.write_many([(batch, records)])

    def write_many(self, items: list[tuple[pipeline.Batch, list[SequenceRecord] | None]]) -> None:
        """Append the scored batches of ``items`` in one commit, then advance the progress."""
        scored = [r for _, records in items if records is not None for r in records]
        if scored:
            self.writer.append(pipeline.for_store(scored, self.writer.manifest))
            for r in scored:  # live coverage (status page, job status; hidden rows have none)
                if not hasattr(r, "tail_or_computed"):
                    continue
                tail = r.tail_or_computed()
                self.stats.tail_sum += float(tail.sum(dtype="float64"))
                self.stats.tail_rows += int(tail.shape[0])
        for batch, records in items:
            if records is not None:
                self.stats.tokens_scored += batch.tokens
            self.sequences_done += len(batch.seqs)
            self.tokens_done += batch.tokens
        self.store.progress(
            self.job.id, sequences_done=self.sequences_done, tokens_done=self.tokens_done
        )
        self.metrics.job_progress(
            self.job.id,
            sequences_done=self.sequences_done,
            tokens_done=self.tokens_done,
            total=self.job.tokens_total,
        )

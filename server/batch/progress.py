"""A job's progress in this process: its run's throughput and coverage (:class:`RunStats`) and
the writer-thread step that appends a scored batch and then advances the committed progress
(:class:`Progress`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

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
    """A job's writer-thread step: one commit of a group of batches, then the job's progress."""

    def __init__(
        self,
        job: JobRecord,
        writer: WriterHandle,
        store: JobStore,
        metrics: Metrics,
        stats: RunStats,
    ):
        self.job = job
        self.appended = pipeline.Appended(writer.append, writer.manifest)
        self.store = store
        self.metrics = metrics
        self.stats = stats

    def __call__(self, items: list[tuple[pipeline.Batch, list[Any] | None]]) -> None:
        done = self.appended
        for r in done(items):  # live coverage (status page, job status; hidden rows have none)
            if hasattr(r, "tail_or_computed"):
                tail = r.tail_or_computed()
                self.stats.tail_sum += float(tail.sum(dtype="float64"))
                self.stats.tail_rows += int(tail.shape[0])
        self.stats.tokens_scored = done.scored_tokens
        self.store.progress(self.job.id, sequences_done=done.sequences, tokens_done=done.tokens)
        self.metrics.job_progress(
            self.job.id,
            sequences_done=done.sequences,
            tokens_done=done.tokens,
            total=self.job.tokens_total,
        )

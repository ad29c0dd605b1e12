"""Serving scores from a named cache: hits are read, only misses reach the engine.

Contract (``POST /v1/score`` with ``cache``, and ``POST /v1/completions``):

* A **hit**: the cache holds the sequence's key with the same token ids; its rows are read.
  Anything else is a **miss**: scored at the cache's k, stored (never overwriting a key), and
  answered as the cache will return it later (:func:`as_stored`), so a miss and a later hit
  answer bit-identically.
* The protocol routes answer a miss once it is scored, its commit going on behind the answer
  (``answer_first``); until then the answered rows are hits (``GroupCommitter.pending``).
* A ``k' <= k`` is folded from the cache's rows (:func:`fold_k`); a ``k' > k`` is scored at
  ``k'`` and not stored (:meth:`CacheServing.above`), the teacher identity still checked.
* A cache holds one **temperature** and one target kind: a request at another temperature, or
  another kind or sampling parameters, is a 409; one naming none gets the cache's. Sampled rows
  are answered whole.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from logitcache.cache_format import Manifest, SequenceRecord, encode_record
from logitcache.cache_format.quant import decode_logprobs, encode_logprobs
from logitcache.cache_format.spec import LOGPROB_MAX, LOGPROB_STEP, TOPK_LOGPROBS

from ..batch import pipeline
from ..errors import InvalidInputError, NotFoundError
from ..inputs.records import Sequence
from . import targets
from .appends import GroupCommitter
from .caches import check_name
from .scoring import ScoringService

if TYPE_CHECKING:
    from logitcache.protocol import ScoreRequest

    from ..engine.protocol import SampledTargets


@dataclass(frozen=True)
class Served:
    """Records in request order, the k they were answered at, which came from the cache
    (``hits``), how many were newly committed, and the exact logprobs at asked ids of misses
    (``at_ids``: index -> ``[L - 1, len(ids[index])]``)."""

    records: list[SequenceRecord]
    k: int
    hits: list[bool] | None
    stored: int
    at_ids: dict[int, np.ndarray] = field(default_factory=dict)


def as_stored(rec: SequenceRecord, manifest: Manifest) -> SequenceRecord:
    """``rec`` as a reader of a cache with ``manifest`` would return it (see module doc)."""
    enc = encode_logprobs(rec.topk_logprobs, manifest.logprob_dtype)
    lp = decode_logprobs(
        enc[TOPK_LOGPROBS], manifest.logprob_dtype, enc.get(LOGPROB_MAX), enc.get(LOGPROB_STEP)
    )
    tail = rec.tail_or_computed().clip(0.0, 1.0).astype(manifest.tail_mass_dtype)
    ent = rec.entropy  # stored as float16 (FORMAT.md 4.9)
    return SequenceRecord(
        rec.key,
        rec.input_ids,
        rec.topk_ids,
        np.asarray(lp, np.float32),
        tail.astype(np.float32),
        entropy=None if ent is None else ent.astype(np.float16),
        # stored as computed (FORMAT.md 4.12); a cache without the array answers none
        actual_logprob=rec.actual_logprob if manifest.actual_logprob else None,
    )


def checked_as_stored(
    records: Seq[SequenceRecord], manifest: Manifest, check: bool = True
) -> list[SequenceRecord]:
    """``records`` as stored (:func:`as_stored`); with ``check``, after the writer's own checks
    of each (a bad record raises before anything is queued for the cache)."""
    for i, rec in enumerate(pipeline.for_store(records, manifest) if check else ()):
        encode_record(rec, manifest, i)
    return [as_stored(rec, manifest) for rec in records]


def fold_k(rec: SequenceRecord, k: int) -> SequenceRecord:
    """``rec`` cut to its first ``k`` columns, ``tail' = clip(tail + sum_{j >= k}
    exp(logprob_j), 0, 1)``; ``rec`` itself for ``k`` at or above its own."""
    have = rec.topk_ids.shape[1]
    if k >= have:
        return rec
    dropped = np.exp(rec.topk_logprobs[:, k:].astype(np.float64)).sum(axis=1)
    tail = np.clip(rec.tail_or_computed().astype(np.float64) + dropped, 0.0, 1.0)
    return SequenceRecord(
        rec.key,
        rec.input_ids,
        np.ascontiguousarray(rec.topk_ids[:, :k]),
        np.ascontiguousarray(rec.topk_logprobs[:, :k]),
        tail.astype(np.float32),
        entropy=rec.entropy,  # of the full distribution: no k changes it
        actual_logprob=rec.actual_logprob,  # likewise
    )


def record_bytes(rec: SequenceRecord) -> int:
    """In-memory bytes of a record's arrays (ids, logprobs, tail, tokens): "bytes served"."""
    tail = rec.tail_or_computed()
    return int(rec.input_ids.nbytes + rec.topk_ids.nbytes + rec.topk_logprobs.nbytes + tail.nbytes)


class CacheServing:
    """On-demand answers through a cache (module doc), or scored without one; every check
    precedes any read, engine call or write."""

    def __init__(self, scoring: ScoringService):
        self.scoring = scoring
        self.caches = scoring.caches
        self.metrics = scoring.metrics
        self.commits = GroupCommitter(
            scoring.caches, window_s=scoring.settings.cache_append_window_s
        )
        """Stores the misses: one commit per group of concurrent requests into a cache."""

    async def aclose(self) -> None:
        """Commit the queued misses and refuse more (shutdown, before the writers close)."""
        await self.commits.aclose()

    async def answer(self, req: ScoreRequest, *, frames: bool = False) -> Served:
        """``/v1/score``: check, then serve from ``req.cache`` or score without one."""
        scoring = self.scoring
        fmt = "frames" if frames else "json"
        asked = targets.of_request(req)
        if asked == "hidden":  # FORMAT.md 4.10: written by jobs, never answered here
            raise InvalidInputError(targets.HIDDEN_JOBS_ONLY)
        if req.cache is None:
            sampled = scoring.sampled_targets(asked)
            k = (scoring.check_k(req.k) or scoring.default_k) if sampled is None else sampled.slots
            t = scoring.check_temperature(req.temperature)
            seqs = await asyncio.to_thread(scoring.sequences_of, req)
            scoring.check_answer_size(seqs, k, fmt)
            records = await scoring.admitted(seqs, k, targets=sampled, temperature=t)
            return Served(records=records, k=k, hits=None, stored=0)
        manifest, k, seqs = await asyncio.to_thread(self._checked, req, req.cache, asked, fmt)
        if k > manifest.k:
            return await self.above(seqs, k, manifest.temperature)
        return await self.serve(req.cache, seqs, k, manifest)

    def _checked(
        self, req: ScoreRequest, cache: str, asked: SampledTargets | str | None, fmt: str
    ) -> tuple[Manifest, int, list[Sequence]]:
        """Every check of a request into ``cache`` (blocking; one read of its manifest): the
        manifest to serve and store with, the k to answer at and the checked sequences."""
        scoring = self.scoring
        stored = scoring.stored_manifest(cache)
        t = scoring.request_temperature(cache, req.temperature, stored)
        if asked is not None:
            manifest = scoring.target_manifest(cache, None, "", asked, t, stored=stored)
            k = manifest.k
        else:
            k = scoring.check_k(req.k)
            above = stored is not None and k is not None and k != stored.k
            manifest = scoring.target_manifest(
                cache, None if above else k, temperature=t, stored=stored
            )
            k = k if above else manifest.k
        seqs = scoring.sequences_of(req)
        scoring.check_answer_size(seqs, k, fmt)
        return manifest, k, seqs

    def lookup(
        self, cache: str, seqs: Seq[Sequence], store: bool = False
    ) -> dict[int, SequenceRecord]:
        """Stored records of the hits among ``seqs`` (index -> record; blocking); with ``store`` and
        a miss, 409 first if the store refuses writes."""
        found = self._hits(cache, seqs)
        if store and len(found) < len(seqs):
            self.caches.check_writable(cache)
        return found

    def _hits(self, cache: str, seqs: Seq[Sequence]) -> dict[int, SequenceRecord]:
        """Stored or pending records of ``seqs`` (by index) with the same token ids; pending ones
        are taken first, so a commit in between is found in the reader."""
        got: dict[int, SequenceRecord] = {}
        for i, s in enumerate(seqs):
            if (rec := self.commits.pending(cache, s.key)) is not None:
                got[i] = rec
        rest = {s.key for i, s in enumerate(seqs) if i not in got}
        try:
            reader = self.caches.lookup_reader(check_name(cache), rest)
        except NotFoundError:
            reader = None
        found: list[tuple[int, int]] = []
        if reader is not None and len(got) < len(seqs):
            found = [
                (i, reader.index_of(s.key))
                for i, s in enumerate(seqs)
                if i not in got and s.key in reader
            ]
        recs = reader.sequences([j for _, j in found]) if reader is not None and found else []
        got.update(zip((i for i, _ in found), recs, strict=True))
        return {
            i: rec for i, rec in got.items() if np.array_equal(rec.input_ids, seqs[i].input_ids)
        }

    async def above(self, seqs: Seq[Sequence], k: int, temperature: float | None = None) -> Served:
        """Answer ``seqs`` at a ``k`` above the cache's: scored at ``k``, not stored."""
        records = (
            await self.scoring.admitted(list(seqs), k, temperature=temperature) if seqs else []
        )
        self.metrics.cache_served(hits=0, misses=len(seqs), tokens_saved=0, bytes_served=0)
        return Served(records=records, k=k, hits=[False] * len(seqs), stored=0)

    async def serve(
        self,
        cache: str,
        seqs: Seq[Sequence],
        k: int,
        manifest: Manifest,
        *,
        store: bool = True,
        ids: Seq[list[int]] | None = None,
        answer_first: bool = False,
    ) -> Served:
        """Answer ``seqs`` at ``k <= manifest.k`` from cache ``cache`` (module doc), folded to
        ``k``. With ``ids``, the misses' logprobs at their ids come from the same engine call
        (``Served.at_ids``). ``answer_first``: return once the misses are scored, their commit
        going on behind the answer (``stored`` 0)."""
        with self.commits.ticket(cache) as ticket:
            found = await asyncio.to_thread(self.lookup, cache, seqs, store)
            miss_idx = [i for i in range(len(seqs)) if i not in found]
            sampled = targets.targets_of(manifest)  # a sampled cache's misses are sampled rows
            misses = [seqs[i] for i in miss_idx]
            at_ids: dict[int, np.ndarray] = {}
            if ids is not None and misses and sampled is None:
                scored, exact = await self.scoring.admitted_with_ids(
                    misses, manifest.k, [ids[i] for i in miss_idx], manifest.temperature
                )
                at_ids = dict(zip(miss_idx, exact, strict=True))
            else:
                scored = (
                    await self.scoring.admitted(
                        misses, manifest.k, targets=sampled, temperature=manifest.temperature
                    )
                    if misses
                    else []
                )
            as_kept = await asyncio.to_thread(checked_as_stored, scored, manifest, store)
            kept = pipeline.for_store(scored, manifest) if store else []
            stored = 0
            if answer_first:
                self.commits.append_behind(ticket, manifest, kept, as_kept)
            else:
                stored = await self.commits.append(ticket, manifest, kept)
            out: list[SequenceRecord | None] = [None] * len(seqs)
            for i, rec in found.items():
                out[i] = fold_k(rec, k)
            for i, rec in zip(miss_idx, as_kept, strict=True):
                out[i] = fold_k(rec, k)
            records = [r for r in out if r is not None]
            hits = [i in found for i in range(len(seqs))]
            self.metrics.cache_served(
                hits=len(found),
                misses=len(miss_idx),
                tokens_saved=sum(seqs[i].length for i in found),
                bytes_served=sum(record_bytes(records[i]) for i in found),
            )
            return Served(records=records, k=k, hits=hits, stored=stored, at_ids=at_ids)

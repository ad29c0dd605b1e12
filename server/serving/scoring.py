"""On-demand scoring: checked sequences in, :class:`SequenceRecord` s out (no FastAPI here).

For a sequence ``x_0..x_{L-1}`` the engine returns ``L - 1`` rows (DESIGN.md alignment); a record
is the sequence's key, its ids and those rows. Every check (k within the engine's limit, ids in
the vocabulary, lengths, cache identity) runs before the engine is called, so a rejected request
neither costs engine time nor writes anything.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from logitcache.cache_format import Manifest, SequenceRecord
from logitcache.cache_format.errors import FormatError

from ..admission import TokenGate
from ..batch import pipeline
from ..engine.protocol import EngineInputError, SampledTargets, check_k, check_sampled
from ..errors import (
    CacheBrokenError,
    InvalidInputError,
    OverloadedError,
    PayloadTooLargeError,
    ServiceError,
    format_error_status,
    public_message,
)
from ..inputs.records import Limits, RawRecord, Sequence, to_sequence
from .caches import CacheRegistry, check_name, expected_manifest
from .targets import of_request, resolve

if TYPE_CHECKING:
    from logitcache.protocol import ScoreRequest

    from ..engine import TeacherEngine
    from ..metrics import Metrics
    from ..settings import ServerSettings


log = logging.getLogger("logitcache.server.scoring")


@dataclass(frozen=True)
class ScoreResult:
    """Scored records, the k used, and how many were newly committed to the request's cache."""

    records: list[SequenceRecord]
    k: int
    stored: int
    hits: list[bool] | None = None
    """With a cache: per sequence, whether it was served from the cache (``cache_hits``)."""


class ScoringService:
    """Turns requests into engine calls and records; optionally stores them in a named cache."""

    def __init__(
        self,
        *,
        engine: TeacherEngine,
        caches: CacheRegistry,
        settings: ServerSettings,
        metrics: Metrics,
    ):
        self.engine = engine
        self.caches = caches
        self.settings = settings
        self.metrics = metrics
        self.active = 0
        """On-demand engine calls in progress (jobs yield to them, see ``jobs``)."""
        info = engine.info
        self.limits = Limits(
            vocab_size=info.vocab_size,
            max_seq_len=min(settings.max_seq_len, info.max_seq_len),
            max_text_bytes=settings.text_byte_limit,
        )
        self.default_k = min(settings.k, info.max_k)
        """The k of a request that names none: the server's ``-k`` within the engine's max_k."""
        self.gate = TokenGate(settings.max_queued_tokens)
        """On-demand admission (``max_queued_tokens``); jobs are accounted apart (job table)."""

    # --- checks ---------------------------------------------------------------------------

    def resolve_k(self, k: int | None) -> int:
        """The request's ``k``, or :attr:`default_k` when it names none. The one range check of
        a request's k (the engine's :func:`~.engine.protocol.check_k`: ``1 <= k <= max_k``);
        422 otherwise, before any engine work."""
        if k is None:
            return self.default_k
        info = self.engine.info
        try:
            return check_k(k, info.max_k, info.vocab_size)
        except EngineInputError as e:
            raise InvalidInputError(str(e)) from None

    def expected_manifest(self, k: int | None = None, dataset: str = "") -> Manifest:
        """The manifest of a new cache written by this server's engine at ``k`` (checked)."""
        return expected_manifest(
            self.engine.info,
            k=self.resolve_k(k),
            logprob_dtype=self.settings.logprob_dtype,
            dataset=dataset,
        )

    def target_manifest(self, cache: str, k: int | None, dataset: str = "") -> Manifest:
        """The manifest to write ``cache`` with: an existing cache's own (its k when ``k`` is
        None), else a new one at ``k``. ConflictError if the cache holds another teacher or k.
        """
        name = check_name(cache)
        expected = self.expected_manifest(k, dataset)
        with _broken_store(name):
            manifest = self.caches.target_manifest(name, expected, k=k)
        self.resolve_k(manifest.k)
        return manifest

    def stored_manifest(self, cache: str) -> Manifest | None:
        """Cache ``cache``'s committed manifest (None if absent); 409 ``cache_broken`` if its
        store exists but cannot be read."""
        name = check_name(cache)
        with _broken_store(name):
            return self.caches.manifest(name)

    def sequences_of(self, req: ScoreRequest) -> list[Sequence]:
        """The request's checked, keyed sequences (tokenising texts)."""
        n = req.num_sequences
        if n > self.settings.max_score_sequences:
            raise PayloadTooLargeError(
                f"{n} sequences exceed the limit of {self.settings.max_score_sequences} per request"
            )
        keys: Seq[str | None] = req.keys if req.keys is not None else [None] * n
        if req.keys is not None:
            if any(not k for k in req.keys):
                raise InvalidInputError("keys must be non-empty strings")
            if len(set(req.keys)) != len(req.keys):
                raise InvalidInputError("keys must be distinct")
        if req.texts is not None:
            raws = [
                RawRecord(where=f"texts[{i}]", id=keys[i], text=t, input_ids=None)
                for i, t in enumerate(req.texts)
            ]
        else:
            raws = [
                RawRecord(where=f"input_ids[{i}]", id=keys[i], text=None, input_ids=ids)
                for i, ids in enumerate(req.input_ids or [])
            ]
        return [to_sequence(r, self.engine.tokenize, self.limits) for r in raws]

    # --- scoring --------------------------------------------------------------------------

    async def score_sequences(
        self,
        seqs: Seq[Sequence],
        k: int,
        *,
        source: str,
        targets: SampledTargets | None = None,
    ) -> list[SequenceRecord]:
        """Score checked sequences with the engine; one record per sequence, input order
        (:func:`.pipeline.score_records`, timed under ``source``; ``targets``: sampled rows)."""
        return await pipeline.score_records(
            self.engine, seqs, k, metrics=self.metrics, source=source, targets=targets
        )

    def check_response_size(self, seqs: Seq[Sequence], k: int, *, frames: bool) -> None:
        """413 before any engine work if the answer would exceed ``max_response_bytes``.

        Upper-bound estimate per row: JSON ``k * 34 + 30`` bytes (an id of up to 10 digits and a
        float of up to 22 characters with separators, plus the tail), frames ``k * 8 + 4``; per
        token ``12`` bytes of ``input_ids``.
        """
        tokens = sum(s.length for s in seqs)
        rows = tokens - len(seqs)
        per_row = k * 8 + 4 if frames else k * 34 + 30
        size = rows * per_row + tokens * 12 + 200 * len(seqs)
        limit = self.settings.max_response_bytes
        if size > limit:
            raise PayloadTooLargeError(
                f"the answer would take about {size} bytes, over the limit of {limit}: send fewer "
                "or shorter sequences, a smaller k, or ask for frames "
                "(Accept: application/x-logitcache-frames)"
            )

    def admit(self, tokens: int) -> None:
        """Take ``tokens`` of the on-demand budget or raise :class:`OverloadedError` (429)."""
        if not self.gate.try_acquire(tokens):
            raise OverloadedError(
                f"the server is at its limit of {self.gate.limit} queued prompt tokens "
                f"({self.gate.in_flight} in flight); retry later",
                retry_after=self.gate.retry_after(),
            )

    async def score(self, req: ScoreRequest, *, frames: bool = False) -> ScoreResult:
        """Check, admit, score and (if ``req.cache``) store; all checks precede engine and store.

        Tokenising and checking run in a worker thread (never on the event loop). Cancelling
        the awaiting task (client gone, deadline passed) aborts the engine work.
        """
        if req.cache is not None:  # hits from the cache, misses scored and stored
            from .cache_hits import score_with_cache

            got = await score_with_cache(self, req, frames=frames)
            return ScoreResult(records=got.records, k=got.k, stored=got.stored, hits=got.hits)
        sampled = self.sampled_targets(req)
        k = self.resolve_k(req.k) if sampled is None else sampled.slots
        seqs = await asyncio.to_thread(self.sequences_of, req)
        self.check_response_size(seqs, k, frames=frames)
        records = await self.score_admitted(seqs, k, targets=sampled)
        return ScoreResult(records=records, k=k, stored=0)

    def sampled_targets(self, req: ScoreRequest) -> SampledTargets | None:
        """The request's sampled-target parameters (``None``: top-k), checked against the
        engine (422); without ``sampling``, the defaults of :mod:`.targets`."""
        asked = of_request(req)
        if asked is None:
            return None
        try:
            return check_sampled(resolve(asked, None), self.engine.info.vocab_size)
        except EngineInputError as e:
            raise InvalidInputError(str(e)) from None

    async def score_admitted(
        self, seqs: Seq[Sequence], k: int, *, targets: SampledTargets | None = None
    ) -> list[SequenceRecord]:
        """Engine-score ``seqs`` at ``k`` (or sampled rows with ``targets``) under the on-demand
        admission budget (429 when full); the budget's token rate learns only from requests
        that finished."""
        tokens = sum(s.length for s in seqs)
        self.admit(tokens)
        self.active += 1
        t0 = time.perf_counter()
        finished = False
        try:
            records = await self.score_sequences(seqs, k, source="score", targets=targets)
            finished = True
        finally:
            self.active -= 1
            self.gate.release(tokens, time.perf_counter() - t0 if finished else None)
        return records


@contextmanager
def _broken_store(name: str) -> Iterator[None]:
    """Turn an unreadable store (any error but a typed 4xx finding) into 409 ``cache_broken``
    (message without paths) instead of a 500."""
    try:
        yield
    except ServiceError:
        raise
    except FormatError as e:
        if format_error_status(e)[0] < 500:  # a typed finding (409/422/404): as mapped
            raise
        log.warning("cache %r cannot be opened: %r", name, e)
        raise CacheBrokenError(
            f"cache {name!r} cannot be opened: {type(e).__name__}: {public_message(str(e))}"
        ) from None
    except Exception as e:  # noqa: BLE001 - an unreadable store is a conflict, not a 500
        log.warning("cache %r cannot be opened: %r", name, e)
        raise CacheBrokenError(
            f"cache {name!r} cannot be opened: {type(e).__name__}: {public_message(str(e))}"
        ) from None

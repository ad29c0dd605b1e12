"""On-demand scoring: checked sequences in, :class:`SequenceRecord` s out (no FastAPI here).

Every check (k, ids, lengths, cache identity) runs before the engine is called: a rejected
request costs no engine time and writes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections.abc import AsyncIterator
from collections.abc import Sequence as Seq
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
from logitcache.cache_format import Manifest, SequenceRecord
from logitcache.protocol import FRAMES_MEDIA_TYPE

from ..admission import TokenGate
from ..batch import pipeline
from ..engine.protocol import (
    EngineInputError,
    SampledTargets,
    check_k,
    check_temperature,
)
from ..errors import (
    ConflictError,
    InvalidInputError,
    OverloadedError,
    PayloadTooLargeError,
)
from ..inputs.records import Limits, RawRecord, Sequence, to_sequence
from .caches import CacheRegistry, broken_store, check_name
from .targets import checked, new_manifest, resolve

if TYPE_CHECKING:
    from logitcache.protocol import ScoreRequest

    from ..engine import TeacherEngine
    from ..metrics import TeacherMetrics
    from ..settings import ServerSettings


#: Per answer format: upper-bound bytes per top-k value, per row, per token and per sequence,
#: and what to change when an answer would be over ``max_response_bytes``.
_SEQS = "send fewer or shorter sequences"
_FRAMES = f"ask for frames (Accept: {FRAMES_MEDIA_TYPE})"
ANSWER_BYTES: dict[str, tuple[int, int, int, int, str]] = {
    "json": (34, 30, 12, 200, f"{_SEQS}, a smaller k, or {_FRAMES}"),
    "frames": (8, 4, 12, 200, f"{_SEQS} or a smaller k"),
    "completions": (80, 0, 0, 200, "send fewer or shorter prompts or a smaller prompt_logprobs"),
    "generate": (40, 40, 0, 400, f"{_SEQS} or a smaller top_logprobs_num"),
    "npy": (6, 0, 0, 600, "send a shorter sequence or fewer candidate ids per row"),
}


def raws(
    field: str, items: Seq[str | Seq[int]], keys: Seq[str | None] | None = None
) -> list[RawRecord]:
    """The raw records of a request's list ``field`` (a text or token ids per item)."""
    return [
        RawRecord(
            where=f"{field}[{i}]",
            id=None if keys is None else keys[i],
            text=item if isinstance(item, str) else None,
            input_ids=None if isinstance(item, str) else item,
        )
        for i, item in enumerate(items)
    ]


class Unread(enum.Enum):
    """The type of :data:`UNREAD`."""

    UNREAD = 0


#: A cache manifest argument the callee reads itself (``None``: no cache).
UNREAD = Unread.UNREAD


class ScoringService:
    """Checks on-demand requests against the engine and the limits, and scores checked
    sequences under the on-demand admission budget (no cache logic)."""

    def __init__(
        self,
        *,
        engine: TeacherEngine,
        caches: CacheRegistry,
        settings: ServerSettings,
        metrics: TeacherMetrics,
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

    def check_k(self, k: int | None) -> int | None:
        """The one range check of a request's or job's ``k`` (422); ``None`` stays ``None``."""
        if k is None:
            return None
        info = self.engine.info
        try:
            return check_k(k, info.max_k, info.vocab_size)
        except EngineInputError as e:
            raise InvalidInputError(str(e)) from None

    def check_temperature(self, temperature: float | None) -> float | None:
        """A request's temperature, range-checked (422); ``None`` stays ``None``."""
        if temperature is None:
            return None
        try:
            return check_temperature(temperature, self.engine.info.temperature)
        except EngineInputError as e:
            raise InvalidInputError(str(e)) from None

    def request_temperature(
        self,
        cache: str | None,
        temperature: float | None,
        stored: Manifest | None | Unread = UNREAD,
    ) -> float:
        """The temperature an on-demand request is scored at: its own, else an existing
        ``cache``'s, else the engine's."""
        checked = self.check_temperature(temperature)
        if checked is not None:
            return checked
        if stored is UNREAD:
            stored = None if cache is None else self.stored_manifest(cache)
        return self.engine.info.temperature if stored is None else stored.temperature

    def new_manifest(
        self,
        k: int,
        dataset: str = "",
        temperature: float | None = None,
        targets: SampledTargets | None = None,
    ) -> Manifest:
        """:func:`.targets.new_manifest` of this engine at ``k`` and ``temperature``."""
        info = self.engine.info
        if temperature is not None:
            info = replace(info, temperature=temperature)
        return new_manifest(info, self.settings, k, dataset, targets)

    def target_manifest(
        self,
        cache: str,
        k: int | None,
        dataset: str = "",
        asked: SampledTargets | str | None = None,
        temperature: float | None = None,
        stored: Manifest | None | Unread = UNREAD,
    ) -> Manifest:
        """The manifest to write ``cache`` with for a checked ``k``, target kind ``asked`` and
        ``temperature``: an existing cache's own, else a new one (at ``k`` or
        :attr:`default_k`; sampled: ``head + draws``). 409 if the cache holds another teacher,
        kind, k, temperature or sampling parameters; 422 if its k is beyond this engine's."""
        name = check_name(cache)
        if stored is UNREAD:
            stored = self.stored_manifest(name)
        if asked == "hidden":  # FORMAT.md 4.10: k = 1, the engine's head in the manifest
            new = self.hidden_manifest(dataset, temperature)
            return self.caches.target_manifest(name, new, k=None, stored=stored)
        if asked is not None:
            chosen = self._sampled(resolve(asked, stored))
            new = self.new_manifest(self.default_k, dataset, temperature, chosen)
            return self._same_entropy(self.caches.target_manifest(name, new, k=None, stored=stored))
        expected = self.new_manifest(self.default_k if k is None else k, dataset, temperature)
        with broken_store(name):
            manifest = self.caches.target_manifest(name, expected, k=k, stored=stored)
        if manifest.k != k:  # an existing cache's k: this engine must be able to serve it
            self.check_k(manifest.k)
        return self._same_entropy(manifest)

    def _same_entropy(self, manifest: Manifest) -> Manifest:
        """``manifest`` if its cache keeps per-row entropy exactly when this server computes it,
        else a :class:`ConflictError`."""
        if manifest.entropy != self.settings.entropy:
            have = "keeps" if manifest.entropy else "does not keep"
            raise ConflictError(
                f"the cache {have} per-row teacher entropy and this server runs with "
                f"entropy={str(self.settings.entropy).lower()}: write to a new cache, or run "
                f"the server with entropy={str(manifest.entropy).lower()}"
            )
        return manifest

    def hidden_manifest(self, dataset: str = "", temperature: float | None = None) -> Manifest:
        """The manifest of a new ``targets="hidden"`` cache of this engine (bfloat16 rows, the
        engine's head in ``hidden``); 422 if the engine does not capture hidden states."""
        doc = self.new_manifest(1, dataset, temperature).model_dump()
        doc.update(
            targets="hidden", hidden=self.teacher_head().spec("bfloat16"), actual_logprob=False
        )
        return Manifest(**doc)

    def teacher_head(self) -> Any:
        """The engine's :class:`~logitcache.cache_format.TeacherHead` (422 if it has none)."""
        head = getattr(self.engine, "teacher_head", None)
        if head is None:
            raise InvalidInputError("this engine does not capture hidden states (targets='hidden')")
        try:
            return head()
        except EngineInputError as e:
            raise InvalidInputError(str(e)) from None

    def route_manifest(self, cache: str, temperature: float | None) -> Manifest:
        """The top-k manifest of a protocol route's ``cache`` at :meth:`request_temperature`."""
        stored = self.stored_manifest(cache)
        t = self.request_temperature(cache, temperature, stored)
        return self.target_manifest(cache, None, temperature=t, stored=stored)

    def stored_manifest(self, cache: str) -> Manifest | None:
        """Cache ``cache``'s committed manifest (None if absent; 409 if unreadable)."""
        name = check_name(cache)
        with broken_store(name):
            return self.caches.manifest(name)

    def sampled_targets(self, asked: SampledTargets | str | None) -> SampledTargets | None:
        """The checked sampled parameters of a request without a cache (``None``: top-k)."""
        return None if asked is None else self._sampled(resolve(asked, None))

    def _sampled(self, chosen: SampledTargets | None) -> SampledTargets | None:
        return checked(chosen, self.engine.info.vocab_size)

    def sequences_of(self, req: ScoreRequest) -> list[Sequence]:
        """The request's checked, keyed sequences (tokenising texts)."""
        if req.keys is not None and len(set(req.keys)) != len(req.keys):
            raise InvalidInputError("keys must be distinct")  # (each is a non-empty Key)
        field, items = (
            ("texts", req.texts) if req.texts is not None else ("input_ids", req.input_ids)
        )
        return self.checked(raws(field, items or [], req.keys), "sequences", " per request")

    def checked(self, records: Seq[RawRecord], noun: str, per: str = "") -> list[Sequence]:
        """Checked sequences of one request's raw records; 413 over ``max_score_sequences``."""
        n, limit = len(records), self.settings.max_score_sequences
        if n > limit:
            raise PayloadTooLargeError(f"{n} {noun} exceed the limit of {limit}{per}")
        return [to_sequence(r, self.engine.tokenize, self.limits) for r in records]

    def check_answer_size(self, seqs: Seq[Sequence], k: int, answer: str) -> None:
        """413 before any engine work if the answer (a format of :data:`ANSWER_BYTES`) could
        exceed ``max_response_bytes``."""
        per_value, per_row, per_token, per_seq, smaller = ANSWER_BYTES[answer]
        tokens = sum(s.length for s in seqs)
        rows = tokens - len(seqs)
        size = rows * (k * per_value + per_row) + tokens * per_token + per_seq * len(seqs)
        limit = self.settings.max_response_bytes
        if size > limit:
            raise PayloadTooLargeError(
                f"the answer would take about {size} bytes, over the limit of {limit}: {smaller}"
            )

    # --- scoring --------------------------------------------------------------------------

    def admit(self, tokens: int) -> None:
        """Take ``tokens`` of the on-demand budget or raise :class:`OverloadedError` (429)."""
        if not self.gate.try_acquire(tokens):
            raise OverloadedError(
                f"the server is at its limit of {self.gate.limit} queued prompt tokens "
                f"({self.gate.in_flight} in flight); retry later",
                retry_after=self.gate.retry_after(),
            )

    @contextlib.asynccontextmanager
    async def _admission(self, tokens: int) -> AsyncIterator[None]:
        """Hold ``tokens`` of the on-demand budget around engine work (429 when full)."""
        self.admit(tokens)
        self.active += 1
        t0 = time.perf_counter()
        finished = False
        try:
            yield
            finished = True
        finally:
            self.active -= 1
            self.gate.release(tokens, time.perf_counter() - t0 if finished else None)

    async def admitted(
        self,
        seqs: Seq[Sequence],
        k: int,
        *,
        targets: SampledTargets | None = None,
        temperature: float | None = None,
    ) -> list[SequenceRecord]:
        """Engine records of ``seqs`` at ``k`` (or sampled rows) under the admission budget;
        cancelling the awaiting task aborts the engine work."""
        async with self._admission(sum(s.length for s in seqs)):
            return await pipeline.engine_records(
                self.engine,
                seqs,
                k,
                metrics=self.metrics,
                source="score",
                targets=targets,
                temperature=temperature,
            )

    async def admitted_ids(
        self, seqs: Seq[Sequence], ids: Seq[Seq[int]], temperature: float | None = None
    ) -> list[np.ndarray]:
        """The engine's exact logprobs at chosen ids (per sequence ``i`` a float32
        ``[L_i - 1, len(ids[i])]`` array) under the admission budget."""
        out: list[np.ndarray] = await self._ids_call(seqs, None, ids, temperature)
        return out

    async def admitted_with_ids(
        self, seqs: Seq[Sequence], k: int, ids: Seq[Seq[int]], temperature: float | None = None
    ) -> tuple[list[SequenceRecord], list[np.ndarray]]:
        """Engine records at ``k`` and the exact logprobs at ``ids`` from one engine call."""
        scores, at_ids = await self._ids_call(seqs, k, ids, temperature)
        return await asyncio.to_thread(pipeline.to_records, seqs, scores), at_ids

    async def _ids_call(
        self, seqs: Seq[Sequence], k: int | None, ids: Seq[Seq[int]], temperature: float | None
    ) -> Any:
        """The engine's ``score_ids`` (``k`` None) or ``score_with_ids`` at ``k`` under the
        admission budget; an engine without it or ids it refuses are a 422."""
        call = getattr(self.engine, "score_ids" if k is None else "score_with_ids", None)
        if call is None:
            raise InvalidInputError("this engine cannot score chosen token ids")
        prompts, chosen = [s.input_ids for s in seqs], [list(c) for c in ids]
        args = (prompts, chosen) if k is None else (prompts, k, chosen)
        async with self._admission(sum(s.length for s in seqs)):
            try:
                return await pipeline.timed(call(*args, temperature), seqs, self.metrics, "score")
            except EngineInputError as e:
                raise InvalidInputError(str(e)) from None

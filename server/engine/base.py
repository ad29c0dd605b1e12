"""The path every backend shares: check, score, convert, time (written once).

A backend subclasses :class:`BaseEngine` and supplies ``_generate(prompts, k, temperature)`` (the
model's work on checked prompts: rows of ``log_softmax(z / temperature)``; returns one raw output
per prompt) and, if its raw outputs are not already :class:`~.protocol.TeacherScores`,
``_convert(raw, length, k)``. :meth:`BaseEngine.score` refuses a closed engine, range-checks
``k``, the temperature (``None``: ``info.temperature``) and the prompts against ``info`` (nothing
is computed for bad input), runs ``_generate``, converts, and adds the phases to ``timings``.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from typing import Any, TypeVar, cast

import numpy as np
from logitcache.cache_format import TeacherHead

from .hidden import NOT_CAPTURED
from .protocol import (
    EngineClosedError,
    EngineInfo,
    EngineInputError,
    SampledTargets,
    ScoreTimings,
    TeacherScores,
    check_k,
    check_keys,
    check_prompts,
    check_sampled,
    check_temperature,
    check_token_ids,
)

_T = TypeVar("_T")


class BaseEngine:
    """Common behaviour of the backends (see the module docstring)."""

    info: EngineInfo
    tokenizer: Any
    #: Whether the checked prompts reach ``_generate`` and the other hooks as int64 arrays
    #: (:func:`~.protocol.check_prompts`) instead of ``list[int]`` lists.
    array_prompts = False

    def __init__(self) -> None:
        self.timings = ScoreTimings()
        self._closed = False

    # --- to implement -----------------------------------------------------------------------

    async def _generate(self, prompts: list[list[int]], k: int, temperature: float) -> list[Any]:
        """One raw output per (checked) prompt, in order, at ``temperature``."""
        raise NotImplementedError

    def _convert(self, raw: Any, length: int, k: int) -> TeacherScores:
        """A raw output of a ``length``-token prompt as rows (default: already rows)."""
        return cast(TeacherScores, raw)

    async def _generate_sampled(
        self, prompts: list[list[int]], keys: list[str], targets: SampledTargets, temperature: float
    ) -> list[Any]:
        """One raw sampled output per (checked) prompt, in order (default: not supported)."""
        raise EngineInputError(
            f"the {self.info.backend} backend cannot produce sampled targets (targets='sampled')"
        )

    def _convert_sampled(self, raw: Any, length: int, targets: SampledTargets) -> TeacherScores:
        """A raw sampled output of a ``length``-token prompt as rows (default: already rows)."""
        return cast(TeacherScores, raw)

    async def _generate_ids(
        self, prompts: list[list[int]], ids: list[list[int]], temperature: float
    ) -> list[np.ndarray]:
        """Per (checked) prompt the ``[L - 1, len(ids[i])]`` logprobs at ``ids[i]``."""
        raise EngineInputError(f"the {self.info.backend} backend cannot score chosen token ids")

    async def _generate_with_ids(
        self, prompts: list[list[int]], k: int, ids: list[list[int]], temperature: float
    ) -> tuple[list[TeacherScores], list[np.ndarray]]:
        """Top-``k`` rows and the logprobs at ``ids[i]`` of every (checked) prompt (default: two
        calls; a backend with one pass for both overrides it)."""
        raw = await self._generate(prompts, k, temperature)
        scores = [self._convert(r, len(p), k) for r, p in zip(raw, prompts, strict=True)]
        return scores, await self._generate_ids(prompts, ids, temperature)

    async def _generate_hidden(self, prompts: list[list[int]]) -> list[np.ndarray]:
        """Per (checked) prompt its float32 ``[L - 1, d]`` final hidden states (FORMAT.md 4.10;
        default: not captured by this backend)."""
        raise EngineInputError(NOT_CAPTURED.format(backend=self.info.backend))

    def teacher_head(self) -> TeacherHead:
        """The teacher's output head that turns :meth:`score_hidden`'s rows into its logits
        (default: not captured by this backend)."""
        raise EngineInputError(NOT_CAPTURED.format(backend=self.info.backend))

    async def _close(self) -> None:
        """Release the backend's resources (called once)."""

    @property
    def alive(self) -> bool:
        """Whether the engine can score (not closed, its processes running)."""
        return not self._closed

    # --- TeacherEngine ----------------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        """Teacher-tokenizer ids of ``text`` (BOS included when the tokenizer adds one)."""
        if not isinstance(text, str):
            raise EngineInputError(f"text must be a string, got {type(text).__name__}")
        return list(self.tokenizer(text)["input_ids"])

    async def score(
        self, prompts: list[list[int]], k: int, temperature: float | None = None
    ) -> list[TeacherScores]:
        """Top-``k`` rows of every prompt at ``temperature`` (``None``: ``info.temperature``),
        in order (the contract of :mod:`.protocol`)."""
        self._check_open()
        k = check_k(k, self.info.max_k, self.info.vocab_size)
        t = check_temperature(temperature, self.info.temperature)
        checked = check_prompts(prompts, self.info, self.array_prompts)
        t0 = time.perf_counter()
        raw = await self._generate(checked, k, t)
        t1 = time.perf_counter()
        scores = [self._convert(r, len(ids), k) for r, ids in zip(raw, checked, strict=True)]
        t2 = time.perf_counter()
        self._account(checked, sum(s.num_rows for s in scores), t0, t1, t2)
        return scores

    async def score_sampled(
        self,
        prompts: list[list[int]],
        keys: list[str],
        targets: SampledTargets,
        temperature: float | None = None,
    ) -> list[TeacherScores]:
        """Sampled rows of every prompt in order (module :mod:`.protocol`); every check before any
        work."""
        self._check_open()
        targets = check_sampled(targets, self.info.vocab_size)
        t = check_temperature(temperature, self.info.temperature)
        checked = check_prompts(prompts, self.info, self.array_prompts)
        keys = check_keys(keys, len(checked))
        t0 = time.perf_counter()
        raw = await self._generate_sampled(checked, keys, targets, t)
        t1 = time.perf_counter()
        scores = [
            self._convert_sampled(r, len(ids), targets) for r, ids in zip(raw, checked, strict=True)
        ]
        t2 = time.perf_counter()
        self._account(checked, sum(s.num_rows for s in scores), t0, t1, t2)
        return scores

    async def score_ids(
        self,
        prompts: list[list[int]],
        ids: list[list[int]],
        temperature: float | None = None,
    ) -> list[np.ndarray]:
        """The exact logprobs at chosen ids: per prompt a float32 ``[L_i - 1, len(ids[i])]`` array;
        every check before any work."""
        self._check_open()
        t = check_temperature(temperature, self.info.temperature)
        checked = check_prompts(prompts, self.info, self.array_prompts)
        chosen = check_token_ids(ids, len(checked), self.info.vocab_size)
        return await self._timed(checked, self._generate_ids(checked, chosen, t))

    async def score_with_ids(
        self,
        prompts: list[list[int]],
        k: int,
        ids: list[list[int]],
        temperature: float | None = None,
    ) -> tuple[list[TeacherScores], list[np.ndarray]]:
        """:meth:`score` and :meth:`score_ids` of the same prompts in one call (the
        transformers backend: one forward for both); every check runs before any work."""
        self._check_open()
        k = check_k(k, self.info.max_k, self.info.vocab_size)
        t = check_temperature(temperature, self.info.temperature)
        checked = check_prompts(prompts, self.info, self.array_prompts)
        chosen = check_token_ids(ids, len(checked), self.info.vocab_size)
        return await self._timed(checked, self._generate_with_ids(checked, k, chosen, t))

    async def score_hidden(self, prompts: list[list[int]]) -> list[np.ndarray]:
        """The teacher's final hidden states (the head's input), float32 ``[L_i - 1, d]`` per
        prompt; every check before any work."""
        self._check_open()
        checked = check_prompts(prompts, self.info, self.array_prompts)
        return await self._timed(checked, self._generate_hidden(checked))

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the engine is closed")

    async def _timed(self, checked: list[Any], work: Awaitable[_T]) -> _T:
        """``work``'s result, its time counted as engine time of ``checked``'s rows."""
        t0 = time.perf_counter()
        out = await work
        t1 = time.perf_counter()
        self._account(checked, sum(len(p) - 1 for p in checked), t0, t1, t1)
        return out

    def _account(
        self, checked: list[list[int]], rows: int, t0: float, t1: float, t2: float
    ) -> None:
        """One engine call in :attr:`timings`: engine time ``t1 - t0``, conversion ``t2 - t1``."""
        tm = self.timings
        tm.engine += t1 - t0
        tm.convert += t2 - t1
        tm.calls += 1
        tm.prompts += len(checked)
        tm.rows += rows

    async def aclose(self) -> None:
        """Release the engine (idempotent); later ``score`` calls raise EngineClosedError."""
        if self._closed:
            return
        self._closed = True
        await self._close()

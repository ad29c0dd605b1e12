"""A teacher engine that is restarted when it dies: :class:`SupervisedEngine`.

It wraps the engine a ``build`` function returns and is itself a
:class:`~.protocol.TeacherEngine`. A monitor task checks the engine's ``alive`` every
:data:`CHECK_S` seconds; a call failing with :class:`~.protocol.EngineUnavailableError` (or any
error once the engine is not alive) also marks it dead. Declaring it dead fails every call in
flight on it at once and cancels the engine's side (:class:`_Lifetime`), so no caller is left
waiting. A dead engine is closed and built again in a worker thread, with a growing pause between
failed builds; meanwhile calls raise :class:`~.protocol.EngineUnavailableError` with a
``retry_after`` from the engine's start-up time. Only an engine in its own process can be
restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from .protocol import (
    EngineClosedError,
    EngineError,
    EngineInfo,
    EngineInputError,
    EngineUnavailableError,
    SampledTargets,
    TeacherEngine,
    TeacherScores,
)

log = logging.getLogger("logitcache.server.engine")

#: Seconds between two checks of the engine's liveness.
CHECK_S = 1.0
#: Pauses between failed builds, in seconds (the last repeats).
BACKOFF_S = (1.0, 5.0, 15.0, 60.0)
#: Seconds to wait for a dead engine's clean-up before building the next one.
CLOSE_TIMEOUT_S = 60.0


T = TypeVar("T")


def engine_alive(engine: Any) -> bool:
    """An engine's ``alive`` (an engine without one counts as alive)."""
    return bool(getattr(engine, "alive", True))


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Mark an abandoned engine call's outcome as seen (no "never retrieved" warning)."""
    if not task.cancelled():
        task.exception()


class _Lifetime:
    """The calls in flight on one engine: :meth:`end` (the engine declared dead, or closed)
    makes each of them raise ``error()`` at once and cancels its engine-side task."""

    def __init__(self) -> None:
        self.error: Callable[[], EngineError] | None = None
        self._waiters: set[asyncio.Future[None]] = set()

    def end(self, error: Callable[[], EngineError]) -> None:
        """End the engine's lifetime (once): every call in flight raises ``error()``."""
        if self.error is not None:
            return
        self.error = error
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def run(self, call: Awaitable[T]) -> T:
        """``call``'s outcome, unless the lifetime ends first: then ``call`` is cancelled (not
        awaited) and ``error()`` raised. Cancelling the caller cancels ``call`` too."""
        task = asyncio.ensure_future(call)
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.add(waiter)
        try:
            if self.error is None:
                await asyncio.wait((task, waiter), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._waiters.discard(waiter)
            waiter.cancel()
            if not task.done():
                task.cancel()
                task.add_done_callback(_retrieve)
        if task.done():
            return task.result()
        assert self.error is not None
        raise self.error()


class SupervisedEngine:
    """A :class:`~.protocol.TeacherEngine` that rebuilds its engine when it dies (module doc);
    ``build`` runs now, and in a worker thread for each restart."""

    def __init__(self, build: Callable[[], TeacherEngine]):
        self._build = build
        t0 = time.monotonic()
        self._engine = build()
        self._life = _Lifetime()
        self.start_s = time.monotonic() - t0
        self.restarts = 0
        self._restarting_since: float | None = None
        self._closed = False
        self._restart: asyncio.Task[None] | None = None
        self._monitor: asyncio.Task[None] | None = None

    # --- state ------------------------------------------------------------------------------

    @property
    def engine(self) -> TeacherEngine:
        """The current engine (another object after a restart)."""
        return self._engine

    @property
    def info(self) -> EngineInfo:
        return self._engine.info

    @property
    def tokenizer(self) -> Any:
        return getattr(self._engine, "tokenizer", None)

    @property
    def timings(self) -> Any:
        return getattr(self._engine, "timings", None)

    @property
    def alive(self) -> bool:
        """Ready to score: not closed, not restarting, the engine alive."""
        return not self._closed and self._restarting_since is None and engine_alive(self._engine)

    def retry_after(self) -> float:
        """Seconds until the engine is expected back (at least 1)."""
        if self._restarting_since is None:
            return max(1.0, math.ceil(self.start_s))
        left = self.start_s - (time.monotonic() - self._restarting_since)
        return max(1.0, math.ceil(left))

    # --- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Start watching the engine (on the running event loop)."""
        if self._monitor is None:
            self._monitor = asyncio.create_task(self._watch(), name="engine-monitor")

    async def _watch(self) -> None:
        while not self._closed:
            await asyncio.sleep(CHECK_S)
            if self._restarting_since is None and not engine_alive(self._engine):
                self._died(self._engine, "the engine stopped")

    def _died(self, engine: TeacherEngine, why: str) -> None:
        """Start a restart unless one runs or ``engine`` was already replaced."""
        if self._closed or engine is not self._engine or self._restarting_since is not None:
            return
        log.error("teacher engine unavailable (%s): restarting it", why)
        self._restarting_since = time.monotonic()
        self._life.end(lambda: EngineUnavailableError(why, retry_after=self.retry_after()))
        self._restart = asyncio.create_task(self._rebuild(engine), name="engine-restart")

    async def _rebuild(self, dead: TeacherEngine) -> None:
        try:
            await asyncio.wait_for(dead.aclose(), CLOSE_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - a dead engine's clean-up may fail
            log.warning("closing the dead engine failed: %r", e)
        attempt = 0
        while not self._closed:
            t0 = time.monotonic()
            try:
                engine = await asyncio.to_thread(self._build)
            except Exception:  # noqa: BLE001 - keep trying: the service stays up, 503 meanwhile
                pause = BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)]
                log.exception("restarting the teacher engine failed; next try in %g s", pause)
                attempt += 1
                await asyncio.sleep(pause)
                continue
            if self._closed:
                await engine.aclose()
                return
            self.start_s = time.monotonic() - t0
            self._engine = engine
            self._life = _Lifetime()
            self.restarts += 1
            self._restarting_since = None
            log.warning("teacher engine restarted in %.1f s", self.start_s)
            return

    async def aclose(self) -> None:
        """Stop watching and close the current engine (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._life.end(lambda: EngineClosedError("the engine is closed"))
        for task in (self._monitor, self._restart):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        await self._engine.aclose()

    # --- TeacherEngine ----------------------------------------------------------------------

    def _current(self) -> TeacherEngine:
        if self._closed:
            raise EngineClosedError("the engine is closed")
        if self._restarting_since is not None:
            raise EngineUnavailableError(
                "the teacher engine is restarting", retry_after=self.retry_after()
            )
        return self._engine

    async def _call(self, method: str, cannot: str, *args: Any) -> Any:
        """The current engine's ``method`` on ``args``, failed at once when the engine is declared
        dead meanwhile; :class:`EngineInputError` if it has no such method."""
        engine, life = self._current(), self._life
        call = getattr(engine, method, None)
        if call is None:
            raise EngineInputError(f"this engine cannot {cannot}")
        try:
            return await life.run(call(*args))
        except EngineError as e:
            raise self._failed(engine, e) from e

    def _failed(self, engine: TeacherEngine, e: EngineError) -> EngineError:
        """The error to raise for ``e``: a dead engine's becomes EngineUnavailableError (and
        starts a restart); another engine error stays as it is."""
        if isinstance(e, EngineUnavailableError) or not engine_alive(engine):
            self._died(engine, str(e))
            if isinstance(e, EngineClosedError) and self._closed:
                return e
            return EngineUnavailableError(
                f"the teacher engine died and is restarting ({e})", retry_after=self.retry_after()
            )
        return e

    def tokenize(self, text: str) -> list[int]:
        return self._engine.tokenize(text)

    async def score(
        self, prompts: list[list[int]], k: int, temperature: float | None = None
    ) -> list[TeacherScores]:
        out: list[TeacherScores] = await self._call("score", "score", prompts, k, temperature)
        return out

    async def score_sampled(
        self,
        prompts: list[list[int]],
        keys: list[str],
        targets: SampledTargets,
        temperature: float | None = None,
    ) -> list[TeacherScores]:
        out: list[TeacherScores] = await self._call(
            "score_sampled",
            "produce sampled targets (targets='sampled')",
            prompts,
            keys,
            targets,
            temperature,
        )
        return out

    async def score_with_ids(
        self,
        prompts: list[list[int]],
        k: int,
        ids: list[list[int]],
        temperature: float | None = None,
    ) -> tuple[list[TeacherScores], list[Any]]:
        out: tuple[list[TeacherScores], list[Any]] = await self._call(
            "score_with_ids", "score chosen token ids", prompts, k, ids, temperature
        )
        return out

    async def score_hidden(self, prompts: list[list[int]]) -> list[Any]:
        out: list[Any] = await self._call(
            "score_hidden", "capture hidden states (targets='hidden')", prompts
        )
        return out

    def teacher_head(self) -> Any:
        """The current engine's teacher head (FORMAT.md 4.10)."""
        call = getattr(self._current(), "teacher_head", None)
        if call is None:
            raise EngineInputError("this engine cannot capture hidden states (targets='hidden')")
        return call()

    async def score_ids(
        self, prompts: list[list[int]], ids: list[list[int]], temperature: float | None = None
    ) -> list[Any]:
        out: list[Any] = await self._call(
            "score_ids", "score chosen token ids", prompts, ids, temperature
        )
        return out

"""Several teachers behind one service: :class:`TeacherPool`.

Each teacher has its own engine, :class:`~.scoring.ScoringService` and
:class:`~.cache_hits.CacheServing` over the one cache registry. Requests and jobs reach a teacher
through :meth:`TeacherPool.use` (404 for an unknown ``model``), which loads it and counts its work
in flight. Loads run one at a time and keep the loaded teachers within ``teacher_memory_bytes``
by unloading the least recently used idle ones (one teacher is always let in).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ..errors import UnknownModelError, public_name
from .cache_hits import CacheServing
from .caches import check_name
from .scoring import ScoringService

if TYPE_CHECKING:
    from ..engine import EngineInfo, TeacherEngine
    from ..metrics import Metrics
    from ..settings import ServerSettings, TeacherSettings
    from .caches import CacheRegistry

log = logging.getLogger("logitcache.server.teachers")

#: Files counted as a model's weights when a teacher names no ``memory_bytes``.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")

State = Literal["unloaded", "loading", "loaded", "unloading"]


def weights_bytes(model: str) -> int:
    """Bytes of a local model directory's weight files (0 for a hub id or no model)."""
    path = Path(model).expanduser()
    if not model or not path.is_dir():
        return 0
    return sum(p.stat().st_size for p in path.rglob("*") if p.suffix in WEIGHT_SUFFIXES)


def cache_suffix(name: str) -> str:
    """``name`` as a cache-name part (characters outside ``[A-Za-z0-9._-]`` become ``-``)."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", name)


@dataclass(frozen=True)
class Known:
    """What a teacher's engine reported when it was last loaded (its info and tokenizer): a
    stand-in engine for checking a job for that teacher while it is not loaded (no scoring)."""

    info: EngineInfo
    tokenizer: Any

    def tokenize(self, text: str) -> list[int]:
        """The engine's tokenize (:meth:`~..engine.BaseEngine.tokenize`)."""
        return list(self.tokenizer(text)["input_ids"])


@dataclass
class Teacher:
    """One teacher: settings, and while loaded its engine, scoring service and cache serving."""

    name: str
    settings: ServerSettings
    memory: int
    default: bool
    aliases: frozenset[str]
    engine: TeacherEngine | None = None
    scoring: ScoringService | None = None
    serving: CacheServing | None = None
    state: State = "unloaded"
    known: Known | None = None
    in_flight: int = 0
    loads: int = 0
    last_used: float = field(default_factory=time.monotonic)

    @property
    def loaded(self) -> bool:
        return self.state == "loaded"

    def route_cache(self, asked: str | None, base: str, temperature: float | None) -> str:
        """The checked cache name a protocol route serves this teacher from: ``asked``, else
        ``base`` (default teacher) or ``f"{base}-{name}"``, suffixed ``f"-t{T}"`` at a temperature
        other than the engine's."""
        assert self.engine is not None
        if asked:
            return check_name(asked)
        named = base if self.default else f"{base}-{cache_suffix(self.name)}"
        if temperature is None or temperature == self.engine.info.temperature:
            return named
        return f"{named}-t{float(temperature)!r}"

    def status(self) -> dict[str, Any]:
        """The teacher's state for ``/health`` and the status page."""
        info = None if self.engine is None else self.engine.info
        return {
            "name": self.name,
            "model": public_name(self.settings.model),
            "backend": self.settings.backend,
            "state": self.state,
            "in_flight": self.in_flight,
            "memory_bytes": self.memory,
            "loads": self.loads,
            "max_k": None if info is None else info.max_k,
            "alive": None if self.engine is None else bool(getattr(self.engine, "alive", True)),
        }


def _supervised(settings: ServerSettings) -> TeacherEngine:
    """The configured engine, supervised: restarted when it dies (:mod:`..engine.supervisor`)."""
    from ..engine import SupervisedEngine, build_engine

    engine: Any = SupervisedEngine(lambda: build_engine(settings))
    return engine  # a TeacherEngine by its methods (its ``info`` is a read-only property)


class TeacherPool:
    """The service's teachers, loaded on demand within a memory budget (module doc); ``engine``:
    one the caller owns, used for the default teacher and never closed."""

    def __init__(
        self,
        settings: ServerSettings,
        caches: CacheRegistry,
        metrics: Metrics,
        *,
        build: Callable[[ServerSettings], TeacherEngine] | None = None,
        engine: TeacherEngine | None = None,
    ):
        self.settings = settings
        self.caches = caches
        self.metrics = metrics
        self.budget = settings.teacher_memory_bytes
        self._build = build or _supervised
        self._given = engine
        self.teachers: dict[str, Teacher] = {}
        specs = settings.teacher_list()
        if engine is not None and not settings.teachers:  # the one teacher: the engine's name
            specs[0] = specs[0].model_copy(update={"name": public_name(engine.info.model_id)})
        for i, spec in enumerate(specs):
            self.teachers[spec.name] = self._teacher(spec, i == 0)
        self._lock = asyncio.Lock()  # one load or unload at a time
        self._released = asyncio.Event()  # some teacher's work ended (a waiting load retries)
        self._started = False

    def _teacher(self, spec: TeacherSettings, default: bool) -> Teacher:
        each = self.settings.for_teacher(spec)
        aliases = {spec.name, spec.model, public_name(spec.model)}
        if default and self._given is not None:
            model_id = self._given.info.model_id
            aliases |= {model_id, public_name(model_id)}
        memory = spec.memory_bytes if spec.memory_bytes is not None else weights_bytes(spec.model)
        aliases.discard("")
        return Teacher(spec.name, each, memory, default, frozenset(aliases))

    # --- routing --------------------------------------------------------------------------

    @property
    def default(self) -> Teacher:
        return next(iter(self.teachers.values()))

    def resolve(self, model: str | None) -> Teacher:
        """The teacher a request's ``model`` names (``None``: the default one); 404 otherwise."""
        if model is None:
            return self.default
        found = self.teachers.get(model)
        if found is not None:
            return found
        for teacher in self.teachers.values():
            if model in teacher.aliases:
                return teacher
        raise UnknownModelError(
            f"The model `{model}` does not exist.",
            detail={"models": list(self.teachers)},
        )

    @contextlib.asynccontextmanager
    async def use(self, model: str | None) -> AsyncIterator[Teacher]:
        """The loaded teacher ``model`` names, held (never unloaded) until the block ends."""
        teacher = self.resolve(model)
        teacher.in_flight += 1
        try:
            if not teacher.loaded:
                await self._load(teacher)
            yield teacher
        finally:
            teacher.in_flight -= 1
            teacher.last_used = time.monotonic()
            self._released.set()  # never waits: a load in progress must not delay this answer

    @contextlib.asynccontextmanager
    async def checking(self, model: str | None) -> AsyncIterator[tuple[Teacher, ScoringService]]:
        """The teacher ``model`` names and a scoring service to check work for it with: its own
        while loaded, else one over what its engine reported when last loaded (:class:`Known`)."""
        teacher = self.resolve(model)
        known = teacher.known
        if teacher.loaded or known is None or known.tokenizer is None:
            async with self.use(model) as held:
                assert held.scoring is not None
                yield held, held.scoring
            return
        yield teacher, self._scoring(teacher, known)

    def _scoring(self, teacher: Teacher, engine: Any) -> ScoringService:
        metrics = self.metrics.for_teacher(teacher.name)
        return ScoringService(
            engine=engine, caches=self.caches, settings=teacher.settings, metrics=metrics
        )

    # --- loading --------------------------------------------------------------------------

    def _fits(self, teacher: Teacher) -> bool:
        resident = [t for t in self.teachers.values() if t.state != "unloaded"]
        others = [t for t in resident if t is not teacher]
        used = sum(t.memory for t in resident)
        return self.budget is None or not others or used + teacher.memory <= self.budget

    async def _load(self, teacher: Teacher) -> None:
        while True:
            async with self._lock:
                if teacher.loaded:
                    return
                if self._fits(teacher):
                    await self._start(teacher)
                    return
                idle = sorted(
                    (
                        t
                        for t in self.teachers.values()
                        if t.loaded and t.in_flight == 0 and t is not teacher
                    ),
                    key=lambda t: t.last_used,
                )
                if idle:
                    await self._unload(idle[0])
                    continue
                # every loaded teacher is busy: wait for one to finish its work (cleared with
                # no await since the check, so a release in between cannot be missed)
                self._released.clear()
            await self._released.wait()

    async def _start(self, teacher: Teacher) -> None:
        """Build ``teacher``'s engine: in a worker thread, except at start-up (:meth:`start`,
        on this thread as a one-teacher service always built it)."""
        teacher.state = "loading"
        t0 = time.perf_counter()
        try:
            if teacher.default and self._given is not None:
                engine = self._given
            else:
                engine = (
                    await asyncio.to_thread(self._build, teacher.settings)
                    if self._started
                    else self._build(teacher.settings)
                )
                starting = getattr(engine, "start", None)
                if starting is not None:
                    await starting()
        except BaseException:
            teacher.state = "unloaded"
            raise
        scoring = self._scoring(teacher, engine)
        teacher.engine, teacher.scoring, teacher.serving = engine, scoring, CacheServing(scoring)
        teacher.known = Known(engine.info, getattr(engine, "tokenizer", None))
        teacher.state, teacher.loads = "loaded", teacher.loads + 1
        log.info("teacher %s loaded in %.1f s", teacher.name, time.perf_counter() - t0)

    async def _unload(self, teacher: Teacher) -> None:
        teacher.state = "unloading"
        engine, serving = teacher.engine, teacher.serving
        teacher.engine = teacher.scoring = teacher.serving = None
        try:
            if serving is not None:
                await serving.aclose()  # its queued appends are committed first
            if engine is not None and engine is not self._given:
                await engine.aclose()
        finally:
            teacher.state = "unloaded"
        log.info("teacher %s unloaded", teacher.name)

    async def start(self) -> None:
        """Load the default teacher (at start-up, so a one-teacher service is ready at once)."""
        async with self.use(None):
            self._started = True

    async def aclose(self) -> None:
        """Unload every teacher (shutdown)."""
        for teacher in self.teachers.values():
            if teacher.state == "loaded":
                await self._unload(teacher)

    # --- state ----------------------------------------------------------------------------

    def resident(self) -> list[str]:
        """Names of the loaded teachers."""
        return [t.name for t in self.teachers.values() if t.loaded]

    def status(self) -> list[dict[str, Any]]:
        """Every teacher's :meth:`Teacher.status`, the default first."""
        return [t.status() for t in self.teachers.values()]

"""``GET /health`` (never behind the API key) and ``GET /metrics`` (Prometheus text format)."""

from __future__ import annotations

import functools
from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, Response
from logitcache.protocol import ErrorResponse, Health, TeacherState
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..engine import EngineUnavailableError, SupervisedEngine
from .deps import ServicesDep

router = APIRouter(tags=["ops"])


@functools.cache
def _version() -> str:
    """The package version, read once (``/health`` must not parse METADATA on every call)."""
    try:
        return version("logitcache")
    except PackageNotFoundError:
        return "0+unknown"


@router.get(
    "/health",
    response_model=Health,
    responses={
        503: {
            "model": ErrorResponse,
            "description": "starting or stopping (`unavailable`), or the engine has died and is "
            "being restarted (`engine_unavailable`, with `Retry-After`)",
        }
    },
)
async def health(services: ServicesDep) -> Health:
    """Liveness and readiness: 200 while the loaded teachers' engines can score, else 503;
    ``teachers``: every teacher's state."""
    pool = services.teachers
    for teacher in pool.teachers.values():
        engine = teacher.engine
        if engine is not None and not getattr(engine, "alive", True):
            retry = engine.retry_after() if isinstance(engine, SupervisedEngine) else 5.0
            raise EngineUnavailableError(
                f"the teacher engine {teacher.name} is not running", retry_after=retry
            )
    default = pool.default
    k = default.scoring.default_k if default.scoring is not None else services.settings.k
    teachers = [TeacherState.model_validate(s) for s in pool.status()]
    return Health(model=default.name, k=k, version=_version(), teachers=teachers)


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
        401: {"model": ErrorResponse, "description": "missing or wrong API key"},
        503: {"model": ErrorResponse, "description": "starting or stopping"},
    },
)
async def metrics(services: ServicesDep) -> Response:
    return Response(generate_latest(services.metrics.registry), media_type=CONTENT_TYPE_LATEST)

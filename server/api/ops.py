"""``GET /health`` (never behind the API key) and ``GET /metrics`` (Prometheus text format)."""

from __future__ import annotations

import functools
from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, Response
from logitcache.protocol import ErrorResponse, Health
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..engine import EngineUnavailableError, SupervisedEngine
from .deps import ServicesDep, public_model

router = APIRouter(tags=["ops"])


@functools.cache
def _version() -> str:
    """The package version, read once (``importlib.metadata`` parses the METADATA file on every
    call: file I/O and an e-mail header parse that ``/health`` must not pay each time)."""
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
    """Liveness and readiness: 200 while the engine can score; 503 while starting, stopping, or
    while a dead engine is restarted (no engine call: the engine's own liveness flag)."""
    engine = services.engine
    if not getattr(engine, "alive", True):
        retry = engine.retry_after() if isinstance(engine, SupervisedEngine) else 5.0
        raise EngineUnavailableError("the teacher engine is not running", retry_after=retry)
    info = engine.info
    k = services.scoring.default_k
    return Health(model=public_model(info.model_id), k=k, version=_version())


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

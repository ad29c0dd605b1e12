"""``GET /health`` (never behind the API key) and ``GET /metrics`` (Prometheus text format)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .deps import ServicesDep
from .protocol import Health

router = APIRouter(tags=["ops"])


def _version() -> str:
    try:
        return version("logitcache")
    except PackageNotFoundError:
        return "0+unknown"


@router.get("/health", response_model=Health)
async def health(services: ServicesDep) -> Health:
    """Liveness and readiness: 200 once the engine is loaded (503 while starting)."""
    info = services.engine.info
    return Health(model=info.model_id, k=min(services.settings.k, info.max_k), version=_version())


@router.get("/metrics", response_class=Response)
async def metrics(services: ServicesDep) -> Response:
    return Response(generate_latest(services.metrics.registry), media_type=CONTENT_TYPE_LATEST)

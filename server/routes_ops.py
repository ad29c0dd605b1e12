"""``GET /health`` (never behind the API key) and ``GET /metrics`` (Prometheus text format)."""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .deps import ServicesDep
from .protocol import ErrorResponse, Health

router = APIRouter(tags=["ops"])


def _version() -> str:
    try:
        return version("logitcache")
    except PackageNotFoundError:
        return "0+unknown"


def public_model(model_id: str) -> str:
    """The teacher's name for public bodies: an absolute local path shows only its last part."""
    if not os.path.isabs(model_id):
        return model_id
    return os.path.basename(model_id.rstrip("/")) or model_id


@router.get(
    "/health",
    response_model=Health,
    responses={503: {"model": ErrorResponse, "description": "starting or stopping"}},
)
async def health(services: ServicesDep) -> Health:
    """Liveness and readiness: 200 once the engine is loaded (503 while starting)."""
    info = services.engine.info
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

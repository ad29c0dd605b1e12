"""The per-app service container and its request accessor (routes reach services only here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request

from .errors import UnavailableError

if TYPE_CHECKING:
    from .caches import CacheRegistry
    from .engine import TeacherEngine
    from .jobs import JobRunner
    from .metrics import Metrics
    from .scoring import ScoringService
    from .settings import ServerSettings


@dataclass
class Services:
    """Everything a route may use; built by the app's lifespan, stored on ``app.state``."""

    settings: ServerSettings
    engine: TeacherEngine
    caches: CacheRegistry
    scoring: ScoringService
    jobs: JobRunner
    metrics: Metrics


async def get_services(request: Request) -> Services:
    """The app's services, or 503 while starting/stopping. ``async`` on purpose: FastAPI runs a
    plain ``def`` dependency in its worker-thread pool, and that hop (queued behind every other
    worker-thread task, and two GIL hand-offs) made even ``/health`` wait under load."""
    services = getattr(request.app.state, "services", None)
    if services is None:
        raise UnavailableError("the service is starting or stopping", retry_after=5)
    return services


ServicesDep = Annotated[Services, Depends(get_services)]

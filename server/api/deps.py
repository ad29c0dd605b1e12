"""The per-app service container and its request accessor (routes reach services only here),
and :class:`OffLoopJSONRoute`, the route class that decodes JSON bodies in a worker thread."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, Request, Response
from fastapi.routing import APIRoute

from ..errors import UnavailableError

if TYPE_CHECKING:
    from ..batch.jobs import JobRunner
    from ..engine import TeacherEngine
    from ..metrics import Metrics
    from ..serving.caches import CacheRegistry
    from ..serving.scoring import ScoringService
    from ..settings import ServerSettings


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


class _OffLoopJSONRequest(Request):
    """A request whose ``json()`` decodes the body in a worker thread (same result, same
    exceptions as Starlette's: FastAPI maps a decode error to 422 and any other, e.g. a
    ``RecursionError`` from deep nesting, to 400)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            self._json = await asyncio.to_thread(json.loads, body)
        return self._json


class OffLoopJSONRoute(APIRoute):
    """Route class of the routes with large JSON bodies (``/v1/score``, ``/v1/jobs``).

    FastAPI decodes a JSON body with ``json.loads`` on the event loop: about 1-7 ms for a
    64-client overload's 8,000-token request (46 KB), so a burst of them held the loop (and so
    ``/health``) for hundreds of ms. Here the decoding runs in a worker thread, where the
    interpreter's switch interval lets the loop in every 5 ms; validation of the decoded value
    stays FastAPI's (same errors, same OpenAPI)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            return await handler(_OffLoopJSONRequest(request.scope, request.receive))

        return handle

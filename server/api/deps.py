"""What the routers share: the per-app service container (routes reach services only here),
:class:`OffLoopJSONRoute`, :func:`with_teacher` (work on the named teacher, cancelled when its
client leaves or its deadline passes) and the error answers of the scoring routes."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

from fastapi import Depends, Request, Response
from fastapi.routing import APIRoute
from logitcache.protocol import ErrorResponse, JobStatus

from ..errors import (
    ClientClosedError,
    DeadlineExceededError,
    UnavailableError,
    public_message,
)

if TYPE_CHECKING:
    from ..batch.jobs import JobRunner
    from ..engine import TeacherEngine
    from ..metrics import Metrics
    from ..serving.cache_hits import CacheServing
    from ..serving.caches import CacheRegistry
    from ..serving.scoring import ScoringService
    from ..serving.teachers import Teacher, TeacherPool
    from ..settings import ServerSettings


@dataclass
class Services:
    """Everything a route may use; built by the app's lifespan, stored on ``app.state``. A
    route reaches a teacher's engine and scoring through ``teachers.use(model)`` only."""

    settings: ServerSettings
    teachers: TeacherPool
    caches: CacheRegistry
    jobs: JobRunner
    metrics: Metrics

    def _default(self) -> Teacher:
        teacher = self.teachers.default
        if not teacher.loaded:
            raise UnavailableError(f"the teacher {teacher.name} is not loaded", retry_after=5)
        return teacher

    @property
    def engine(self) -> TeacherEngine:
        """The default teacher's engine (503 while it is not loaded)."""
        return self._default().engine  # type: ignore[return-value]

    @property
    def scoring(self) -> ScoringService:
        """The default teacher's scoring service (503 while it is not loaded)."""
        return self._default().scoring  # type: ignore[return-value]

    @property
    def serving(self) -> CacheServing:
        """The default teacher's cache serving (503 while it is not loaded)."""
        return self._default().serving  # type: ignore[return-value]


async def get_services(request: Request) -> Services:
    """The app's services, or 503 while starting/stopping (``async``: no worker-thread hop)."""
    services = getattr(request.app.state, "services", None)
    if services is None:
        raise UnavailableError("the service is starting or stopping", retry_after=5)
    return services


ServicesDep = Annotated[Services, Depends(get_services)]


class _OffLoopJSONRequest(Request):
    """A request whose ``json()`` decodes the body in a worker thread."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            self._json = await asyncio.to_thread(json.loads, body)
        return self._json


class OffLoopJSONRoute(APIRoute):
    """Route class of the routes with large JSON bodies (``/v1/score``, ``/v1/jobs``): the body
    is decoded in a worker thread, not on the event loop; validation stays FastAPI's."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            return await handler(_OffLoopJSONRequest(request.scope, request.receive))

        return handle


T = TypeVar("T")

_ERROR = {"model": ErrorResponse}
_RETRY = {"Retry-After": {"description": "seconds to wait", "schema": {"type": "integer"}}}
ERRORS: dict[int | str, dict[str, Any]] = {
    400: {**_ERROR, "description": "body is not parsable JSON (e.g. nested too deeply)"},
    401: {**_ERROR, "description": "missing or wrong API key"},
    404: {**_ERROR, "description": "unknown model (`model_not_found`)"},
    408: {**_ERROR, "description": "request body sent too slowly"},
    409: {**_ERROR, "description": "the cache holds another teacher or k"},
    413: {**_ERROR, "description": "body, sequence, text or answer over a limit"},
    422: {**_ERROR, "description": "invalid request or input"},
    429: {**_ERROR, "description": "over the on-demand token budget", "headers": _RETRY},
    503: {**_ERROR, "description": "engine unavailable or deadline passed", "headers": _RETRY},
}


class TokenText:
    """Token id -> the text of that token alone, memoised (vLLM's ``decoded_token``, SGLang's
    logprob text); ``None`` without a tokenizer."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.memo: dict[int, str | None] = {}

    def __call__(self, tid: int) -> str | None:
        if tid not in self.memo:
            tok = self.tokenizer
            self.memo[tid] = None if tok is None else (tok.decode([tid]) or "")
        return self.memo[tid]


def teacher_of(request: Request, model: str | None) -> str | None:
    """The teacher a request names: its body's ``model``, else its URL's ``/teachers/<name>``
    prefix (``None``: the default teacher)."""
    return model if model is not None else getattr(request.state, "teacher", None)


def public_status(job: JobStatus) -> JobStatus:
    """``job`` as public bodies show it: error texts without server directories."""
    if not job.errors and job.error is None:
        return job
    return job.model_copy(
        update={
            "error": None if job.error is None else public_message(job.error),
            "errors": [public_message(e) for e in job.errors],
        }
    )


async def _disconnected(request: Request) -> None:
    """Return once the client has gone."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def run_for_client(request: Request, work: Coroutine[Any, Any, T], timeout: float) -> T:
    """``await work`` unless the client disconnects (:class:`ClientClosedError`) or ``timeout``
    seconds pass (:class:`DeadlineExceededError`) first; then the work is cancelled."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, gone}, timeout=timeout, return_when="FIRST_COMPLETED")
    except BaseException:  # our own cancellation included: the work must not outlive it
        task.cancel()
        raise
    finally:
        gone.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    if gone in done:
        raise ClientClosedError("the client disconnected; its work was aborted")
    raise DeadlineExceededError(
        f"no answer within the request deadline of {timeout:g} s; the work was aborted"
    )


async def with_teacher(
    request: Request,
    services: Services,
    model: str | None,
    work: Callable[[Teacher], Awaitable[T]],
) -> T:
    """``work(teacher)`` on the teacher the request names, under :func:`run_for_client`."""

    async def use() -> T:
        async with services.teachers.use(teacher_of(request, model)) as teacher:
            return await work(teacher)

    return await run_for_client(request, use(), services.settings.request_timeout_s)

"""Batch jobs: ``POST/GET /v1/jobs``, ``GET/DELETE /v1/jobs/{id}``, ``POST .../{id}/cancel``.

A new job is refused with 429 while queued and running jobs hold more than
``max_pending_job_tokens`` unscored tokens. The job table is read in worker threads (its lock
is held through each fsync'd commit); error texts keep no server paths.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Query, Request
from logitcache.protocol import ErrorResponse, JobCreate, JobList, JobState, JobStatus

from ..errors import OverloadedError
from .deps import OffLoopJSONRoute, ServicesDep, public_status, teacher_of

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], route_class=OffLoopJSONRoute)

_ERROR = {"model": ErrorResponse}
_RETRY = {"Retry-After": {"description": "seconds to wait", "schema": {"type": "integer"}}}
_COMMON: dict[int | str, dict[str, Any]] = {
    400: {**_ERROR, "description": "body is not parsable JSON (e.g. nested too deeply)"},
    401: {**_ERROR, "description": "missing or wrong API key"},
    422: {**_ERROR, "description": "invalid request"},
    503: {**_ERROR, "description": "starting or stopping", "headers": _RETRY},
}
_ONE_JOB: dict[int | str, dict[str, Any]] = {
    **_COMMON,
    404: {**_ERROR, "description": "no such job"},
}
_JOB_LINKS = {
    "GetJob": {"operationId": "jobs-get_job", "parameters": {"job_id": "$response.body#/id"}},
    "CancelJob": {
        "operationId": "jobs-cancel_job",
        "parameters": {"job_id": "$response.body#/id"},
    },
    "GetCache": {
        "operationId": "caches-get_cache",
        "parameters": {"name": "$response.body#/cache"},
    },
}

#: Largest page of ``GET /v1/jobs``.
MAX_PAGE = 1000


@router.post(
    "",
    status_code=201,
    response_model=JobStatus,
    responses={
        **_COMMON,
        201: {"description": "the job, queued", "links": _JOB_LINKS},
        404: {**_ERROR, "description": "unknown model (`model_not_found`)"},
        408: {**_ERROR, "description": "request body sent too slowly"},
        409: {**_ERROR, "description": "the cache holds another teacher or k"},
        413: {**_ERROR, "description": "body or input over a limit"},
        429: {**_ERROR, "description": "too many job tokens pending", "headers": _RETRY},
    },
)
async def create_job(body: JobCreate, request: Request, services: ServicesDep) -> JobStatus:
    """Check the whole input against the teacher ``model`` names (422 listing bad records;
    404 for a teacher not served; nothing written), then queue the job."""
    body.model = teacher_of(request, body.model)
    limit = services.settings.max_pending_job_tokens
    pending = await asyncio.to_thread(services.jobs.store.pending_tokens)
    if pending >= limit:
        raise OverloadedError(
            f"{pending} job tokens are pending, at the limit of {limit}; retry later",
            retry_after=60,
        )
    return public_status(await services.jobs.submit(body))


@router.get("", response_model=JobList, responses=_COMMON)
def list_jobs(
    services: ServicesDep,
    limit: int = Query(100, ge=1, le=MAX_PAGE, description="jobs per page"),
    offset: int = Query(0, ge=0, le=2**62, description="jobs to skip (oldest first)"),
    state: JobState | None = Query(None, description="only jobs in this state"),  # noqa: B008
) -> JobList:
    """Jobs oldest first, one page (``next_offset``: the next page's offset, null at the end)."""
    jobs = services.jobs.list(limit=limit + 1, offset=offset, state=state)
    more = len(jobs) > limit
    page = [public_status(j) for j in jobs[:limit]]
    return JobList(jobs=page, next_offset=offset + limit if more else None)


@router.get("/{job_id}", response_model=JobStatus, responses=_ONE_JOB)
def get_job(job_id: str, services: ServicesDep) -> JobStatus:
    """State, sequences and tokens done/total, throughput (this run), ETA, errors."""
    return public_status(services.jobs.status(job_id))


@router.delete("/{job_id}", response_model=JobStatus, responses=_ONE_JOB)
def cancel_job(job_id: str, services: ServicesDep) -> JobStatus:
    """Cancel: queued jobs at once, running jobs after their in-flight batches."""
    return public_status(services.jobs.cancel(job_id))


@router.post("/{job_id}/cancel", response_model=JobStatus, responses=_ONE_JOB)
def cancel_job_post(job_id: str, services: ServicesDep) -> JobStatus:
    """Same as ``DELETE /v1/jobs/{id}`` (for clients that cannot send DELETE)."""
    return public_status(services.jobs.cancel(job_id))

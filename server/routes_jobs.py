"""Batch jobs: ``POST/GET /v1/jobs``, ``GET/DELETE /v1/jobs/{id}``, ``POST .../{id}/cancel``."""

from __future__ import annotations

from fastapi import APIRouter

from .deps import ServicesDep
from .protocol import ErrorResponse, JobCreate, JobList, JobStatus

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

_ERRORS = {
    401: {"model": ErrorResponse},
    404: {"model": ErrorResponse},
    409: {"model": ErrorResponse},
    413: {"model": ErrorResponse},
    422: {"model": ErrorResponse},
}


@router.post("", status_code=201, response_model=JobStatus, responses=_ERRORS)
async def create_job(body: JobCreate, services: ServicesDep) -> JobStatus:
    """Check the whole input (422 listing bad records; nothing written), then queue the job."""
    return await services.jobs.submit(body)


@router.get("", response_model=JobList, responses=_ERRORS)
async def list_jobs(services: ServicesDep) -> JobList:
    return JobList(jobs=services.jobs.list())


@router.get("/{job_id}", response_model=JobStatus, responses=_ERRORS)
async def get_job(job_id: str, services: ServicesDep) -> JobStatus:
    """State, sequences and tokens done/total, throughput (this run), ETA, errors."""
    return services.jobs.status(job_id)


@router.delete("/{job_id}", response_model=JobStatus, responses=_ERRORS)
async def cancel_job(job_id: str, services: ServicesDep) -> JobStatus:
    """Cancel: queued jobs at once, running jobs after their in-flight batches."""
    return services.jobs.cancel(job_id)


@router.post("/{job_id}/cancel", response_model=JobStatus, responses=_ERRORS)
async def cancel_job_post(job_id: str, services: ServicesDep) -> JobStatus:
    """Same as ``DELETE /v1/jobs/{id}`` (for clients that cannot send DELETE)."""
    return services.jobs.cancel(job_id)

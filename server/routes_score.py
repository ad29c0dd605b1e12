"""``POST /v1/score``: on-demand teacher top-k (JSON, or binary frames by ``Accept``)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from logitcache.cache_format import encode_records

from .deps import ServicesDep
from .protocol import FRAMES_MEDIA_TYPE, ErrorResponse, ScoreRequest, ScoreResponse

router = APIRouter(prefix="/v1", tags=["score"])

_ERRORS = {
    401: {"model": ErrorResponse},
    409: {"model": ErrorResponse},
    413: {"model": ErrorResponse},
    422: {"model": ErrorResponse},
}


def wants_frames(request: Request) -> bool:
    """Whether the ``Accept`` header asks for :data:`FRAMES_MEDIA_TYPE`."""
    return FRAMES_MEDIA_TYPE in request.headers.get("accept", "")


@router.post(
    "/score",
    response_model=ScoreResponse,
    responses={
        **_ERRORS,
        200: {"content": {FRAMES_MEDIA_TYPE: {}}, "description": "JSON, or frames if accepted"},
    },
    summary="Score sequences now",
)
async def score(body: ScoreRequest, request: Request, services: ServicesDep) -> Response:
    """Top-k ids, logprobs and tail mass for every row of every sequence.

    With ``Accept: application/x-logitcache-frames`` the body is one wire frame
    (``logitcache.cache_format.decode_records``), headers ``X-Logitcache-K`` and
    ``X-Logitcache-Stored``; otherwise a :class:`ScoreResponse` JSON body.
    """
    result = await services.scoring.score(body)
    headers = {"X-Logitcache-K": str(result.k), "X-Logitcache-Stored": str(result.stored)}
    if wants_frames(request):
        return Response(
            encode_records(result.records), media_type=FRAMES_MEDIA_TYPE, headers=headers
        )
    payload = {
        "model": services.engine.info.model_id,
        "k": result.k,
        "cache": body.cache,
        "stored": result.stored,
        "sequences": [
            {
                "key": r.key,
                "input_ids": r.input_ids.tolist(),
                "topk_ids": r.topk_ids.tolist(),
                "topk_logprobs": r.topk_logprobs.tolist(),
                "tail_mass": r.tail_or_computed().tolist(),
            }
            for r in result.records
        ],
    }
    return JSONResponse(payload, headers=headers)

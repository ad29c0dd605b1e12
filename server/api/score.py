"""``POST /v1/score``: on-demand teacher top-k (JSON, or binary frames by ``Accept``).

A request runs until its answer is ready, its client disconnects, or ``request_timeout_s``
passes; in the last two cases the scoring task is cancelled, which aborts its sequences in the
engine (no work for clients that are gone), and the answer is ``499`` (unseen) or ``503
deadline_exceeded`` with ``Retry-After``. The JSON body is streamed, built one sequence at a time
in a worker thread; frames are encoded in a worker thread.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse
from logitcache.cache_format import SequenceRecord, encode_records
from logitcache.protocol import FRAMES_MEDIA_TYPE, ScoreRequest, ScoreResponse

from ..serving.cache_hits import Served
from ..serving.teachers import Teacher
from .deps import ERRORS, OffLoopJSONRoute, ServicesDep, with_teacher

router = APIRouter(prefix="/v1", tags=["score"], route_class=OffLoopJSONRoute)

_SCORE_HEADERS = {
    "X-Logitcache-K": {"description": "the k used", "schema": {"type": "string"}},
    "X-Logitcache-Stored": {"description": "sequences newly stored", "schema": {"type": "string"}},
    "X-Logitcache-Hits": {
        "description": "with a cache: sequences read from it",
        "schema": {"type": "string"},
    },
}


_F32_MIN = float(np.finfo(np.float32).min)

#: JSON answers of at most this many top-k values (rows x k; about 30 bytes each) are built in
#: one piece; larger ones are streamed one sequence at a time.
WHOLE_BODY_VALUES = 16384


def json_chunks(
    model: str,
    k: int,
    cache: str | None,
    stored: int,
    recs: list[SequenceRecord],
    hits: list[bool] | None = None,
) -> Iterator[bytes]:
    """The :class:`ScoreResponse` JSON in pieces, one sequence at a time (``-inf`` as float32's
    lowest value), so no piece holds the GIL for long."""
    head: dict[str, Any] = {"model": model, "k": k, "cache": cache, "stored": stored}
    if hits is not None:
        head["hits"] = sum(hits)
    yield json.dumps(head, separators=(",", ":"))[:-1].encode() + b',"sequences":['
    for i, r in enumerate(recs):
        seq = {
            "key": r.key,
            "input_ids": r.input_ids.tolist(),
            "topk_ids": r.topk_ids.tolist(),
            "topk_logprobs": np.maximum(r.topk_logprobs, _F32_MIN).tolist(),
            "tail_mass": np.nan_to_num(r.tail_or_computed(), nan=0.0).tolist(),
        }
        if r.entropy is not None:
            seq["entropy"] = r.entropy.astype(np.float64).tolist()
        if r.actual_logprob is not None:
            seq["actual_logprob"] = np.maximum(r.actual_logprob, _F32_MIN).tolist()
        if hits is not None:
            seq["cached"] = hits[i]
        text = json.dumps(seq, separators=(",", ":"), allow_nan=False).encode()
        yield (b"," + text) if i else text
    yield b"]}"


async def _answer(teacher: Teacher, body: ScoreRequest, frames: bool) -> tuple[str, Served]:
    """The teacher's name and its answer to ``body``."""
    assert teacher.serving is not None
    return teacher.name, await teacher.serving.answer(body, frames=frames)


@router.post(
    "/score",
    response_model=ScoreResponse,
    responses={
        **ERRORS,
        200: {
            "content": {FRAMES_MEDIA_TYPE: {}},
            "description": "JSON, or frames if accepted",
            "headers": _SCORE_HEADERS,
            "links": {
                "GetCache": {
                    "operationId": "caches-get_cache",
                    "parameters": {"name": "$request.body#/cache"},
                }
            },
        },
    },
    summary="Score sequences now",
)
async def score(body: ScoreRequest, request: Request, services: ServicesDep) -> Response:
    """Top-k ids, logprobs and tail mass for every row of every sequence: a
    :class:`ScoreResponse` JSON body, or with ``Accept: application/x-logitcache-frames`` one
    wire frame."""
    frames = FRAMES_MEDIA_TYPE in request.headers.get("accept", "")
    model, result = await with_teacher(
        request, services, body.model, lambda t: _answer(t, body, frames)
    )
    headers = {"X-Logitcache-K": str(result.k), "X-Logitcache-Stored": str(result.stored)}
    if result.hits is not None:
        headers["X-Logitcache-Hits"] = str(sum(result.hits))
    if frames:
        data = await asyncio.to_thread(encode_records, result.records)
        return Response(data, media_type=FRAMES_MEDIA_TYPE, headers=headers)
    chunks = json_chunks(
        model,
        result.k,
        body.cache,
        result.stored,
        result.records,
        result.hits,
    )
    if sum(len(r.topk_ids) for r in result.records) * result.k <= WHOLE_BODY_VALUES:
        # a small answer: built in one worker-thread call and sent at once (streaming it costs
        # one thread hop and one event-loop turn per sequence, which under many clients is
        # what kept /health waiting)
        data = await asyncio.to_thread(b"".join, chunks)
        return Response(data, media_type="application/json", headers=headers)
    # a sync iterator: Starlette pulls each piece in a worker thread
    return StreamingResponse(chunks, media_type="application/json", headers=headers)

"""vLLM-compatible ``POST /inference/v1/generate`` for logprobs at caller-chosen token ids.

Row ``i`` of the answer's base64 ``.npy`` matrix holds the logprobs of its candidates as
predictions of token ``s + i + 1`` (``-1`` pads a row). The sequence is served through a cache
(default :data:`DEFAULT_CACHE`); the matrix comes from the cached rows when every candidate is in
them, else exactly from the engine (:mod:`~..serving.chosen`). The contract: ``server/API.md``.
"""

from __future__ import annotations

import asyncio
import base64
import io
import time
import uuid

import numpy as np
from fastapi import APIRouter, Request
from logitcache.cache_format import Manifest
from logitcache.protocol import (
    MAX_K,
    VllmGenerateChoice,
    VllmGenerateRequest,
    VllmGenerateResponse,
    VllmUsage,
)

from ..errors import InvalidInputError
from ..inputs.records import RawRecord, Sequence
from ..serving.chosen import at_chosen_ids, check_asked, one_call_ids
from ..serving.teachers import Teacher
from .deps import ERRORS, ServicesDep, with_teacher

router = APIRouter(tags=["vllm"])

#: The cache ``/inference/v1/generate`` reads through when the request names none.
DEFAULT_CACHE = "vllm-generate"


def npy_base64(matrix: np.ndarray) -> str:
    """``matrix`` as vLLM sends it: its ``.npy`` bytes (no pickle), base64-encoded."""
    buf = io.BytesIO()
    np.save(buf, matrix, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def asked_matrix(req: VllmGenerateRequest, vocab_size: int) -> tuple[np.ndarray, int]:
    """The candidates as a ``[rows, width]`` matrix padded with ``-1`` and the first row
    (``prompt_logprob_start``); 422 for what vLLM refuses or this route does not serve."""
    sp = req.sampling_params
    if req.stream:
        raise InvalidInputError("prompt_logprob_token_ids are not available when stream=true.")
    if sp.max_tokens is not None and sp.max_tokens not in (0, 1):
        raise InvalidInputError(
            "sampling_params.max_tokens must be 0 or 1: this teacher scores, it does not generate"
        )
    if sp.prompt_logprobs is not None:
        raise InvalidInputError(
            "sampling_params.prompt_logprobs is not served here: use /v1/completions"
        )
    rows = sp.prompt_logprob_token_ids
    if rows is None:
        if sp.prompt_logprob_start is not None:
            raise InvalidInputError("prompt_logprob_start requires prompt_logprob_token_ids.")
        raise InvalidInputError("sampling_params.prompt_logprob_token_ids is required")
    width = max(map(len, rows), default=0)
    if width == 0:
        raise InvalidInputError(
            "prompt_logprob_token_ids must be a non-empty integer array of shape "
            "[num_rows, num_ids]."
        )
    if width > MAX_K:
        raise InvalidInputError(f"prompt_logprob_token_ids: rows of at most {MAX_K} ids")
    start = sp.prompt_logprob_start or 0
    expected = len(req.token_ids) - 1 - start
    if len(rows) != expected:
        raise InvalidInputError(
            f"prompt_logprob_token_ids has {len(rows)} rows, but the prompt has {expected} "
            "scored rows (prompt_len - 1 - prompt_logprob_start)."
        )
    asked = np.full((len(rows), width), -1, dtype=np.int64)
    for i, row in enumerate(rows):
        asked[i, : len(row)] = row
    check_asked(asked, start, len(req.token_ids), vocab_size, "prompt_logprob_token_ids")
    return asked, start


async def generate(teacher: Teacher, req: VllmGenerateRequest) -> VllmGenerateResponse:
    """Check, read through ``teacher``'s cache, answer."""
    scoring, serving, engine = teacher.scoring, teacher.serving, teacher.engine
    assert scoring is not None and serving is not None and engine is not None
    info = engine.info
    asked, start = asked_matrix(req, info.vocab_size)
    t = scoring.check_temperature(req.sampling_params.temperature)
    cache = teacher.route_cache(req.cache, DEFAULT_CACHE, t)
    raw = RawRecord(where="token_ids", id=None, text=None, input_ids=req.token_ids)

    def checked() -> tuple[list[Sequence], Manifest]:
        """The checked sequence and the cache's manifest, blocking (one worker thread hop)."""
        seqs = scoring.checked([raw], "token_ids")
        scoring.check_answer_size(seqs, asked.shape[1], "npy")
        return seqs, scoring.route_manifest(cache, t)

    seqs, manifest = await asyncio.to_thread(checked)
    served = await serving.serve(
        cache, seqs, manifest.k, manifest, ids=one_call_ids([asked]), answer_first=True
    )
    got = await at_chosen_ids(
        scoring,
        seqs,
        served.records,
        [asked],
        [start],
        manifest.temperature,
        served.at_ids,
        approximate=req.approximate,
    )
    spread = got.approximated[0] if got.approximated else None
    n = len(req.token_ids)
    return VllmGenerateResponse(
        request_id=f"generate-tokens-{req.request_id or uuid.uuid4().hex}",
        model=teacher.name,
        created=int(time.time()),
        usage=VllmUsage(prompt_tokens=n, completion_tokens=0, total_tokens=n),
        prompt_token_id_logprobs=await asyncio.to_thread(npy_base64, got.logprobs[0]),
        prompt_token_ids=list(req.token_ids) if req.return_token_ids else None,
        output_mode=req.output_mode,
        choices=[
            VllmGenerateChoice(
                index=0,
                text="" if req.output_mode == "text" else None,
                token_ids=[],
                finish_reason="length",
            )
        ],
        cached=bool(served.hits and served.hits[0]),
        exact=got.exact[0],
        approximated=None if spread is None else await asyncio.to_thread(npy_base64, spread),
    )


@router.post(
    "/inference/v1/generate",
    response_model=VllmGenerateResponse,
    responses=ERRORS,
    summary="vLLM-compatible logprobs at chosen token ids (cached)",
)
async def generate_route(
    body: VllmGenerateRequest, request: Request, services: ServicesDep
) -> VllmGenerateResponse:
    """vLLM's ``/inference/v1/generate`` with ``prompt_logprob_token_ids`` (module doc)."""
    return await with_teacher(request, services, body.model, lambda t: generate(t, body))

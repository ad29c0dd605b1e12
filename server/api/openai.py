"""vLLM-compatible routes: ``POST /v1/completions`` (prompt logprobs) and ``GET /v1/models``.

vLLM's ``CompletionRequest`` in, its ``CompletionResponse`` out, every prompt served through a
cache (default :data:`DEFAULT_CACHE`). A row lists the actual prompt token first, then the top
``prompt_logprobs`` ids; outside the row's top ``K`` that token's rank is ``K + 1``, a lower
bound (``choices[i].rank_lower_bound``). The contract: ``server/API.md``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence as Seq
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from logitcache.cache_format import SequenceRecord
from logitcache.protocol import Temperature, TokenId
from pydantic import BaseModel, ConfigDict, Field

from ..errors import InvalidInputError, public_name
from ..inputs.records import Sequence
from ..serving.cache_hits import Served
from ..serving.chosen import at_chosen_ids
from ..serving.scoring import ScoringService, raws
from ..serving.teachers import Teacher
from .deps import ERRORS, ServicesDep, TokenText, teacher_of, with_teacher

router = APIRouter(prefix="/v1", tags=["openai"])

#: The cache ``/v1/completions`` serves from when the request names none.
DEFAULT_CACHE = "openai-completions"

#: vLLM's stand-in for a ``-inf`` prompt logprob (``clamp_prompt_logprobs``).
NEG_INF_LOGPROB = -9999.0

#: Token ids as ``/v1/score`` takes them: JSON integers only (not ``2.0``, ``"2"``, ``true``).
TokenIds = list[TokenId]
#: A JSON integer (strict, as everywhere in the API).
Int = Annotated[int, Field(strict=True)]


class CompletionRequest(BaseModel):
    """The fields of vLLM's ``CompletionRequest`` this route reads (others are ignored);
    integers are strict."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | TokenIds | list[str] | list[TokenIds]
    prompt_logprobs: Int | None = None
    max_tokens: Int | None = 16
    echo: bool | None = False
    logprobs: Int | None = None
    n: Int = 1
    stream: bool | None = False
    return_token_ids: bool | None = False
    temperature: Temperature | None = Field(
        None, description="the teacher's temperature: logprobs of log_softmax(logits / T)"
    )
    cache: str | None = Field(None, description="logitcache extension: the cache to serve from")
    approximate: bool = Field(
        False,
        description="logitcache extension: for a cache without actual-token logprobs, an actual "
        "token outside its row's top-k gets the tail mass spread uniformly (listed in the "
        "choice's `approximated`) instead of being scored",
    )


def _check(req: CompletionRequest, scoring: ScoringService) -> int:
    """The requested k, or :class:`InvalidInputError` for what this route does not do."""
    k = req.prompt_logprobs
    try:
        checked = scoring.check_k(k)
    except InvalidInputError:
        checked = None
    if checked is None:
        raise InvalidInputError(
            f"prompt_logprobs must be an integer in [1, {scoring.engine.info.max_k}] (this "
            f"teacher serves top-k prompt logprobs), got {k}"
        )
    if req.max_tokens not in (0, 1, None):
        raise InvalidInputError(
            "max_tokens must be 0 or 1: this teacher scores, it does not generate"
        )
    if req.logprobs is not None:
        raise InvalidInputError(
            "logprobs (generated-token logprobs) is not served: use prompt_logprobs"
        )
    if req.stream:
        raise InvalidInputError("stream is not supported with prompt_logprobs")
    if req.n != 1:
        raise InvalidInputError("n must be 1")
    return checked


def _prompts(req: CompletionRequest) -> list[str | list[int]]:
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise InvalidInputError("prompt holds no sequence")
    if isinstance(p[0], int):
        return [list(p)]  # type: ignore[arg-type]
    return list(p)  # type: ignore[arg-type]


def _entry(lp: float, rank: int, text: str | None) -> dict[str, Any]:
    """One vLLM ``Logprob`` (``-inf`` as vLLM clamps it)."""
    clamped = lp if lp > NEG_INF_LOGPROB else NEG_INF_LOGPROB
    return {"logprob": clamped, "rank": rank, "decoded_token": text}


def prompt_logprobs(
    rec: SequenceRecord, k: int, decode: TokenText, actual: np.ndarray
) -> list[dict[str, dict] | None]:
    """vLLM's ``prompt_logprobs`` at ``k`` of one record: ``None``, then per row the actual next
    token (logprob ``actual``; rank in the row, else ``K + 1``) and the top ``k``."""
    out: list[dict[str, dict] | None] = [None]
    rows = zip(rec.topk_ids.tolist(), rec.topk_logprobs.tolist(), strict=True)
    for tok, act, (ids, lps) in zip(rec.labels.tolist(), actual.tolist(), rows, strict=True):
        rank = ids.index(tok) + 1 if tok in ids else len(ids) + 1
        row = {str(tok): _entry(act, rank, decode(tok))}
        for r, (t, lp) in enumerate(zip(ids[:k], lps[:k], strict=True)):
            row[str(t)] = _entry(lp, r + 1, decode(t))
        out.append(row)
    return out


def rank_lower_bound(rec: SequenceRecord) -> list[int]:
    """The positions (``t >= 1``) whose actual token is outside the record's top-``K`` row."""
    labels = rec.labels.astype(np.int64)[:, None]
    return (np.flatnonzero((rec.topk_ids != labels).all(axis=1)) + 1).tolist()


async def actual_tokens(
    scoring: ScoringService,
    seqs: Seq[Sequence],
    records: Seq[SequenceRecord],
    temperature: float,
    approximate: bool,
) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """Per record its rows' logprobs of their actual next tokens (its ``actual_logprob``, else
    :func:`~..serving.chosen.at_chosen_ids`) and the mask of those spread from the tail."""
    todo = [i for i, r in enumerate(records) if r.actual_logprob is None]
    out: dict[int, tuple[np.ndarray, np.ndarray | None]] = {}
    if todo:
        got = await at_chosen_ids(
            scoring,
            [seqs[i] for i in todo],
            [records[i] for i in todo],
            [records[i].labels.astype(np.int64)[:, None] for i in todo],
            [0] * len(todo),
            temperature,
            approximate=approximate,
        )
        for j, i in enumerate(todo):
            spread = got.approximated[j] if got.approximated else None
            out[i] = (got.logprobs[j][:, 0], None if spread is None else spread[:, 0])
    return [
        out[i] if i in out else (np.asarray(r.actual_logprob, np.float32), None)
        for i, r in enumerate(records)
    ]


def _body(
    teacher: Teacher,
    req: CompletionRequest,
    prompts: Seq[str | list[int]],
    served: Served,
    k: int,
    actual: list[tuple[np.ndarray, np.ndarray | None]],
) -> dict[str, Any]:
    tokenizer = getattr(teacher.engine, "tokenizer", None)
    decode = TokenText(tokenizer)
    choices = []
    for i, (p, rec) in enumerate(zip(prompts, served.records, strict=True)):
        act, spread = actual[i]
        text = ""
        if req.echo:
            text = p if isinstance(p, str) else (tokenizer.decode(p) if tokenizer else "")
        choices.append(
            {
                "index": i,
                "text": text,
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "prompt_logprobs": prompt_logprobs(rec, k, decode, act),
                "prompt_token_ids": rec.input_ids.tolist() if req.return_token_ids else None,
                "cached": served.hits is not None and served.hits[i],
                "rank_lower_bound": rank_lower_bound(rec),
            }
        )
        if req.approximate:  # the positions whose actual token was spread from the tail
            rows = [] if spread is None else np.flatnonzero(spread).tolist()
            choices[-1]["approximated"] = [r + 1 for r in rows]
    tokens = sum(int(r.input_ids.shape[0]) for r in served.records)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": teacher.name,
        "choices": choices,
        "usage": {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens},
    }


async def complete(teacher: Teacher, req: CompletionRequest) -> dict[str, Any]:
    """Check, serve through ``teacher``'s cache, build the vLLM answer."""
    scoring, serving = teacher.scoring, teacher.serving
    assert scoring is not None and serving is not None
    k = _check(req, scoring)
    t = scoring.check_temperature(req.temperature)
    cache = teacher.route_cache(req.cache, DEFAULT_CACHE, t)
    prompts = _prompts(req)
    seqs = await asyncio.to_thread(scoring.checked, raws("prompt", prompts), "prompts")
    scoring.check_answer_size(seqs, k, "completions")
    manifest = await asyncio.to_thread(scoring.route_manifest, cache, t)
    if k <= manifest.k:  # whole cached rows: the actual token's rank within them
        served = await serving.serve(cache, seqs, manifest.k, manifest, answer_first=True)
    else:  # the cache cannot hold this k: scored, not stored
        served = await serving.above(seqs, k, manifest.temperature)
    actual = await actual_tokens(
        scoring, seqs, served.records, manifest.temperature, req.approximate
    )
    return await asyncio.to_thread(_body, teacher, req, prompts, served, k, actual)


@router.post(
    "/completions",
    responses=ERRORS,
    summary="vLLM-compatible prompt logprobs (served from the cache)",
)
async def completions(
    body: CompletionRequest, request: Request, services: ServicesDep
) -> JSONResponse:
    """vLLM's ``/v1/completions`` for ``prompt_logprobs``, ``max_tokens`` 0 or 1 (module doc)."""
    answer = await with_teacher(request, services, body.model, lambda t: complete(t, body))
    return JSONResponse(answer)


@router.get(
    "/models",
    responses={401: ERRORS[401]},
    summary="vLLM/OpenAI model list (the teachers)",
)
async def models(request: Request, services: ServicesDep) -> dict[str, Any]:
    """One entry per teacher with its name as ``id`` (under ``/teachers/<name>/``: that one)."""
    created = int(time.time())
    data = []
    prefixed = teacher_of(request, None)
    pool = services.teachers
    listed = pool.teachers.values() if prefixed is None else [pool.resolve(prefixed)]
    for teacher in listed:
        scoring = teacher.scoring
        data.append(
            {
                "id": teacher.name,
                "object": "model",
                "created": created,
                "owned_by": "logitcache",
                "root": public_name(teacher.settings.model) or teacher.name,
                "parent": None,
                "max_model_len": (
                    teacher.settings.max_seq_len if scoring is None else scoring.limits.max_seq_len
                ),
            }
        )
    return {"object": "list", "data": data}

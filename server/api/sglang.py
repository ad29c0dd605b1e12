"""SGLang-compatible ``POST /generate`` for teacher logprobs (on-policy distillation clients).

The scoring subset of SGLang's ``GenerateReqInput`` (``input_ids``, ``return_logprob``,
``logprob_start_len``, ``top_logprobs_num``, ``token_ids_logprob``, ``sampling_params`` with
``max_new_tokens: 0``) answered in SGLang's shape, one object per sequence (a list for a batch).
Every sequence is served through a cache as ``/v1/completions`` is (default
:data:`DEFAULT_CACHE`, one per temperature); the actual token's logprob comes from its top-k row
or the cache's ``actual_logprob`` array, and asked ids from the rows or exactly from the engine
(:mod:`~..serving.chosen`). The contract: ``server/API.md``; request and ``meta_info`` are
typed in ``logitcache.protocol.sglang``.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from logitcache.cache_format import SequenceRecord
from logitcache.protocol import SglangGenerateRequest

from ..errors import InvalidInputError
from ..inputs.records import RawRecord
from ..serving.caches import check_name
from ..serving.chosen import at_chosen_ids, check_asked, one_call_ids
from ..serving.teachers import Teacher
from .deps import ERRORS, ServicesDep, TokenText, with_teacher

router = APIRouter(tags=["sglang"])

#: The cache ``/generate`` serves from when the request names none.
DEFAULT_CACHE = "sglang-generate"


def _one(value: Any, name: str) -> Any:
    """A per-request field that SGLang also takes per sequence: one value for the batch only."""
    if isinstance(value, list):
        if not value or any(v != value[0] for v in value):
            raise InvalidInputError(f"{name} must be the same for every sequence")
        return value[0]
    return value


def _check(req: SglangGenerateRequest) -> tuple[list[list[int]], bool, Any]:
    """The sequences, whether the request was a batch, and its temperature (unchecked; ``None``
    when absent); 422 for what is not served."""
    if req.text is not None or req.input_ids is None:
        raise InvalidInputError("input_ids is required (text prompts are not served)")
    if req.stream:
        raise InvalidInputError("stream is not supported")
    if not _one(req.return_logprob, "return_logprob"):
        raise InvalidInputError("return_logprob must be true: this teacher only scores")
    params = _one(req.sampling_params or {}, "sampling_params")
    if params.get("max_new_tokens") != 0:
        raise InvalidInputError(
            "sampling_params.max_new_tokens must be 0: this teacher scores, it does not generate"
        )
    temperature = params.get("temperature")
    ids = req.input_ids
    if not ids:
        raise InvalidInputError("input_ids holds no sequence")
    if isinstance(ids[0], int):
        return [list(ids)], False, temperature
    return [list(s) for s in ids], True, temperature


def _chosen(ids: list[Any] | None, i: int, n: int, batch: bool) -> list[int] | None:
    """Sequence ``i``'s ``token_ids_logprob``: one list for all, or one list per sequence (of
    ``n``)."""
    if ids is None or not ids or isinstance(ids[0], int):
        return ids
    if not batch or len(ids) != n:
        raise InvalidInputError("token_ids_logprob: one list of ids, or one per sequence")
    return list(ids[i])


def _first(start: int, n: int) -> int:
    """The first answered position of an ``n``-token sequence (``-1``: the last one)."""
    first = n - 1 if start < 0 else start
    if first >= n:
        raise InvalidInputError(f"logprob_start_len {start} is not below the length {n}")
    return first


def _asked(chosen: list[int], first: int, n: int, vocab_size: int, where: str) -> np.ndarray:
    """The ``[rows, len(chosen)]`` ids asked at rows ``max(first, 1) - 1 .. n - 2`` (position
    ``t`` is predicted by row ``t - 1``; position 0 by none)."""
    row0 = max(first, 1) - 1
    asked = np.tile(np.asarray(chosen, dtype=np.int64), (n - 1 - row0, 1))
    check_asked(asked, row0, n, vocab_size, where)
    return asked


def _json_lp(lp: float | None) -> float | None:
    """A logprob as SGLang's JSON carries it: ``-inf`` (a token the teacher rules out) becomes
    ``null``, as SGLang's orjson answers write it."""
    return lp if lp is None or math.isfinite(lp) else None


def _meta(
    rec: SequenceRecord,
    start: int,
    top: int,
    at: tuple[list[int], np.ndarray, bool] | None,
    decode: Any,
    cached: bool,
    mask: np.ndarray | None = None,
) -> dict[str, Any]:
    """SGLang's ``meta_info`` of one scored sequence; ``at``: the ``token_ids_logprob`` ids,
    their logprobs at rows ``max(start, 1) - 1 ..`` and whether these came from the engine;
    ``mask`` (``approximate``): which of them were spread from the tail."""
    ids = rec.input_ids.tolist()
    rows_ids = rec.topk_ids.tolist()
    rows_lps = rec.topk_logprobs.tolist()
    actual = None if rec.actual_logprob is None else rec.actual_logprob.tolist()
    at_lps = at[1].tolist() if at is not None else []
    row0 = max(start, 1) - 1
    token: list[list[Any]] = []
    tops: list[list[list[Any]] | None] = []
    at_ids: list[list[list[Any]] | None] = []
    spread: list[list[int] | None] = []
    for t in range(start, len(ids)):
        x = ids[t]
        if t == 0:
            token.append([None, x, decode(x)])
            tops.append(None)
            at_ids.append(None)
            spread.append(None)
            continue
        row = dict(zip(rows_ids[t - 1], rows_lps[t - 1], strict=True))
        if at is not None:
            at_ids.append(
                [
                    [_json_lp(lp), i, decode(i)]
                    for i, lp in zip(at[0], at_lps[t - 1 - row0], strict=True)
                ]
            )
            if mask is not None:
                spread.append([i for i, m in zip(at[0], mask[t - 1 - row0], strict=True) if m])
        lp = row.get(x, None if actual is None else actual[t - 1])
        token.append([_json_lp(lp), x, decode(x)])
        tops.append(
            [
                [_json_lp(lp), tid, decode(tid)]
                for tid, lp in zip(rows_ids[t - 1][:top], rows_lps[t - 1][:top], strict=True)
            ]
            if top
            else None
        )
    chosen = {"input_token_ids_logprobs": at_ids, "exact_token_ids": at[2]} if at else {}
    if at is not None and mask is not None:
        chosen["approximated_token_ids"] = spread
    return {
        "id": uuid.uuid4().hex,
        "finish_reason": {"type": "length", "length": 0},
        "prompt_tokens": len(ids),
        "completion_tokens": 0,
        "cached_tokens": len(ids) if cached else 0,
        "input_token_logprobs": token,
        "input_top_logprobs": tops,
        **chosen,
        "output_token_logprobs": [],
        "output_top_logprobs": [],
        "cached": cached,
    }


async def generate(teacher: Teacher, req: SglangGenerateRequest) -> dict[str, Any] | list[Any]:
    """Check, serve through the cache of ``teacher`` (the one ``model`` names: an extension,
    SGLang serves one model) and build SGLang's answer (every check before any engine work or
    write)."""
    scoring, serving, engine = teacher.scoring, teacher.serving, teacher.engine
    assert scoring is not None and serving is not None and engine is not None
    seqs_in, batch, asked_t = _check(req)
    top = _one(req.top_logprobs_num, "top_logprobs_num")
    start = _one(req.logprob_start_len, "logprob_start_len")
    top = scoring.check_k(top or None) or 0
    t = scoring.check_temperature(asked_t)
    info = engine.info
    cache = check_name(req.cache or teacher.default_cache(DEFAULT_CACHE, t))
    raws = [
        RawRecord(where=f"input_ids[{i}]", id=None, text=None, input_ids=s)
        for i, s in enumerate(seqs_in)
    ]
    seqs = await asyncio.to_thread(scoring.checked, raws, len(raws), "input_ids")
    firsts = [_first(start, s.length) for s in seqs]
    chosen = [_chosen(req.token_ids_logprob, i, len(seqs), batch) for i in range(len(seqs))]
    asks = [
        None if c is None else _asked(c, f, s.length, info.vocab_size, "token_ids_logprob")
        for c, f, s in zip(chosen, firsts, seqs, strict=True)
    ]
    width = max((len(c) for c in chosen if c is not None), default=0)
    scoring.check_answer_size(seqs, max(top, 1) + width, "generate")
    manifest = await asyncio.to_thread(scoring.route_manifest, cache, t)
    todo = [i for i, a in enumerate(asks) if a is not None]
    asked = [a for a in asks if a is not None]
    if top <= manifest.k:  # whole cached rows: the actual token is found in any of its k
        ids = one_call_ids(asked) if len(todo) == len(seqs) else None  # misses: one engine call
        served = await serving.serve(cache, seqs, manifest.k, manifest, ids=ids, answer_first=True)
    else:  # the cache cannot hold this k: scored, not stored
        served = await serving.above(seqs, top, manifest.temperature)
    at: list[tuple[list[int], np.ndarray, bool] | None] = [None] * len(seqs)
    masks: list[np.ndarray | None] = [None] * len(seqs)
    if todo:
        got = await at_chosen_ids(
            scoring,
            [seqs[i] for i in todo],
            [served.records[i] for i in todo],
            asked,
            [max(firsts[i], 1) - 1 for i in todo],
            manifest.temperature,
            {j: served.at_ids[i] for j, i in enumerate(todo) if i in served.at_ids},
            approximate=req.approximate,
        )
        for j, i in enumerate(todo):
            at[i] = (chosen[i] or [], got.logprobs[j], got.exact[j])
            masks[i] = got.approximated[j] if got.approximated else None
    decode = TokenText(getattr(engine, "tokenizer", None) if req.return_text_in_logprobs else None)
    out = []
    for i, rec in enumerate(served.records):
        cached = served.hits is not None and served.hits[i]
        meta = _meta(rec, firsts[i], top, at[i], decode, cached, masks[i])
        out.append({"text": "", "output_ids": [], "meta_info": meta})
    return out if batch else out[0]


@router.post("/generate", responses=ERRORS, summary="SGLang-compatible input logprobs (cached)")
async def generate_route(
    body: SglangGenerateRequest, request: Request, services: ServicesDep
) -> JSONResponse:
    """SGLang's ``/generate`` with ``return_logprob`` and ``max_new_tokens: 0`` (module doc)."""
    answer = await with_teacher(request, services, body.model, lambda t: generate(t, body))
    return JSONResponse(answer)

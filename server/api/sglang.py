"""SGLang-compatible ``POST /generate`` for teacher logprobs (on-policy distillation clients).

The scoring subset of SGLang's ``GenerateReqInput`` (``max_new_tokens: 0``) answered in SGLang's
shape, one object per sequence (a list for a batch), every sequence served through a cache
(default :data:`DEFAULT_CACHE`); asked ids come from the rows or exactly from the engine
(:mod:`~..serving.chosen`). The contract: ``server/API.md``; types: ``logitcache.protocol.sglang``.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from itertools import chain, repeat
from json.encoder import encode_basestring
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response
from logitcache.cache_format import Manifest, SequenceRecord
from logitcache.protocol import SglangGenerateRequest

from ..errors import InvalidInputError
from ..inputs.records import Sequence
from ..serving.chosen import at_chosen_ids, check_asked, one_call_ids
from ..serving.scoring import raws
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


def _json(value: Any) -> str:
    """``value`` as the answer's JSON writes it (Starlette's ``JSONResponse``: compact, UTF-8
    text as it is, no NaN or infinity)."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _lp_texts(values: np.ndarray) -> list[str]:
    """Logprobs as SGLang's JSON carries them: Python's ``repr`` of each, ``null`` for a
    non-finite one."""
    wide = np.asarray(values, dtype=np.float64)
    out = list(map(float.__repr__, wide.ravel().tolist()))
    for i in np.flatnonzero(~np.isfinite(wide.ravel())).tolist():
        out[i] = "null"
    return out


class _Entries:
    """``[logprob, token_id, text]`` entries as JSON text; the ``,id,text]`` tail of each token
    id is written once per answer (``decode``: id -> text or ``None``)."""

    def __init__(self, decode: Any) -> None:
        self.decode = decode
        self.tails: dict[int, str] = {}

    def _tails(self, ids: list[int]) -> list[str]:
        memo = self.tails
        for tid in set(ids).difference(memo):
            text = self.decode(tid)
            memo[tid] = f",{tid},{'null' if text is None else encode_basestring(text)}]"
        return list(map(memo.__getitem__, ids))

    def flat(self, lps: list[str], ids: list[int]) -> str:
        """The entries of logprobs ``lps`` (JSON texts) at ``ids``, comma-separated."""
        seps = [","] * len(ids)
        seps[-1:] = [""]
        return "".join(chain.from_iterable(zip(repeat("["), lps, self._tails(ids), seps)))

    def rows(self, lps: list[str], ids: list[int], count: int) -> str:
        """``count`` comma-separated JSON lists of ``width = len(ids) // count`` entries: row
        ``r`` of logprobs ``lps[r * width:(r + 1) * width]`` at those of ``ids``."""
        if not ids:
            return ",".join(["[]"] * count)
        width = len(ids) // count
        seps = ([","] * (width - 1) + ["],["]) * count
        seps[-1] = "]"
        pieces = chain.from_iterable(zip(repeat("["), lps, self._tails(ids), seps))
        return "[" + "".join(pieces)


def _token_lps(rec: SequenceRecord) -> np.ndarray:
    """The logprob of each next token (rows ``0 .. L-2``): its entry in the row's top-k (the
    last one holding it), else the cache's ``actual_logprob``, else NaN (``null``: unknown)."""
    nxt = rec.input_ids[1:, None]
    eq = rec.topk_ids[:, ::-1] == nxt
    col = rec.topk_ids.shape[1] - 1 - eq.argmax(axis=1)
    rows = np.arange(len(col))
    found = rec.topk_logprobs[rows, col].astype(np.float64)
    other = (
        np.full(len(col), np.nan)
        if rec.actual_logprob is None
        else rec.actual_logprob.astype(np.float64)
    )
    return np.where(eq.any(axis=1), found, other)


def _meta_json(
    rec: SequenceRecord,
    start: int,
    top: int,
    at: tuple[list[int], np.ndarray, bool] | None,
    decode: Any,
    cached: bool,
    mask: np.ndarray | None,
    rid: str,
) -> str:
    """SGLang's ``meta_info`` of one scored sequence as JSON text (``at``: the asked ids, their
    logprobs and whether exact; ``mask``: which were spread from the tail)."""
    n = len(rec.input_ids)
    ids = rec.input_ids.tolist()
    entries = _Entries(decode)
    first = max(start, 1)  # positions from here have a row (position 0 has none)
    none = "null," if start == 0 else ""
    lps = (["null"] if start == 0 else []) + _lp_texts(_token_lps(rec)[first - 1 :])
    tops = "[" + ",".join(["null"] * (n - start)) + "]"
    if top:
        topk = rec.topk_ids[first - 1 :, :top]
        topk_lps = _lp_texts(rec.topk_logprobs[first - 1 :, :top])
        rows = entries.rows(topk_lps, topk.ravel().tolist(), len(topk))
        tops = "[" + (none + rows).rstrip(",") + "]"
    parts = [
        f'"id":{_json(rid)},"finish_reason":{{"type":"length","length":0}}',
        f'"prompt_tokens":{n},"completion_tokens":0,"cached_tokens":{n if cached else 0}',
        '"input_token_logprobs":[' + entries.flat(lps, ids[start:]) + "]",
        '"input_top_logprobs":' + tops,
    ]
    if at is not None:
        chosen, values, exact = at
        lists = entries.rows(_lp_texts(values), chosen * len(values), len(values))
        parts.append('"input_token_ids_logprobs":[' + (none + lists).rstrip(",") + "]")
        parts.append(f'"exact_token_ids":{_json(exact)}')
        if mask is not None:
            spread = [[i for i, m in zip(chosen, r, strict=True) if m] for r in mask.tolist()]
            parts.append(
                f'"approximated_token_ids":{_json(([None] if start == 0 else []) + spread)}'
            )
    parts.append(f'"output_token_logprobs":[],"output_top_logprobs":[],"cached":{_json(cached)}')
    return "{" + ",".join(parts) + "}"


async def generate(teacher: Teacher, req: SglangGenerateRequest) -> bytes:
    """Check, serve through ``teacher``'s cache and build SGLang's answer as its JSON body."""
    scoring, serving, engine = teacher.scoring, teacher.serving, teacher.engine
    assert scoring is not None and serving is not None and engine is not None
    seqs_in, batch, asked_t = _check(req)
    top = _one(req.top_logprobs_num, "top_logprobs_num")
    start = _one(req.logprob_start_len, "logprob_start_len")
    top = scoring.check_k(top or None) or 0
    t = scoring.check_temperature(asked_t)
    info = engine.info
    cache = teacher.route_cache(req.cache, DEFAULT_CACHE, t)

    def checked() -> tuple[list[Sequence], list[int], list[Any], list[Any], Manifest]:
        """Every check, blocking (one worker thread hop): the sequences, their first answered
        positions, asked ids and asked matrices, and the cache's manifest."""
        seqs = scoring.checked(raws("input_ids", seqs_in), "input_ids")
        firsts = [_first(start, s.length) for s in seqs]
        chosen = [_chosen(req.token_ids_logprob, i, len(seqs), batch) for i in range(len(seqs))]
        asks = [
            None if c is None else _asked(c, f, s.length, info.vocab_size, "token_ids_logprob")
            for c, f, s in zip(chosen, firsts, seqs, strict=True)
        ]
        width = max((len(c) for c in chosen if c is not None), default=0)
        scoring.check_answer_size(seqs, max(top, 1) + width, "generate")
        return seqs, firsts, chosen, asks, scoring.route_manifest(cache, t)

    seqs, firsts, chosen, asks, manifest = await asyncio.to_thread(checked)
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
        meta = _meta_json(rec, firsts[i], top, at[i], decode, cached, masks[i], uuid.uuid4().hex)
        out.append('{"text":"","output_ids":[],"meta_info":' + meta + "}")
    return ("[" + ",".join(out) + "]" if batch else out[0]).encode()


@router.post("/generate", responses=ERRORS, summary="SGLang-compatible input logprobs (cached)")
async def generate_route(
    body: SglangGenerateRequest, request: Request, services: ServicesDep
) -> Response:
    """SGLang's ``/generate`` with ``return_logprob`` and ``max_new_tokens: 0`` (module doc)."""
    answer = await with_teacher(request, services, body.model, lambda t: generate(t, body))
    return Response(answer, media_type="application/json")

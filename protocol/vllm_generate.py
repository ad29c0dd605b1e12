"""vLLM's token-in/token-out ``POST /inference/v1/generate`` as a teacher answers it, for
``sampling_params.prompt_logprob_token_ids`` (vLLM 0.32.0: ``GenerateRequest`` /
``GenerateTokensResponse`` in ``vllm/entrypoints/scale_out/token_in_token_out/protocol.py``, the
two fields in ``vllm/sampling_params.py``; docs/training/prompt_token_id_logprobs.md).

``prompt_logprob_token_ids`` holds one candidate list per scored row (rows may differ in length;
shorter rows are padded with ``-1``, which scores ``-inf``); row ``i`` scores its ids as
predictions of prompt token ``prompt_logprob_start + i + 1``, so there are exactly ``len(token_ids)
- 1 - prompt_logprob_start`` rows. The answer's ``prompt_token_id_logprobs`` is that ``[rows,
max row length]`` matrix as a base64-encoded ``.npy`` float32 array
(``np.load(io.BytesIO(base64.b64decode(s)))``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .models import MAX_TOKEN_ID, CacheName, TokenId

#: A candidate id of ``prompt_logprob_token_ids``: a token id, or ``-1`` (padding).
CandidateId = Annotated[int, Field(strict=True, ge=-1, le=MAX_TOKEN_ID)]


class VllmSamplingParams(BaseModel):
    """The ``sampling_params`` fields a scoring request uses (others are accepted and
    ignored). ``max_tokens`` 0 or 1 (or absent): nothing is generated. ``temperature``: the
    teacher's, applied exactly to the scored rows (absent: the server's)."""

    model_config = ConfigDict(extra="allow")

    max_tokens: Annotated[int, Field(strict=True)] | None = None
    temperature: float | None = None
    prompt_logprob_token_ids: list[list[CandidateId]] | None = None
    prompt_logprob_start: Annotated[int, Field(strict=True, ge=0)] | None = None
    prompt_logprobs: Annotated[int, Field(strict=True)] | None = None


class VllmGenerateRequest(BaseModel):
    """vLLM's ``GenerateRequest`` fields this route reads; ``cache`` is a logitcache extension
    (the cache to read through; default ``vllm-generate``)."""

    model_config = ConfigDict(extra="allow")

    request_id: str | None = None
    token_ids: list[TokenId] = Field(min_length=1)
    sampling_params: VllmSamplingParams
    model: str | None = None
    stream: bool | None = False
    output_mode: Literal["tokens", "text"] = "tokens"
    return_token_ids: bool | None = None
    cache: CacheName | None = Field(None, description="logitcache extension")
    approximate: bool = Field(
        False,
        description="logitcache extension: an id outside a cached row's top-k is answered from "
        "the row's tail mass spread uniformly, log(tail / (V - k)), instead of by the engine "
        "(the answer's `approximated` marks those entries)",
    )


class VllmUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class VllmGenerateChoice(BaseModel):
    """One choice: no token is generated (``token_ids`` empty, ``finish_reason`` ``length``;
    ``text`` ``""`` with ``output_mode: "text"``, as vLLM's ``GenerateTextChoice``)."""

    index: int
    text: str | None = None
    logprobs: Any | None = None
    finish_reason: str | None = "length"
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class VllmGenerateResponse(BaseModel):
    """vLLM's ``GenerateTokensResponse`` with ``prompt_token_id_logprobs`` (module doc).
    ``cached`` (the sequence's rows were in the cache) and ``exact`` (the matrix came from the
    engine, some asked id being outside the cached top-k) are logitcache extensions."""

    request_id: str
    model: str | None = None
    created: int | None = None
    usage: VllmUsage | None = None
    prompt_logprobs: list[Any] | None = None
    prompt_token_id_logprobs: str | None = None
    prompt_token_ids: list[int] | None = None
    output_mode: Literal["tokens", "text"] = "tokens"
    choices: list[VllmGenerateChoice]
    cached: bool
    exact: bool
    approximated: str | None = Field(
        None,
        description="logitcache extension, with `approximate`: a base64 `.npy` bool matrix of "
        "the shape of `prompt_token_id_logprobs`, true where the entry was spread from the tail "
        "(absent when none was)",
    )

"""SGLang's ``POST /generate`` as a teacher answers it (the fields of SGLang 0.5.x
``GenerateReqInput``, ``python/sglang/srt/managers/io_struct.py``, that a scoring request uses).

The answer is SGLang's own ``{"text", "output_ids", "meta_info"}`` per sequence (one object for
one sequence, a list for a batch); :class:`SglangMetaInfo` types its ``meta_info``. Entries of the
logprob lists are ``[logprob, token_id, text]`` (``text``: the decoded token when
``return_text_in_logprobs``, else ``None``).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from .models import TokenId

Int = Annotated[int, Field(strict=True)]
#: One ``[logprob, token_id, text]`` entry (``logprob`` ``None`` where not served).
LogprobEntry = tuple[float | None, int, str | None]


class SglangGenerateRequest(BaseModel):
    """The fields of SGLang's ``GenerateReqInput`` a scoring request reads (others are
    accepted and ignored, as SGLang's own server would take them). Integers are strict.

    ``token_ids_logprob``: one list of ids for every sequence, or one list per sequence; the
    answer's ``meta_info.input_token_ids_logprobs`` holds their logprobs at every position from
    ``logprob_start_len``, in the asked order."""

    model_config = ConfigDict(extra="allow")

    input_ids: list[TokenId] | list[list[TokenId]] | None = None
    text: str | list[str] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: Int | list[Int] = -1
    top_logprobs_num: Int | list[Int] = 0
    token_ids_logprob: list[TokenId] | list[list[TokenId]] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    cache: str | None = Field(None, description="logitcache extension: the cache to serve from")
    model: str | None = Field(
        None, description="logitcache extension: the teacher (a name /v1/models lists)"
    )
    approximate: bool = Field(
        False,
        description="logitcache extension: token_ids_logprob ids outside a cached row's top-k "
        "from the row's tail spread uniformly, log(tail / (V - k)), listed per position in "
        "meta_info.approximated_token_ids",
    )


class SglangMetaInfo(BaseModel):
    """``meta_info`` of one scored sequence. Lists run over the input positions from
    ``logprob_start_len``; position 0 has no prediction (``None`` entries). ``cached`` (whether
    the rows came from the cache) and ``exact_token_ids`` (whether ``input_token_ids_logprobs``
    came from the engine rather than the cached top-k rows) are logitcache extensions."""

    model_config = ConfigDict(extra="allow")

    id: str
    finish_reason: dict[str, Any]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    input_token_logprobs: list[LogprobEntry]
    input_top_logprobs: list[list[LogprobEntry] | None]
    input_token_ids_logprobs: list[list[LogprobEntry] | None] | None = None
    output_token_logprobs: list[Any]
    output_top_logprobs: list[Any]
    cached: bool
    exact_token_ids: bool | None = None
    approximated_token_ids: list[list[int] | None] | None = Field(
        None,
        description="logitcache extension, with approximate: per position the asked ids spread "
        "from the row's tail (None at position 0)",
    )

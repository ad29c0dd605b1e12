"""logitcache.protocol: the JSON protocol of the teacher service, shared by server and client.

One definition of every request and response body (pydantic models), of the media types
(``FRAMES_MEDIA_TYPE`` for binary wire frames, ``JSON_MEDIA_TYPE``), of the job states
(``JobState``; ``JobState.terminal`` / ``TERMINAL_JOB_STATES``) and of the request limits
(``MAX_K``, ``MAX_TOKEN_ID``, key and name rules), and the engines' own protocols a teacher
answers (:mod:`.sglang`: SGLang's ``/generate``; :mod:`.vllm_generate`: vLLM's
``/inference/v1/generate``). The server (``logitcache.server``) validates
and answers with them; the client (``logitcache.client.TeacherClient``) returns them. Importing
it needs pydantic only (no other room of ours, no FastAPI, vLLM, httpx or zarr); the HTTP
semantics are in ``server/API.md``.
"""

from .models import (
    FRAMES_MEDIA_TYPE,
    JSON_MEDIA_TYPE,
    MAX_K,
    MAX_KEY_CHARS,
    MAX_NAME_CHARS,
    MAX_TEMPERATURE,
    MAX_TOKEN_ID,
    MIN_TEMPERATURE,
    NAME_REGEX,
    TERMINAL_JOB_STATES,
    CacheInfo,
    CacheLengths,
    CacheList,
    Compression,
    ErrorDetail,
    ErrorResponse,
    Health,
    InlineRecord,
    InputCounts,
    InputFile,
    InputFormat,
    JobCreate,
    JobList,
    JobState,
    JobStatus,
    Key,
    LayoutName,
    OnLong,
    SamplingOptions,
    ScoredSequence,
    ScoreRequest,
    ScoreResponse,
    TargetKind,
    TeacherState,
    Temperature,
    TokenId,
)
from .sglang import SglangGenerateRequest, SglangMetaInfo
from .vllm_generate import (
    VllmGenerateChoice,
    VllmGenerateRequest,
    VllmGenerateResponse,
    VllmUsage,
)

__all__ = [
    "CacheInfo",
    "CacheLengths",
    "CacheList",
    "Compression",
    "ErrorDetail",
    "ErrorResponse",
    "FRAMES_MEDIA_TYPE",
    "Health",
    "TeacherState",
    "InlineRecord",
    "InputCounts",
    "InputFile",
    "InputFormat",
    "JSON_MEDIA_TYPE",
    "JobCreate",
    "JobList",
    "JobState",
    "JobStatus",
    "Key",
    "LayoutName",
    "MAX_K",
    "MAX_KEY_CHARS",
    "MAX_TEMPERATURE",
    "MIN_TEMPERATURE",
    "MAX_NAME_CHARS",
    "MAX_TOKEN_ID",
    "NAME_REGEX",
    "OnLong",
    "SamplingOptions",
    "ScoreRequest",
    "ScoreResponse",
    "ScoredSequence",
    "TERMINAL_JOB_STATES",
    "TargetKind",
    "Temperature",
    "TokenId",
    "SglangGenerateRequest",
    "SglangMetaInfo",
    "VllmGenerateChoice",
    "VllmGenerateRequest",
    "VllmGenerateResponse",
    "VllmUsage",
]

"""Request and response models of the HTTP API (pydantic only: no FastAPI, no engine).

Every request model forbids unknown fields (``extra="forbid"``), so a misspelt option is a 422,
not silently ignored. Row alignment follows DESIGN.md: a sequence of ``L`` tokens has ``L - 1``
rows; row ``j`` is the teacher's distribution of token ``j + 1`` given tokens ``0..j``.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any, Literal

from logitcache.cache_format import CONTENT_TYPE
from pydantic import BaseModel, ConfigDict, Field, model_validator

#: Media type of the compact binary responses: the body is one or more frames of
#: ``logitcache.cache_format.encode_records`` (cache_format/FORMAT.md, wire codec); decode with
#: ``decode_records`` or ``iter_decode``.
FRAMES_MEDIA_TYPE = CONTENT_TYPE


class ApiModel(BaseModel):
    """Base of all API models: unknown fields are an error."""

    model_config = ConfigDict(extra="forbid")


class ErrorDetail(ApiModel):
    code: str = Field(description="stable machine-readable slug, e.g. invalid_input")
    message: str
    detail: Any = None


class ErrorResponse(ApiModel):
    """Body of every 4xx/5xx answer."""

    error: ErrorDetail


# --- scoring -------------------------------------------------------------------------------


class ScoreRequest(ApiModel):
    """Score sequences on demand: exactly one of ``input_ids`` or ``texts``."""

    input_ids: list[list[int]] | None = Field(
        None, description="token id sequences (each of length >= 2)"
    )
    texts: list[str] | None = Field(None, description="texts, tokenised by the teacher's tokenizer")
    k: int | None = Field(None, ge=1, description="top-k per row (default: the server's k)")
    cache: str | None = Field(None, description="also store the results in this named cache")
    keys: list[str] | None = Field(
        None, description="sequence keys (default: content hash of the token ids)"
    )

    @model_validator(mode="after")
    def _one_input(self) -> ScoreRequest:
        given = [x for x in (self.input_ids, self.texts) if x is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of input_ids or texts")
        if len(given[0]) == 0:
            raise ValueError("the input holds no sequence")
        if self.keys is not None and len(self.keys) != len(given[0]):
            raise ValueError(f"keys has {len(self.keys)} entries for {len(given[0])} sequences")
        return self

    @property
    def num_sequences(self) -> int:
        return len(self.input_ids if self.input_ids is not None else self.texts or [])


class ScoredSequence(ApiModel):
    key: str
    input_ids: list[int]
    topk_ids: list[list[int]] = Field(
        description="[L-1][k] top-k ids per row, by descending logprob"
    )
    topk_logprobs: list[list[float]] = Field(description="[L-1][k] their logprobs")
    tail_mass: list[float] = Field(description="[L-1] 1 - sum(exp(topk_logprobs)) per row")


class ScoreResponse(ApiModel):
    model: str
    k: int
    cache: str | None = None
    stored: int = Field(0, description="sequences newly committed to the cache")
    sequences: list[ScoredSequence]


# --- jobs ----------------------------------------------------------------------------------


class JobState(StrEnum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (JobState.succeeded, JobState.failed, JobState.cancelled)


class ChatMessage(ApiModel):
    """One message of a chat record (rendered with the teacher's chat template: server/chat.py)."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str


class InlineRecord(ApiModel):
    """One input sequence: ``text``, ``input_ids`` or chat ``messages``, and an optional ``id``
    (the sequence key; default: the content key of the token ids)."""

    id: str | int | None = None
    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None


class InputFile(ApiModel):
    """A JSONL (optionally .gz), Parquet or Arrow file, or a directory of Parquet/Arrow files
    (Hugging Face ``datasets`` layouts), under the server's data directory (a relative path)."""

    path: str = Field(description="relative to the server's data directory")
    format: Literal["jsonl", "parquet", "arrow"] | None = Field(
        None, description="default: from the suffix (.gz allowed) or the directory's files"
    )
    text_field: str = "text"
    ids_field: str = "input_ids"
    id_field: str = "id"
    messages_field: str = "messages"


class JobCreate(ApiModel):
    """A batch job: score every input sequence into the named cache (created if absent)."""

    cache: str
    k: int | None = Field(None, ge=1, description="default: the cache's k, else the server's")
    file: InputFile | None = None
    records: list[InlineRecord] | None = None
    on_long: Literal["reject", "truncate", "split", "skip"] = Field(
        "reject",
        description="a sequence over the max length: reject the job, keep its first max-length "
        "tokens, split it into windows (keys <key>#w<i>), or skip it (server/long_inputs.py)",
    )
    split_overlap: int = Field(
        1,
        ge=1,
        description="tokens shared by consecutive split windows (1: every position scored once)",
    )
    chat_template: str | None = Field(
        None,
        description="Jinja chat template for chat records (messages); default: the teacher "
        "tokenizer's own (server/chat.py)",
    )
    dataset: str | None = Field(None, description="dataset description for a new cache manifest")

    @model_validator(mode="after")
    def _one_input(self) -> JobCreate:
        if (self.file is None) == (self.records is None):
            raise ValueError("give exactly one of file or records")
        if self.records is not None and not self.records:
            raise ValueError("records is empty")
        return self


class InputCounts(ApiModel):
    """Counts of a job's input, taken when it was checked (server/long_inputs.py)."""

    records: int = Field(description="records read")
    sequences: int = Field(description="sequences to score (split windows count one each)")
    duplicates: int = Field(description="records dropped: same token ids as an earlier one")
    skipped: int = Field(0, description="records over the max length left out (on_long=skip)")
    truncated: int = Field(0, description="records cut to the max length (on_long=truncate)")
    split: int = Field(0, description="records split into windows (on_long=split)")
    windows: int = Field(0, description="windows those records became")


class JobStatus(ApiModel):
    id: str
    cache: str
    state: JobState
    k: int
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    sequences_total: int
    sequences_done: int
    tokens_total: int = Field(description="prompt tokens of all input sequences")
    tokens_done: int
    tokens_per_s: float | None = Field(
        None, description="scored tokens/s since the job (re)started"
    )
    eta_s: float | None = None
    error: str | None = None
    errors: list[str] = Field(default_factory=list, description="every error seen, oldest first")
    input: InputCounts | None = Field(
        None, description="what the input held and what was done with it (checked at submission)"
    )


class JobList(ApiModel):
    jobs: list[JobStatus]


# --- caches --------------------------------------------------------------------------------


class CacheInfo(ApiModel):
    name: str
    manifest: dict[str, Any]
    num_sequences: int
    num_rows: int


class CacheList(ApiModel):
    caches: list[CacheInfo]


class Health(ApiModel):
    status: Literal["ok"] = "ok"
    model: str
    k: int
    version: str

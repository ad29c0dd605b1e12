"""The JSON protocol of the HTTP API: request and response models, media types, job states and
limits (pydantic only: no FastAPI, no engine, no HTTP client, no other room of ours).

The server validates requests and shapes answers with these models; the client
(:mod:`logitcache.client.http`) parses answers into them, so both sides share one definition.
Every model forbids unknown fields (``extra="forbid"``), so a misspelt option is a 422, not
silently ignored. Row alignment follows DESIGN.md: a sequence of ``L`` tokens has ``L - 1`` rows;
row ``j`` is the teacher's distribution of token ``j + 1`` given tokens ``0..j``.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    model_validator,
)

#: Media type of the compact binary responses: the body is one or more frames of
#: ``logitcache.cache_format.encode_records``; decode with ``decode_records`` or ``iter_decode``.
#: It is the name cache_format/FORMAT.md section 8 gives the wire codec (``cache_format.
#: CONTENT_TYPE``; tests/repo/test_packaging.py checks they agree). Written here, not imported, so
#: that this package needs pydantic only.
FRAMES_MEDIA_TYPE = "application/x-logitcache-frames"
#: Media type of every JSON body (answers, errors included).
JSON_MEDIA_TYPE = "application/json"


#: Largest token id the API accepts at all (ids are stored as int32); the vocabulary bound is
#: checked against the engine after parsing.
MAX_TOKEN_ID = 2**31 - 1
#: Largest ``k`` any request may name (the engine's own ``max_k`` is checked after parsing).
MAX_K = 4096
#: Range of a sampled request's ``proposal_temperature``: ``log p / tau`` stays finite in float32
#: (a subnormal tau made it infinite, and the answer NaN).
MIN_PROPOSAL_TEMPERATURE = 1e-3
MAX_PROPOSAL_TEMPERATURE = 1e3
#: Range of a request's teacher ``temperature`` (the engine's ``MIN_TEMPERATURE`` /
#: ``MAX_TEMPERATURE``): ``z / T`` stays finite in float32.
MIN_TEMPERATURE = 1e-3
MAX_TEMPERATURE = 1e3
#: Longest sequence key / record id, in characters.
MAX_KEY_CHARS = 512
#: Longest cache name (see ``caches.NAME_PATTERN``).
MAX_NAME_CHARS = 128
#: Cache names: letters, digits, ``.``, ``_``, ``-``; not starting with ``.``/``_``/``-``.
NAME_REGEX = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


def _utf8(value: str) -> str:
    """``value`` if it encodes as UTF-8 (no lone surrogates, e.g. from a JSON ``"\\ud800"``)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"string is not valid Unicode (lone surrogate at index {e.start})"
        ) from None
    return value


def _no_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError("string contains a NUL character")
    return value


#: A JSON integer (not ``"2"``, ``true`` or ``2.0``) in ``[0, MAX_TOKEN_ID]``.
TokenId = Annotated[int, Field(strict=True, ge=0, le=MAX_TOKEN_ID)]
#: A JSON integer ``k`` in ``[1, MAX_K]``.
TopK = Annotated[int, Field(strict=True, ge=1, le=MAX_K)]
#: A teacher temperature: the logprobs are ``log_softmax(logits / T)``.
Temperature = Annotated[float, Field(ge=MIN_TEMPERATURE, le=MAX_TEMPERATURE, allow_inf_nan=False)]
#: Text: any valid Unicode string (lone surrogates are refused).
Text = Annotated[str, Field(strict=True), AfterValidator(_utf8)]
#: A sequence key or record id: 1-512 characters of valid Unicode, no NUL.
Key = Annotated[
    str,
    StringConstraints(strict=True, min_length=1, max_length=MAX_KEY_CHARS),
    AfterValidator(_utf8),
    AfterValidator(_no_nul),
]
#: A cache name (the ``..`` rule is checked by the service).
CacheName = Annotated[
    str, StringConstraints(strict=True, pattern=NAME_REGEX, max_length=MAX_NAME_CHARS)
]
#: A short free-form string (paths, field names, dataset descriptions).
ShortText = Annotated[
    str,
    StringConstraints(strict=True, max_length=4096),
    AfterValidator(_utf8),
    AfterValidator(_no_nul),
]


class ApiModel(BaseModel):
    """Base of all API models: unknown fields are an error."""

    model_config = ConfigDict(extra="forbid")


class ErrorDetail(ApiModel):
    code: str = Field(description="stable machine-readable slug, e.g. invalid_input")
    message: str
    detail: Any = None
    type: str | None = Field(None, description="OpenAI's error type, where one applies")
    param: str | None = Field(None, description="the request field at fault, where one applies")


class ErrorResponse(ApiModel):
    """Body of every 4xx/5xx answer."""

    error: ErrorDetail


# --- target kind ---------------------------------------------------------------------------

#: What a cache's rows hold (FORMAT.md 4.4, 4.10): the teacher's top-k, sampled targets, or its
#: final hidden states (with its head stored once; jobs only).
TargetKind = Literal["topk", "sampled", "hidden"]


class SamplingOptions(ApiModel):
    """Sampled targets (random-sampling KD, FORMAT.md 4.4): per row ``draws`` i.i.d. draws from
    ``q ∝ p^(1/proposal_temperature)``, kept as distinct ids with importance weights; the draws
    of a sequence are seeded by ``sha256(f"{seed}:{key}")`` (reproducible across resumes). With
    ``head = m > 0`` the teacher's top ``m`` ids are kept exactly and the draws come from the
    rest (the head + residual estimator)."""

    draws: int = Field(64, strict=True, ge=1, le=MAX_K, description="draws per row (its slots)")
    proposal_temperature: float = Field(
        1.0,
        ge=MIN_PROPOSAL_TEMPERATURE,
        le=MAX_PROPOSAL_TEMPERATURE,
        allow_inf_nan=False,
        description="tau of the proposal q ∝ p^(1/tau)",
    )
    seed: int = Field(0, strict=True, ge=0, lt=2**63, description="seed of every sequence's draws")
    head: int = Field(
        0,
        strict=True,
        ge=0,
        le=MAX_K,
        # written only when > 0 (absent means 0): answers and stored job specs of plain RS-KD
        # keep the exact shape they always had
        exclude_if=lambda v: v == 0,
        description="the teacher's top ids kept exactly (w = p), the draws taken from the rest; "
        "a row holds head + draws slots (<= MAX_K); 0: plain RS-KD",
    )

    @model_validator(mode="after")
    def _slots_fit(self) -> SamplingOptions:
        if self.head + self.draws > MAX_K:
            raise ValueError(
                f"head={self.head} + draws={self.draws} slots exceed the limit {MAX_K}"
            )
        return self

    @classmethod
    def from_manifest(cls, sampling: dict[str, Any]) -> SamplingOptions:
        """The options a sampled cache's manifest ``sampling`` object records (``head``
        absent: 0)."""
        return cls(
            draws=int(sampling["draws"]),
            proposal_temperature=float(sampling["proposal_temperature"]),
            seed=int(sampling["seed"]),
            head=int(sampling.get("head", 0)),
        )


def _check_targets(targets: str, sampling: SamplingOptions | None, k: int | None) -> None:
    if targets == "topk" and sampling is not None:
        raise ValueError('sampling is only allowed with targets="sampled"')
    if targets == "sampled" and k is not None:
        raise ValueError('k does not apply to targets="sampled" (use sampling.draws)')
    if targets == "hidden" and (k is not None or sampling is not None):
        raise ValueError('k and sampling do not apply to targets="hidden" (rows are states)')


# --- scoring -------------------------------------------------------------------------------


class ScoreRequest(ApiModel):
    """Score sequences on demand: exactly one of ``input_ids`` or ``texts``."""

    input_ids: list[list[TokenId]] | None = Field(
        None, description="token id sequences (each of length >= 2)"
    )
    texts: list[Text] | None = Field(
        None, description="texts, tokenised by the teacher's tokenizer"
    )
    k: TopK | None = Field(None, description="top-k per row (default: the server's k)")
    cache: CacheName | None = Field(None, description="also store the results in this named cache")
    keys: list[Key] | None = Field(
        None, description="sequence keys (default: content hash of the token ids)"
    )
    model: str | None = Field(
        None, description="the teacher (a name GET /v1/models lists; default: the first)"
    )
    targets: TargetKind = Field(
        "topk", description="topk rows, or sampled targets (ids with log importance weights)"
    )
    sampling: SamplingOptions | None = Field(
        None,
        description='targets="sampled" only; default: the cache\'s own, else 64 draws, tau 1, '
        "seed 0",
    )
    temperature: Temperature | None = Field(
        None,
        description="the teacher's temperature T: logprobs of log_softmax(logits / T) (default: "
        "the cache's own, else the server's); a cache made at another T is a 409",
    )

    @model_validator(mode="after")
    def _one_input(self) -> ScoreRequest:
        _check_targets(self.targets, self.sampling, self.k)
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
    entropy: list[float] | None = Field(
        None,
        description="[L-1] the teacher's entropy per row in nats, from its full distribution "
        "(a server run with entropy on; FORMAT.md 4.9); absent otherwise",
    )
    actual_logprob: list[float] | None = Field(
        None,
        description="[L-1] each row's logprob of the sequence's actual next token (rows scored "
        "now, or read from a cache that keeps them, FORMAT.md 4.12); absent otherwise",
    )
    cached: bool | None = Field(
        None, description="with a cache: whether this sequence was read from it (no engine work)"
    )


class ScoreResponse(ApiModel):
    model: str
    k: int
    cache: str | None = None
    stored: int = Field(0, description="sequences newly committed to the cache")
    hits: int | None = Field(None, description="with a cache: sequences read from it")
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
        """Whether the job has ended (it will not change state again)."""
        return self in TERMINAL_JOB_STATES


#: States a job never leaves.
TERMINAL_JOB_STATES = frozenset({JobState.succeeded, JobState.failed, JobState.cancelled})


class ChatMessage(ApiModel):
    """One message of a chat record (rendered with the teacher's chat template:
    server/inputs/chat.py)."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str


class InlineRecord(ApiModel):
    """One input sequence: ``text``, ``input_ids`` or chat ``messages``, and an optional ``id``
    (the sequence key; default: the content key of the token ids)."""

    id: Key | Annotated[int, Field(strict=True, ge=-(2**63), lt=2**63)] | None = None
    text: Text | None = None
    input_ids: list[TokenId] | None = None
    messages: list[ChatMessage] | None = None


#: Input file formats a job reads.
InputFormat = Literal["jsonl", "parquet", "arrow"]
#: What a job does with a sequence over the max length.
OnLong = Literal["reject", "truncate", "split", "skip"]


class InputFile(ApiModel):
    """A JSONL (optionally .gz), Parquet or Arrow file, or a directory of Parquet/Arrow files
    (Hugging Face ``datasets`` layouts), under the server's data directory (a relative path)."""

    path: ShortText = Field(description="relative to the server's data directory")
    format: InputFormat | None = Field(
        None, description="default: from the suffix (.gz allowed) or the directory's files"
    )
    text_field: ShortText = "text"
    ids_field: ShortText = "input_ids"
    id_field: ShortText = "id"
    messages_field: ShortText = "messages"


#: Layout presets a job can create its cache with (``cache_format.spec.LAYOUTS``).
LayoutName = Literal["default", "random_access", "random_access_raw"]


class JobCreate(ApiModel):
    """A batch job: score every input sequence into the named cache (created if absent)."""

    cache: CacheName
    k: TopK | None = Field(None, description="default: the cache's k, else the server's")
    model: str | None = Field(
        None, description="the teacher (a name GET /v1/models lists; default: the first)"
    )
    file: InputFile | None = None
    records: list[InlineRecord] | None = None
    on_long: OnLong = Field(
        "reject",
        description="a sequence over the max length: reject the job, keep its first max-length "
        "tokens, split it into windows (keys <key>#w<i>), or skip it (server/inputs/long.py)",
    )
    split_overlap: int = Field(
        1,
        ge=1,
        description="tokens shared by consecutive split windows (1: every position scored once)",
    )
    chat_template: str | None = Field(
        None,
        description="Jinja chat template for chat records (messages); default: the teacher "
        "tokenizer's own (server/inputs/chat.py)",
    )
    loss_mask: bool = Field(
        False,
        description="store a per-row loss mask with chat records: 1 on rows predicting an "
        "assistant turn's tokens, 0 elsewhere (server/inputs/chat.py, FORMAT.md 4.6); a new cache "
        "is created with the mask, an existing cache without one is a 409",
    )
    dataset: ShortText | None = Field(
        None, description="dataset description for a new cache manifest"
    )
    targets: TargetKind = Field(
        "topk",
        description="what the cache holds: topk rows, sampled targets, or the teacher's final "
        "hidden states and head (FORMAT.md 4.10; one cache, one kind: another kind than an "
        "existing cache's is a 409)",
    )
    sampling: SamplingOptions | None = Field(
        None,
        description='targets="sampled" only; default: the cache\'s own, else 64 draws, tau 1, '
        "seed 0",
    )
    layout: LayoutName | None = Field(
        None,
        description="layout preset of a new cache (cache_format FORMAT.md 4.7): default, or "
        "random_access (256-row chunks, lz4: cheaper sequence(i) reads, ~25% larger); an "
        "existing cache keeps its own (another preset than its own is a 409); default: default",
    )

    @model_validator(mode="after")
    def _one_input(self) -> JobCreate:
        _check_targets(self.targets, self.sampling, self.k)
        if (self.file is None) == (self.records is None):
            raise ValueError("give exactly one of file or records")
        if self.records is not None and not self.records:
            raise ValueError("records is empty")
        return self


class InputCounts(ApiModel):
    """Counts of a job's input, taken when it was checked (server/inputs/long.py)."""

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
    k: int = Field(description="entries per row: the top-k, or a sampled job's draws")
    targets: TargetKind = Field(
        "topk", description="what the job writes: topk rows or sampled targets (FORMAT.md 4.4)"
    )
    sampling: SamplingOptions | None = Field(
        None,
        description='targets="sampled" only: the draws, proposal temperature and seed the '
        "job's rows are drawn with (the cache's own when the job named none)",
    )
    layout: LayoutName | None = Field(
        None, description="the layout preset the job asked for its cache (null: none named)"
    )
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
    coverage: float | None = Field(
        None,
        description="mean top-k probability mass (1 - mean tail mass) of the rows written so "
        "far by this run of the job (null before the first batch)",
    )
    error: str | None = None
    errors: list[str] = Field(default_factory=list, description="every error seen, oldest first")
    input: InputCounts | None = Field(
        None, description="what the input held and what was done with it (checked at submission)"
    )


class JobList(ApiModel):
    jobs: list[JobStatus]
    next_offset: int | None = Field(None, description="offset of the next page; null: last page")


# --- caches --------------------------------------------------------------------------------


class CacheInfo(ApiModel):
    name: str
    manifest: dict[str, Any]
    num_sequences: int
    num_rows: int
    status: Literal["ok", "broken", "incomplete"] = Field(
        "ok",
        description="ok; broken: the store cannot be opened (see error); incomplete: a folder "
        "without a root zarr.json (creation interrupted)",
    )
    error: str | None = Field(None, description="why the cache is broken or incomplete")


class CacheList(ApiModel):
    caches: list[CacheInfo]


class TeacherState(ApiModel):
    """One teacher of the service and its engine's state."""

    name: str = Field(description="the name requests give as `model`")
    model: str = Field(description="the teacher's model (last path part)")
    backend: str
    state: Literal["unloaded", "loading", "loaded", "unloading"]
    in_flight: int = Field(description="requests and jobs using it now")
    memory_bytes: int = Field(description="memory counted against the teachers' budget")
    loads: int = Field(description="times its engine was loaded since the start")
    max_k: int | None = Field(None, description="largest k (while loaded)")
    alive: bool | None = Field(None, description="its engine can score (while loaded)")


class Health(ApiModel):
    status: Literal["ok"] = "ok"
    model: str = Field(description="the default teacher")
    k: int
    version: str
    teachers: list[TeacherState] = Field(default_factory=list)


class CacheLengths(ApiModel):
    """Answer of ``GET /v1/caches/{name}/lengths``: token counts of sequences ``[start, stop)``."""

    start: int
    stop: int
    lengths: list[int] = Field(description="token count L_i of each sequence, in storage order")


#: Frame compression the sequence routes offer (``zstd``: each frame compressed).
Compression = Literal["none", "zstd"]

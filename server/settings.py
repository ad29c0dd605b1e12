"""Configuration of the teacher service: one pydantic-settings model, read from the environment
(prefix ``LOGITCACHE_``, e.g. ``LOGITCACHE_MODEL=/models/tiny``), a ``.env`` file, or the command
line (``logitcache-server --model /models/tiny -k 20``; CLI beats environment beats defaults).

Nothing here is read at import time: :func:`load_settings` builds a fresh object, and
``create_app(settings)`` takes one, so tests build apps with any settings they like.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

#: Backends a teacher may name (``hf`` and ``transformers`` are one backend).
BackendName = Literal["vllm", "hf", "transformers"]


class TeacherSettings(BaseModel):
    """One teacher of a service serving several (``--teachers`` JSON list): its public name
    (the ``model`` requests route by), its model, and what it sets differently from the server's
    engine settings (``None``: the server's)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
    """The name requests give as ``model`` and ``/v1/models`` lists."""
    model: str
    """A local model directory or a model id."""
    backend: BackendName | None = None
    revision: str | None = None
    tokenizer: str | None = None
    dtype: str | None = None
    temperature: float | None = Field(None, ge=1e-3, le=1e3)
    k: int | None = Field(None, ge=1, le=4096)
    memory_share: float | None = Field(None, gt=0, le=1)
    engine_options: dict[str, Any] | None = None
    memory_bytes: int | None = Field(None, ge=0)
    """Memory the loaded engine takes, counted against ``teacher_memory_bytes`` (default: the
    size of the model directory's weight files)."""


class ServerSettings(BaseSettings):
    """Every knob of the service. Field docstrings are the CLI help."""

    model_config = SettingsConfigDict(
        env_prefix="LOGITCACHE_",
        env_file=".env",
        extra="ignore",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        use_attribute_docstrings=True,
    )

    # --- teacher engine -------------------------------------------------------------------
    model: str = ""
    """Teacher: a local model directory or a model id (the hub must be reachable for an id)."""
    revision: str | None = None
    """Model revision recorded in cache manifests (default: the engine's own notion)."""
    tokenizer: str | None = None
    """Tokenizer directory or id, if not the model's."""
    backend: BackendName = "vllm"
    """Engine: vLLM, or plain transformers (``hf``; chunked lm-head top-k) where vLLM cannot run."""
    k: int = Field(20, ge=1, le=4096)
    """Largest top-k the engine is built for (vLLM ``max_logprobs``) and the default request k."""
    temperature: float = Field(1.0, ge=1e-3, le=1e3)
    """Temperature applied to the teacher's logits before the log-softmax, for requests and
    jobs that name none (a request's own ``temperature`` is applied exactly, per request)."""
    dtype: str = "auto"
    """Engine dtype (auto, float32, bfloat16, float16)."""
    max_seq_len: int = Field(2048, ge=2)
    """Longest sequence (in tokens) accepted (``max_seq_len`` everywhere; the model may cap it,
    and vLLM is given one position more for the generated token)."""
    memory_share: float = Field(0.9, gt=0, le=1)
    """Share of accelerator memory the engine may take (vLLM ``gpu_memory_utilization``)."""
    max_num_seqs: int = Field(256, ge=1)
    """Most sequences the engine schedules at once."""
    max_num_batched_tokens: int | None = None
    """Most tokens per engine step (bounds prompt-logprob memory); engine default if unset."""
    tensor_parallel_size: int = Field(1, ge=1)
    """vLLM tensor parallelism for large teachers."""
    pipeline_parallel_size: int = Field(1, ge=1)
    """vLLM pipeline parallelism for large teachers."""
    seed: int = 0
    """Engine seed."""
    engine_options: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments for the engine backend (JSON object)."""
    entropy: bool = False
    """Store each row's teacher entropy (nats, from the full logits at the cache's temperature;
    FORMAT.md 4.9) in the caches the service creates (both backends). A cache whose flag
    differs is refused (409)."""
    actual_logprob: bool = True
    """Keep each row's logprob of its actual next token (float32, 4 B per position before
    compression; FORMAT.md 4.12) in the top-k caches the service creates: ``/v1/completions``
    answers the prompt's own token from it, as vLLM does, with no engine work on a hit. Caches
    made without it are served too (their actual tokens outside the top-k are scored)."""
    teachers: list[TeacherSettings] = Field(default_factory=list)
    """Several teachers behind one service (JSON list of ``{"name", "model", ...}``, see
    :class:`TeacherSettings`); requests route by their ``model``, the first is the default.
    Empty: the one teacher ``--model`` (named by its last path part)."""
    teacher_memory_bytes: int | None = Field(None, ge=0)
    """Memory budget of the loaded teacher engines: a teacher is loaded on its first request
    and the least recently used idle ones are unloaded to keep the loaded ones' ``memory_bytes``
    within it (an engine with work in flight is never unloaded; one teacher is always let in).
    Unset: teachers stay loaded once loaded."""

    # --- storage ----------------------------------------------------------------------------
    store_root: str = "caches"
    """Where named caches live: a local directory or a URL (``s3://bucket/prefix``)."""
    storage_options: dict[str, Any] = Field(default_factory=dict)
    """fsspec/zarr storage options for ``store_root`` (JSON object: keys, endpoint...)."""
    logprob_dtype: Literal["float16", "float32", "uint8", "uint16"] = "float16"
    """Storage dtype of top-k logprobs in caches this server creates (see FORMAT.md)."""
    data_dir: Path = Path("data")
    """Job input files (JSONL, Parquet) must lie under this directory."""
    state_dir: Path = Path("state")
    """Holds the job database (``jobs.sqlite``)."""

    # --- limits -----------------------------------------------------------------------------
    max_request_bytes: int = Field(32 * 1024 * 1024, ge=1024)
    """Largest accepted request body in bytes (413 above)."""
    max_score_sequences: int = Field(256, ge=1)
    """Most sequences in one ``POST /v1/score``."""
    max_inline_records: int = Field(10_000, ge=1)
    """Most inline records in one ``POST /v1/jobs``."""
    max_stream_sequences: int = Field(4096, ge=1)
    """Most sequences returned by one block-streaming request."""
    max_text_bytes: int | None = Field(None, ge=1)
    """Longest text (UTF-8 bytes), checked before tokenising (413 above); default
    ``64 * max_seq_len``."""
    max_response_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    """Largest ``/v1/score`` answer, estimated before scoring (413 above: ask for frames, fewer
    sequences or a smaller k)."""

    # --- admission control --------------------------------------------------------------------
    max_queued_tokens: int = Field(262_144, ge=1)
    """On-demand admission: most prompt tokens of ``/v1/score`` requests admitted to the engine
    at once; a request that would pass it is answered 429 with ``Retry-After`` (a single request
    is always admitted when nothing else is in flight)."""
    max_pending_job_tokens: int = Field(1_000_000_000, ge=1)
    """Job admission: most prompt tokens not yet scored in queued and running jobs; a new job
    is refused with 429 while they are above it."""
    request_timeout_s: float = Field(300.0, gt=0)
    """Deadline of a ``/v1/score`` request: past it the engine work is aborted and the answer is
    503 ``deadline_exceeded``. A request whose client disconnects is aborted at once."""
    cache_append_window_s: float = Field(0.05, ge=0, le=1.0)
    """On-demand requests that store into a cache (``/v1/score``, ``/v1/completions`` and
    ``/generate`` with ``cache``) are committed in groups: one append for the records of every
    request into that cache in progress (looked up, being scored), waiting at most this long
    for the last of them; a lone request is committed at once. 0: no wait (groups then form
    only behind a running commit)."""
    body_timeout_s: float = Field(30.0, gt=0)
    """Longest wait for the next piece of a request body (408 ``request_timeout`` after)."""
    body_deadline_s: float = Field(300.0, gt=0)
    """Longest time a whole request body may take to arrive (408 ``request_timeout`` after)."""
    header_timeout_s: float = Field(10.0, gt=0)
    """Longest wait for a request's head (request line and headers) on a connection, from its
    opening or the previous answer on it; a slower client is disconnected."""
    max_connections: int = Field(1024, ge=1)
    """Most connections and requests in progress at once (uvicorn ``limit_concurrency``); past
    it a new request is answered 503 at once."""

    # --- jobs -------------------------------------------------------------------------------
    job_batch_sequences: int = Field(64, ge=1)
    """Sequences per engine call in a job; batches are fixed by input order (restart-safe)."""
    job_batch_tokens: int = Field(16384, ge=2)
    """A job batch also closes once it holds this many tokens (larger: slightly faster jobs,
    benchmarks/results/service.md; an on-demand request waits longer behind the job batch kept
    in the engine meanwhile)."""
    job_inflight_batches: int = Field(2, ge=1)
    """Job batches handed to the engine before the oldest is awaited (keeps the engine busy);
    while on-demand requests are being scored a job keeps only one batch in the engine."""
    job_keep_input_tokens: int = Field(1 << 25, ge=0)
    """Tokens of checked input that submitted jobs keep in memory until they run, over all queued
    jobs: such a job runs from the sequences its submission checked instead of reading and
    checking its input again (~0.15 CPU-us/position). A larger input, or a job resumed
    after a restart, reads its input again (and fails if it changed). 0: never keep."""
    job_write_queue: int = Field(4, ge=1)
    """Bound of the queue between scoring and the cache-writer thread."""
    job_write_fill_s: float = Field(2.5, ge=0)
    """Seconds a job's (or a Ray shard's) writer waits to fill a group of
    ``pipeline.MERGE_ROWS`` rows when batches arrive fast enough to fill half of it in that
    time (else it commits after 0.1 s), so a fast teacher pays an append's fixed cost once per
    group. It bounds how often progress moves and the most a crash can lose. 0: commit after
    0.1 s always."""
    job_retention_s: float = Field(7 * 24 * 3600.0, ge=0)
    """Finished (succeeded, failed, cancelled) jobs are deleted from the job table this long
    after they finished (checked at start-up and hourly); their caches stay."""

    # --- HTTP -------------------------------------------------------------------------------
    api_key: SecretStr | None = None
    """If set, every route but ``/health`` requires ``Authorization: Bearer <key>``. Prefer the
    environment (``LOGITCACHE_API_KEY``) or ``--api-key-file``: a command line is visible in
    ``ps``."""
    session_ttl_s: float = Field(8 * 3600.0, gt=0, le=30 * 24 * 3600.0)
    """Lifetime of a status-page login session (its cookie): a new login is needed after it;
    logout or a restart ends every session at once."""
    api_key_file: Path | None = None
    """File holding the API key (first line; surrounding whitespace ignored)."""
    host: str = "127.0.0.1"
    """Bind address."""
    port: int = Field(8000, ge=0, le=65535)
    """Bind port (0: any free port)."""
    log_level: str = "info"
    """Log level of the service's and uvicorn's loggers (INFO shows start-up and job events)."""

    @model_validator(mode="after")
    def _check(self) -> ServerSettings:
        if self.api_key_file is not None:
            try:
                text = self.api_key_file.expanduser().read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise ValueError(f"cannot read the API key file: {e}") from None
            key = text.strip().splitlines()[0].strip() if text.strip() else ""
            if not key:
                raise ValueError("the API key file is empty")
            self.api_key = SecretStr(key)
        if self.api_key is not None and not self.api_key.get_secret_value():
            self.api_key = None
        names = [t.name for t in self.teachers]
        if len(set(names)) != len(names):
            raise ValueError(f"teacher names must be distinct, got {names}")
        return self

    def teacher_list(self) -> list[TeacherSettings]:
        """The teachers served, the default first: ``teachers``, or the one teacher ``model``
        under its public name (its last path part)."""
        if self.teachers:
            return list(self.teachers)
        model = self.model.rstrip("/")
        name = os.path.basename(model) if os.path.isabs(model) else model
        return [TeacherSettings.model_construct(name=name or "teacher", model=self.model)]

    def for_teacher(self, teacher: TeacherSettings) -> ServerSettings:
        """These settings with ``teacher``'s model and engine settings (what its engine and
        scoring service are built from)."""
        update: dict[str, Any] = {"model": teacher.model, "teachers": []}
        for attr in TeacherSettings.model_fields.keys() - {"name", "model", "memory_bytes"}:
            value = getattr(teacher, attr)
            if value is not None:
                update[attr] = value
        return self.model_copy(update=update)

    @property
    def text_byte_limit(self) -> int:
        """``max_text_bytes``, or its default ``64 * max_seq_len``."""
        return self.max_text_bytes if self.max_text_bytes is not None else 64 * self.max_seq_len

    @property
    def job_db_path(self) -> Path:
        """The SQLite job table's file."""
        return self.state_dir / "jobs.sqlite"


def load_settings(argv: list[str] | None = None, **overrides: Any) -> ServerSettings:
    """Build settings from defaults < environment/.env < ``argv`` < ``overrides`` (``argv=None``
    reads no command line)."""
    if argv is None:
        return ServerSettings(**overrides)
    return ServerSettings(_cli_parse_args=argv, **overrides)  # type: ignore[call-arg]

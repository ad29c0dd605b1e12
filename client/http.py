"""HTTP client of the teacher service: score on demand, batch jobs, caches (httpx, sync and async).

Answers are typed: JSON bodies are parsed into the models of :mod:`logitcache.protocol` (the
ones the server answers with: ``Health``, ``JobStatus``, ``CacheInfo``, ...), sequences into
``cache_format.SequenceRecord`` and lengths into a numpy array.

One core, two drivers: every endpoint is written once in :class:`_Endpoints` as a generator of
*steps* (a :class:`Call` to send, or seconds to sleep) that receives each call's outcome;
:class:`TeacherClient` runs the steps with ``httpx.Client`` and ``time.sleep``,
:class:`AsyncTeacherClient` with ``httpx.AsyncClient`` and ``asyncio.sleep``. So
``client.get_job(id)`` and ``await aclient.get_job(id)`` are the same code, retries, polling and
paging included.

Errors and retries
------------------
* 4xx answers raise the matching :class:`~logitcache.client.errors.TeacherHTTPError` subclass
  (``BadRequestError`` for 400/422, ``NotFoundError``, ``ConflictError``, ...), carrying
  ``status_code`` and the server's JSON error body (``{"error": {"code", "message", "detail"}}``).
* Transient failures are retried up to ``max_retries`` times with exponential backoff
  (``backoff * 2**attempt``, capped at ``max_backoff``, with +-25% jitter; a ``Retry-After``
  header wins): connect errors and 429/502/503/504 for every request (the server did not act on
  it), plus read errors, timeouts and 500 for idempotent requests (GETs, scoring). Then
  ``TransportError`` / ``RateLimitedError`` / ``ServerError`` is raised.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Generator, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar, overload

import httpx
import numpy as np
from logitcache.protocol import (
    FRAMES_MEDIA_TYPE,
    JSON_MEDIA_TYPE,
    CacheInfo,
    CacheLengths,
    CacheList,
    Health,
    JobList,
    JobStatus,
    ScoreResponse,
)
from pydantic import BaseModel

from .errors import (
    ConfigError,
    JobFailedError,
    JobTimeoutError,
    TransportError,
    http_error_for,
)

if TYPE_CHECKING:
    from logitcache.cache_format import SequenceRecord

__all__ = ["TeacherClient", "AsyncTeacherClient", "Call", "RetryPolicy"]

_ALWAYS_RETRY_STATUS = frozenset({429, 502, 503, 504})
_IDEMPOTENT_RETRY_STATUS = frozenset({500})
_CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
#: The fields of a ``ScoredSequence`` that a ``SequenceRecord`` holds.
_RECORD_FIELDS = (
    "key",
    "input_ids",
    "topk_ids",
    "topk_logprobs",
    "tail_mass",
    "entropy",
    "actual_logprob",
)


@dataclass(frozen=True)
class RetryPolicy:
    """How transient failures are retried (see the module docstring)."""

    max_retries: int = 5
    backoff: float = 0.25
    max_backoff: float = 8.0

    def next_delay(
        self,
        attempt: int,
        call: Call,
        response: httpx.Response | None,
        error: Exception | None,
    ) -> float | None:
        """Seconds to wait before retrying failed attempt ``attempt`` (0-based), or ``None``."""
        if attempt >= self.max_retries:
            return None
        if error is not None:
            if not (isinstance(error, _CONNECT_ERRORS) or call.idempotent):
                return None
        elif response is None or not (
            response.status_code in _ALWAYS_RETRY_STATUS
            or (call.idempotent and response.status_code in _IDEMPOTENT_RETRY_STATUS)
        ):
            return None
        if response is not None and "retry-after" in response.headers:
            try:
                return min(max(float(response.headers["retry-after"]), 0.0), self.max_backoff)
            except ValueError:
                pass
        return min(self.backoff * (2**attempt), self.max_backoff) * random.uniform(0.75, 1.25)


@dataclass(frozen=True)
class Call:
    """One API request and how to read its answer."""

    method: str
    path: str
    params: dict[str, Any] | None = None
    json: object = None
    headers: dict[str, str] = field(default_factory=dict)
    parse: Callable[[httpx.Response], Any] = lambda r: r.json()
    idempotent: bool = True


T = TypeVar("T")
P = ParamSpec("P")
#: What a driver hands back for a sent :class:`Call`: the response, or the transport error.
Outcome = tuple[httpx.Response | None, httpx.TransportError | None]
#: A request's steps: yields a :class:`Call` (answered with its :data:`Outcome`) or seconds to
#: sleep (answered with ``None``); returns the endpoint's value.
Steps = Generator[Call | float, Outcome | None, T]


def _model(cls: type[BaseModel]) -> Callable[[httpx.Response], Any]:
    """A parser of a JSON answer into the protocol model ``cls``."""
    return lambda r: cls.model_validate_json(r.content)


def _error_body(response: httpx.Response) -> object:
    try:
        return response.json()
    except ValueError:
        return {"detail": response.text}


def _outcome(call: Call, response: httpx.Response | None, error: Exception | None) -> Any:
    """The parsed answer of a final attempt, or its typed error."""
    if error is not None or response is None:
        raise TransportError(f"{call.method} {call.path}: {error!r}") from error
    if response.status_code >= 400:
        raise http_error_for(
            response.status_code,
            _error_body(response),
            response.request.method,
            str(response.request.url),
        )
    return call.parse(response)


def _parse_scores(response: httpx.Response) -> list[Any]:
    """``SequenceRecord`` list from a score answer, binary frames or JSON (the record's
    constructor makes the arrays of the JSON lists and checks their shapes)."""
    from logitcache.cache_format import SequenceRecord, decode_records

    if response.headers.get("content-type", "").startswith(FRAMES_MEDIA_TYPE):
        return list(decode_records(response.content))
    body = ScoreResponse.model_validate_json(response.content)
    return [SequenceRecord(**{f: getattr(s, f) for f in _RECORD_FIELDS}) for s in body.sequences]


def _caches(response: httpx.Response) -> list[CacheInfo]:
    return CacheList.model_validate_json(response.content).caches


def _parse_lengths(response: httpx.Response) -> np.ndarray:
    body = CacheLengths.model_validate_json(response.content)
    return np.asarray(body.lengths, dtype=np.int64)


def _send(call: Call, retry: RetryPolicy) -> Steps[Any]:
    """The steps of one call: send, and on a transient failure sleep and send again."""
    attempt = 0
    while True:
        response, error = (yield call) or (None, None)
        delay = retry.next_delay(attempt, call, response, error)
        if delay is None:
            return _outcome(call, response, error)
        yield delay
        attempt += 1


class _JobProgress:
    """A tqdm bar over a job's tokens (``tokens_done / tokens_total``), with its state,
    sequences, and the server's throughput and ETA."""

    def __init__(self, enabled: bool, job_id: str) -> None:
        self._bar: Any = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=0, unit="tok", unit_scale=True, desc=f"job {job_id}")

    def update(self, job: JobStatus) -> None:
        if self._bar is None:
            return
        if self._bar.total != job.tokens_total:
            self._bar.total = job.tokens_total
        self._bar.n = job.tokens_done
        eta = "" if job.eta_s is None else f", ETA {job.eta_s:.0f} s"
        self._bar.set_postfix_str(
            f"{job.state} {job.sequences_done}/{job.sequences_total} seq, "
            f"{job.tokens_per_s or 0:,.0f} tok/s{eta}",
            refresh=False,
        )
        self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class _endpoint(Generic[P, T]):
    """An endpoint written once as steps: on a :class:`TeacherClient` it returns the value, on
    an :class:`AsyncTeacherClient` a coroutine of it (``steps`` keeps the generator)."""

    def __init__(self, steps: Callable[Concatenate[_Endpoints, P], Steps[T]]) -> None:
        self.steps = steps
        self.__doc__ = steps.__doc__

    @overload
    def __get__(self, obj: None, owner: type) -> _endpoint[P, T]: ...
    @overload
    def __get__(self, obj: TeacherClient, owner: type) -> Callable[P, T]: ...
    @overload
    def __get__(self, obj: AsyncTeacherClient, owner: type) -> Callable[P, Awaitable[T]]: ...
    def __get__(self, obj: _Endpoints | None, owner: type) -> object:
        if obj is None:
            return self
        steps = self.steps

        def call(*args: P.args, **kwargs: P.kwargs) -> object:
            return obj._run(steps(obj, *args, **kwargs))

        call.__name__, call.__doc__ = steps.__name__, steps.__doc__
        return call


class _Endpoints:
    """Every endpoint of the service, defined once as steps (:class:`_endpoint`); ``_run``
    drives them (sync: returns the value; async: returns a coroutine of it). ``transport``: an
    ``httpx`` transport of the driver's kind (sync or async)."""

    _http_class: type[httpx.Client] | type[httpx.AsyncClient]

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout: float = 60.0,
        max_retries: int = 5,
        backoff: float = 0.25,
        progress: bool = True,
        transport: httpx.BaseTransport | httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.retry = RetryPolicy(max_retries=max_retries, backoff=backoff)
        self.progress = progress
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = self._http_class(
            base_url=base_url,
            headers=headers,
            timeout=timeout,
            transport=transport,  # type: ignore[arg-type]  # the driver's kind, by contract
        )

    def _run(self, steps: Steps[T]) -> object:  # pragma: no cover - overridden
        raise NotImplementedError

    def _send(self, call: Call) -> Steps[Any]:
        return _send(call, self.retry)

    @_endpoint
    def health(self) -> Steps[Health]:
        """``GET /health`` -> :class:`~logitcache.protocol.Health` (model, k, version)."""
        return (yield from self._send(Call("GET", "/health", parse=_model(Health))))

    @_endpoint
    def score(
        self,
        input_ids: Iterable[Iterable[int]] | None = None,
        *,
        texts: list[str] | None = None,
        k: int | None = None,
        cache: str | None = None,
        keys: list[str] | None = None,
    ) -> Steps[list[SequenceRecord]]:
        """``POST /v1/score``: teacher top-k for the given sequences, now.

        Give token id sequences (each ``L >= 2``) or ``texts`` (tokenised by the teacher). Returns
        one ``SequenceRecord`` per sequence (rows aligned as in DESIGN.md). With ``cache`` the
        server also stores them in that cache.
        """
        body: dict[str, Any] = {"k": k, "cache": cache, "keys": keys}
        if input_ids is not None:
            body["input_ids"] = [[int(t) for t in seq] for seq in input_ids]
        if texts is not None:
            body["texts"] = list(texts)
        body = {key: value for key, value in body.items() if value is not None}
        accept = f"{FRAMES_MEDIA_TYPE}, {JSON_MEDIA_TYPE};q=0.5"
        call = Call("POST", "/v1/score", json=body, headers={"accept": accept}, parse=_parse_scores)
        return (yield from self._send(call))

    @_endpoint
    def submit_job(
        self,
        cache: str,
        *,
        records: list[dict[str, Any]] | None = None,
        texts: Iterable[str] | None = None,
        input_ids: Iterable[Iterable[int]] | None = None,
        file: str | dict[str, Any] | None = None,
        k: int | None = None,
        dataset: str | None = None,
        **fields: object,
    ) -> Steps[JobStatus]:
        """``POST /v1/jobs``: score a corpus into ``cache`` in the background; returns the job's
        :class:`~logitcache.protocol.JobStatus`.

        Give exactly one input: ``records`` (``{"id", "text" | "input_ids"}`` dicts), ``texts``,
        ``input_ids``, or ``file`` (a path under the server's data directory, or an ``InputFile``
        dict). ``fields`` are further fields of the request (:class:`~logitcache.protocol.
        JobCreate`: ``on_long``, ``targets``, ``sampling``, ``layout``, ...). Not retried on
        ambiguous failures (it is not idempotent).
        """
        given = [x is not None for x in (records, texts, input_ids, file)]
        if sum(given) != 1:
            raise ConfigError("give exactly one of records, texts, input_ids, file")
        body: dict[str, object] = {"cache": cache}
        if texts is not None:
            records = [{"text": str(t)} for t in texts]
        if input_ids is not None:
            records = [{"input_ids": [int(t) for t in seq]} for seq in input_ids]
        if records is not None:
            body["records"] = records
        if file is not None:
            body["file"] = {"path": file} if isinstance(file, str) else dict(file)
        body |= {"k": k, "dataset": dataset} | fields
        body = {name: value for name, value in body.items() if value is not None}
        call = Call("POST", "/v1/jobs", json=body, parse=_model(JobStatus), idempotent=False)
        return (yield from self._send(call))

    @_endpoint
    def get_job(self, job_id: str) -> Steps[JobStatus]:
        """``GET /v1/jobs/{id}`` -> :class:`~logitcache.protocol.JobStatus` (state,
        sequences/tokens done, eta, errors)."""
        return (yield from self._send(Call("GET", f"/v1/jobs/{job_id}", parse=_model(JobStatus))))

    @_endpoint
    def list_jobs(self) -> Steps[list[JobStatus]]:
        """``GET /v1/jobs`` -> ``list[JobStatus]``: every job, oldest first (the pages followed
        to the end)."""
        jobs: list[JobStatus] = []
        offset: int | None = 0
        while offset is not None:
            params = {"offset": offset} if offset else None
            page: JobList = yield from self._send(
                Call("GET", "/v1/jobs", params=params, parse=_model(JobList))
            )
            jobs += page.jobs
            nxt = page.next_offset
            offset = nxt if nxt is not None and nxt > offset else None
        return jobs

    @_endpoint
    def cancel_job(self, job_id: str) -> Steps[JobStatus]:
        """``POST /v1/jobs/{id}/cancel`` -> the job's ``JobStatus``: stop a job (what it
        committed stays in the cache)."""
        call = Call("POST", f"/v1/jobs/{job_id}/cancel", parse=_model(JobStatus))
        return (yield from self._send(call))

    @_endpoint
    def wait_job(
        self,
        job_id: str,
        *,
        poll_interval: float = 1.0,
        timeout: float | None = None,
        raise_on_failure: bool = True,
        progress: bool | None = None,
    ) -> Steps[JobStatus]:
        """Poll a job until it ends, with a tqdm bar over its tokens; return its last status.

        Raises :class:`JobFailedError` if it failed or was cancelled (unless
        ``raise_on_failure=False``) and :class:`JobTimeoutError` after ``timeout`` seconds.
        """
        bar = _JobProgress(self.progress if progress is None else progress, job_id)
        deadline = None if timeout is None else time.monotonic() + timeout
        call = Call("GET", f"/v1/jobs/{job_id}", parse=_model(JobStatus))
        try:
            while True:
                job: JobStatus = yield from self._send(call)
                bar.update(job)
                if job.state.terminal:
                    if raise_on_failure and job.state != "succeeded":
                        raise JobFailedError(job)
                    return job
                if deadline is not None and time.monotonic() >= deadline:
                    raise JobTimeoutError(f"job {job_id} still {job.state} after {timeout}s")
                yield poll_interval
        finally:
            bar.close()

    @_endpoint
    def run_job(self, cache: str, **job: Any) -> Steps[JobStatus]:
        """:meth:`submit_job` then :meth:`wait_job`; ``wait_*`` keywords go to the wait."""
        wait = {k[5:]: job.pop(k) for k in list(job) if k.startswith("wait_")}
        status = yield from _Endpoints.submit_job.steps(self, cache, **job)
        return (yield from _Endpoints.wait_job.steps(self, status.id, **wait))

    @_endpoint
    def list_caches(self) -> Steps[list[CacheInfo]]:
        """``GET /v1/caches`` -> ``list[CacheInfo]`` (name, manifest, counts, status)."""
        return (yield from self._send(Call("GET", "/v1/caches", parse=_caches)))

    @_endpoint
    def get_cache(self, name: str) -> Steps[CacheInfo]:
        """``GET /v1/caches/{name}`` -> :class:`~logitcache.protocol.CacheInfo`."""
        return (yield from self._send(Call("GET", f"/v1/caches/{name}", parse=_model(CacheInfo))))

    @_endpoint
    def cache_lengths(
        self, name: str, *, start: int = 0, stop: int | None = None
    ) -> Steps[np.ndarray]:
        """``GET /v1/caches/{name}/lengths``: token count of sequences ``[start, stop)``."""
        params = {"start": start} | ({} if stop is None else {"stop": stop})
        call = Call("GET", f"/v1/caches/{name}/lengths", params=params, parse=_parse_lengths)
        return (yield from self._send(call))


class TeacherClient(_Endpoints):
    """Synchronous client of the teacher service (a context manager; thread-safe).

    ``TeacherClient("http://127.0.0.1:8000", api_key=None, timeout=60, max_retries=5)``; every
    endpoint method of :class:`_Endpoints` returns the decoded answer. ``http`` is the underlying
    ``httpx.Client`` (add event hooks, inspect the pool).
    """

    http: httpx.Client
    _http_class = httpx.Client

    def __enter__(self) -> TeacherClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool."""
        self.http.close()

    def _run(self, steps: Steps[T]) -> T:
        answer: Outcome | None = None
        try:
            while True:
                step = steps.send(answer)
                if isinstance(step, Call):
                    try:
                        answer = (self.http.request(**_request(step)), None)
                    except httpx.TransportError as exc:
                        answer = (None, exc)
                else:
                    time.sleep(step)
                    answer = None
        except StopIteration as done:
            return done.value


class AsyncTeacherClient(_Endpoints):
    """Asynchronous client (``async with AsyncTeacherClient(url) as c: await c.score(...)``).

    Same endpoints, arguments and errors as :class:`TeacherClient`; every method is awaited.
    ``http`` is the underlying ``httpx.AsyncClient``.
    """

    http: httpx.AsyncClient
    _http_class = httpx.AsyncClient

    async def __aenter__(self) -> AsyncTeacherClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self.http.aclose()

    async def _run(self, steps: Steps[T]) -> T:
        answer: Outcome | None = None
        try:
            while True:
                step = steps.send(answer)
                if isinstance(step, Call):
                    try:
                        answer = (await self.http.request(**_request(step)), None)
                    except httpx.TransportError as exc:
                        answer = (None, exc)
                else:
                    await asyncio.sleep(step)
                    answer = None
        except StopIteration as done:
            return done.value


def _request(call: Call) -> dict[str, Any]:
    """``httpx`` request arguments of a call."""
    return {
        "method": call.method,
        "url": call.path,
        "params": call.params,
        "json": call.json,
        "headers": call.headers,
    }

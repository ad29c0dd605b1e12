"""Typed errors of the client library.

Every error a trainer can meet derives from :class:`ClientError`, so one ``except`` clause
covers the client. HTTP errors carry the server's status code and error body; guard errors carry
the list of reasons the cache was refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from logitcache.protocol import ErrorDetail, ErrorResponse
from pydantic import ValidationError

if TYPE_CHECKING:
    from logitcache.protocol import JobStatus

__all__ = [
    "ClientError",
    "ConfigError",
    "StateError",
    "SourceError",
    "IncompatibleCacheError",
    "TeacherHTTPError",
    "BadRequestError",
    "AuthError",
    "NotFoundError",
    "ConflictError",
    "PayloadTooLargeError",
    "RateLimitedError",
    "ServerError",
    "TransportError",
    "JobFailedError",
    "JobTimeoutError",
    "http_error_for",
    "CutSequenceWarning",
]


class ClientError(Exception):
    """Base class of every error raised by ``logitcache.client``."""


class ConfigError(ClientError, ValueError):
    """An argument of a client object is invalid (bad budget, bad mode, bad rank...)."""


class CutSequenceWarning(UserWarning):
    """``long_sequences="split"`` cuts cached sequences: the rows of every piece after a
    sequence's first were scored by the teacher on a prefix the student does not see there."""


class StateError(ClientError, ValueError):
    """A loader state cannot be used: wrong version, or it belongs to another configuration."""


class SourceError(ClientError):
    """A cache source could not be opened or read, or returned malformed data."""


class IncompatibleCacheError(ClientError, ValueError):
    """The cache was built for another tokenizer or vocabulary than the student's.

    ``reasons`` lists every mismatch found (one human-readable line each).
    """

    def __init__(self, reasons: list[str]) -> None:
        self.reasons = list(reasons)
        super().__init__(
            "cache refused: "
            + "; ".join(self.reasons)
            + " (pass allow_mismatch=True to use it anyway)"
        )


class TeacherHTTPError(ClientError):
    """The teacher service answered with an error status.

    Attributes
    ----------
    status_code:
        The HTTP status.
    body:
        The decoded JSON error body (or ``{"detail": <text>}`` when the body is not JSON).
    error:
        The body as the protocol's :class:`~logitcache.protocol.ErrorDetail` (``code``,
        ``message``, ``detail``), or ``None`` when it is not the API's error shape (a proxy's
        page, say).
    method, url:
        The request that failed.
    """

    def __init__(self, status_code: int, body: object, method: str, url: str) -> None:
        self.status_code = status_code
        self.body = body
        self.error = _error_detail(body)
        self.method = method
        self.url = url
        super().__init__(f"{method} {url} -> HTTP {status_code}: {_summarise(body)}")

    @property
    def code(self) -> str | None:
        """The API's machine-readable error code (``error.code``, e.g. ``invalid_input``)."""
        return None if self.error is None else self.error.code

    @property
    def detail(self) -> object:
        """The server's error message (``error.message``, else ``detail`` or ``message``)."""
        if self.error is not None:
            return self.error.message
        if isinstance(self.body, dict):
            for key in ("detail", "message", "error"):
                if key in self.body:
                    return self.body[key]
        return self.body


class BadRequestError(TeacherHTTPError):
    """HTTP 400 / 422: the request was malformed or failed validation."""


class AuthError(TeacherHTTPError):
    """HTTP 401 / 403: missing or refused credentials."""


class NotFoundError(TeacherHTTPError):
    """HTTP 404: no such job, cache or route."""


class ConflictError(TeacherHTTPError):
    """HTTP 409: the request conflicts with the resource's state (e.g. an incompatible cache)."""


class PayloadTooLargeError(TeacherHTTPError):
    """HTTP 413: the request (too many or too long prompts) exceeds a server limit."""


class RateLimitedError(TeacherHTTPError):
    """HTTP 429 after every retry was spent."""


class ServerError(TeacherHTTPError):
    """HTTP 5xx after every retry was spent."""


class TransportError(ClientError):
    """The server could not be reached (connect error, timeout) after every retry was spent."""


class JobFailedError(ClientError):
    """A batch job ended in a failed or cancelled state; ``job`` holds its last status."""

    def __init__(self, job: JobStatus) -> None:
        self.job = job
        super().__init__(f"job {job.id} ended as {job.state}: {job.error or 'no error message'}")


class JobTimeoutError(ClientError, TimeoutError):
    """Waiting for a job exceeded the caller's timeout; the job itself keeps running."""


_BY_STATUS: dict[int, type[TeacherHTTPError]] = {
    400: BadRequestError,
    401: AuthError,
    403: AuthError,
    404: NotFoundError,
    409: ConflictError,
    413: PayloadTooLargeError,
    422: BadRequestError,
    429: RateLimitedError,
}


def http_error_for(status_code: int, body: object, method: str, url: str) -> TeacherHTTPError:
    """Build the most specific :class:`TeacherHTTPError` subclass for ``status_code``."""
    if status_code >= 500:
        cls: type[TeacherHTTPError] = ServerError
    else:
        cls = _BY_STATUS.get(status_code, TeacherHTTPError)
    return cls(status_code, body, method, url)


def _error_detail(body: object) -> ErrorDetail | None:
    try:
        return ErrorResponse.model_validate(body).error
    except ValidationError:
        return None


def _summarise(body: object, limit: int = 500) -> str:
    text = str(body)
    return text if len(text) <= limit else text[:limit] + "..."

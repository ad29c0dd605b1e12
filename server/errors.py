"""Domain errors of the teacher service, each carrying the HTTP status it maps to.

Services raise these (or ``logitcache.cache_format`` errors, or the engine's
``EngineInputError`` -> 422 / ``EngineError`` -> 503); :func:`install_error_handlers` maps all of
them to one JSON body, ``{"error": {"code", "message", "detail"}}``, in one place,
so routes hold no ``try``/``except``. Every 4xx is raised *before* anything is written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from logitcache.cache_format.errors import (
    FormatError,
    ManifestError,
    ManifestMismatchError,
    RecordError,
    StoreNotFoundError,
    UnsupportedVersionError,
    WireFormatError,
    WriterLockedError,
)

if TYPE_CHECKING:
    from fastapi import FastAPI


class ServiceError(Exception):
    """Base of the service's typed errors: ``status`` is the HTTP status, ``code`` a stable slug.

    A subclass names its own with class keywords, ``class X(ServiceError, status=404,
    code="not_found")``; one that names neither inherits its parent's (so a handler of the
    parent's status also catches it).
    """

    status: int = 500
    code: str = "internal_error"

    def __init_subclass__(cls, *, status: int | None = None, code: str | None = None) -> None:
        super().__init_subclass__()
        if status is not None:
            cls.status = status
        if code is not None:
            cls.code = code

    def __init__(self, message: str, *, detail: Any = None):
        super().__init__(message)
        self.message = message
        self.detail = detail


class InvalidInputError(ServiceError, status=422, code="invalid_input"):
    """The request parses but its content is unusable (ids, lengths, k, empty input)."""


class InvalidCacheNameError(InvalidInputError, code="invalid_cache_name"):
    """A cache name breaks the naming rule (see :data:`logitcache.server.caches.NAME_PATTERN`)."""


class InvalidPathError(InvalidInputError, code="invalid_path"):
    """An input file path is absolute, escapes the data directory, or does not exist."""


class PayloadTooLargeError(ServiceError, status=413, code="payload_too_large"):
    """The request body, the number of sequences or a sequence's length exceeds a server limit."""


class UnauthorizedError(ServiceError, status=401, code="unauthorized"):
    """The API key is missing or wrong."""


class NotFoundError(ServiceError, status=404, code="not_found"):
    """A job or cache does not exist."""


class ConflictError(ServiceError, status=409, code="conflict"):
    """The request contradicts existing state (a cache of another teacher, tokenizer or k)."""


class NotAcceptableError(ServiceError, status=406, code="not_acceptable"):
    """The ``Accept`` header names no media type this endpoint can produce."""


class UnavailableError(ServiceError, status=503, code="unavailable"):
    """The engine is not ready or has died."""


def format_error_status(exc: FormatError) -> tuple[int, str]:
    """The HTTP status and code slug of a ``cache_format`` error."""
    if isinstance(exc, ManifestMismatchError):
        return 409, "manifest_mismatch"
    if isinstance(exc, WriterLockedError):
        return 409, "cache_locked"
    if isinstance(exc, StoreNotFoundError):
        return 404, "not_found"
    if isinstance(exc, RecordError | WireFormatError | ManifestError):
        return 422, "invalid_record"
    if isinstance(exc, UnsupportedVersionError):
        return 409, "unsupported_version"
    return 500, "store_error"


_HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    406: "not_acceptable",
    413: "payload_too_large",
    415: "unsupported_media_type",
}


def error_body(code: str, message: str, detail: Any = None) -> dict[str, Any]:
    """The one JSON error shape of the API (:class:`~logitcache.server.protocol.ErrorResponse`)."""
    return {"error": {"code": code, "message": message, "detail": detail}}


def _engine_error_types() -> tuple[type[Exception], ...]:
    """The engine's input error (422) and failure (503) types."""
    from .engine import EngineError, EngineInputError

    return (EngineInputError, EngineError)


def install_error_handlers(app: FastAPI) -> None:
    """Map :class:`ServiceError`, ``FormatError`` and request-validation errors to JSON bodies."""
    from fastapi.encoders import jsonable_encoder
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    async def on_service_error(_request: Any, exc: ServiceError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if isinstance(exc, UnauthorizedError) else None
        body = error_body(exc.code, exc.message, exc.detail)
        return JSONResponse(jsonable_encoder(body), status_code=exc.status, headers=headers)

    async def on_format_error(_request: Any, exc: FormatError) -> JSONResponse:
        status, code = format_error_status(exc)
        return JSONResponse(error_body(code, str(exc)), status_code=status)

    async def on_http_error(_request: Any, exc: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        body = error_body(code, str(exc.detail))
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    async def on_engine_error(_request: Any, exc: Exception) -> JSONResponse:
        from .engine import EngineInputError

        if isinstance(exc, EngineInputError):
            return JSONResponse(error_body("invalid_input", str(exc)), status_code=422)
        return JSONResponse(error_body("engine_unavailable", str(exc)), status_code=503)

    async def on_validation_error(_request: Any, exc: RequestValidationError) -> JSONResponse:
        body = error_body("invalid_request", "request validation failed", exc.errors())
        return JSONResponse(jsonable_encoder(body), status_code=422)

    app.add_exception_handler(ServiceError, on_service_error)  # type: ignore[arg-type]
    app.add_exception_handler(FormatError, on_format_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, on_http_error)  # type: ignore[arg-type]
    for exc_type in _engine_error_types():
        app.add_exception_handler(exc_type, on_engine_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)  # type: ignore[arg-type]

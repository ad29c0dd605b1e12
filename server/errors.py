"""Domain errors of the teacher service, each carrying the HTTP status it maps to.

Services raise these (or ``logitcache.cache_format`` errors, or the engine's
``EngineInputError`` -> 422 / ``EngineError`` -> 503); :func:`install_error_handlers` maps all of
them to one JSON body, ``{"error": {"code", "message", "detail"}}``, in one place,
so routes hold no ``try``/``except``. Every 4xx is raised *before* anything is written.
"""

from __future__ import annotations

import logging
import math
import os
import re
from typing import TYPE_CHECKING, Any

from logitcache.cache_format.errors import (
    FormatError,
    ManifestError,
    ManifestMismatchError,
    RecordError,
    StoreNeedsRepairError,
    StoreNotFoundError,
    UnsupportedVersionError,
    WireFormatError,
    WriterLockedError,
)

if TYPE_CHECKING:
    from fastapi import FastAPI
    from starlette.requests import Request
    from starlette.responses import Response

log = logging.getLogger("logitcache.server")


class ServiceError(Exception):
    """Base of the service's typed errors: ``status`` is the HTTP status, ``code`` a stable slug,
    both set by class keywords (``class X(ServiceError, status=404, code="not_found")``) or
    inherited."""

    status: int = 500
    code: str = "internal_error"
    retry_after: float | None = None
    """Seconds after which a retry may succeed (the ``Retry-After`` header; ``None``: none)."""

    def __init_subclass__(cls, *, status: int | None = None, code: str | None = None) -> None:
        super().__init_subclass__()
        if status is not None:
            cls.status = status
        if code is not None:
            cls.code = code

    def __init__(self, message: str, *, detail: Any = None, retry_after: float | None = None):
        super().__init__(message)
        self.message = message
        self.detail = detail
        if retry_after is not None:
            self.retry_after = retry_after


class InvalidInputError(ServiceError, status=422, code="invalid_input"):
    """The request parses but its content is unusable (ids, lengths, k, empty input)."""


class InvalidCacheNameError(InvalidInputError, code="invalid_cache_name"):
    """A cache name breaks the naming rule (see
    :data:`logitcache.server.serving.caches.NAME_PATTERN`)."""


class InvalidPathError(InvalidInputError, code="invalid_path"):
    """An input file path is absolute, escapes the data directory, or does not exist."""


class PayloadTooLargeError(ServiceError, status=413, code="payload_too_large"):
    """The request body, the number of sequences or a sequence's length exceeds a server limit."""


class UnauthorizedError(ServiceError, status=401, code="unauthorized"):
    """The API key is missing or wrong."""


class NotFoundError(ServiceError, status=404, code="not_found"):
    """A job or cache does not exist."""


class UnknownModelError(NotFoundError, code="model_not_found"):
    """A request names a ``model`` the service does not serve; the body also carries OpenAI's
    ``type`` and ``param``, and the served names as ``detail``."""

    extra = {"type": "NotFoundError", "param": "model"}


class ConflictError(ServiceError, status=409, code="conflict"):
    """The request contradicts existing state (a cache of another teacher, tokenizer or k)."""


class UnavailableError(ServiceError, status=503, code="unavailable"):
    """The engine is not ready or has died (``Retry-After`` when a wait is known to help)."""


class OverloadedError(ServiceError, status=429, code="overloaded"):
    """Admission control: the queue of tokens waiting for the engine is full (``Retry-After``)."""


class DeadlineExceededError(UnavailableError, code="deadline_exceeded"):
    """The request's deadline passed before the engine answered; its work was aborted."""

    retry_after = 1


class CacheBrokenError(ConflictError, code="cache_broken"):
    """A cache whose store cannot be opened (corrupt metadata, missing arrays, ...)."""


class NotACacheError(ConflictError, code="not_a_cache"):
    """The name holds a store that is not a logitcache cache (e.g. a plain zarr group)."""


class StoreNotWritableError(ConflictError, code="store_read_only"):
    """The cache store refuses writes (a read-only file system, no permission)."""


class CacheIncompleteError(ConflictError, code="cache_incomplete"):
    """A store whose creation was interrupted (no root ``zarr.json``, or one marked incomplete
    without a manifest); see ``CacheRegistry.incomplete_reason``."""


class ClientClosedError(ServiceError, status=499, code="client_closed"):
    """The client disconnected before the answer (nginx's 499; nobody reads this body)."""


#: An absolute local path inside a message: a ``/`` not preceded by a word char, ``:`` or ``/``,
#: then at least one directory component. URLs (``s3://b/p``) are left alone.
_ABS_DIRS = re.compile(r"(?<![\w:/.~-])/(?:[^\s/'\"]+/)+")


def public_message(message: str) -> str:
    """``message`` without the directories of absolute paths (only base names stay), so error
    bodies never show where the server keeps its files."""
    return _ABS_DIRS.sub("", message)


def public_name(value: str) -> str:
    """``value`` as a public body may show it: an absolute local path becomes its last
    component (``/srv/models/tiny/`` -> ``tiny``); other text as :func:`public_message`."""
    if os.path.isabs(value):
        return os.path.basename(value.rstrip("/")) or value
    return public_message(value)


def public_value(value: Any) -> Any:
    """``value`` (JSON-like) with every string through :func:`public_name`."""
    if isinstance(value, str):
        return public_name(value)
    if isinstance(value, dict):
        return {k: public_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [public_value(v) for v in value]
    return value


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
    if isinstance(exc, StoreNeedsRepairError):
        return 409, "cache_needs_repair"
    return 500, "store_error"


_HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    406: "not_acceptable",
    413: "payload_too_large",
    415: "unsupported_media_type",
}


def error_body(
    code: str, message: str, detail: Any = None, extra: dict[str, str] | None = None
) -> dict[str, Any]:
    """The one JSON error shape of the API (:class:`~logitcache.protocol.ErrorResponse`;
    ``extra``: its optional ``type`` and ``param``)."""
    return {"error": {"code": code, "message": message, "detail": detail, **(extra or {})}}


def error_response(
    status: int,
    code: str,
    message: str,
    detail: Any = None,
    headers: dict[str, str] | None = None,
    extra: dict[str, str] | None = None,
) -> Response:
    """An error body as ASCII JSON (``ensure_ascii``: a lone surrogate echoed from the request
    is escaped, never a 500), paths stripped from the message."""
    import json

    from fastapi.encoders import jsonable_encoder
    from starlette.responses import Response

    body = error_body(code, public_message(message), detail, extra)
    try:
        data = json.dumps(jsonable_encoder(body), ensure_ascii=True, allow_nan=False)
    except (TypeError, ValueError, UnicodeError):
        data = json.dumps(error_body(code, public_message(message)), ensure_ascii=True)
    return Response(data, status_code=status, media_type="application/json", headers=headers)


def _validation_details(errors: Any) -> list[dict[str, Any]]:
    """Pydantic errors without the echoed input (can be huge or not UTF-8) and context."""
    out = []
    for e in errors:
        loc = [x if isinstance(x, int) else str(x)[:200] for x in e.get("loc", ())]
        out.append({"loc": loc, "msg": str(e.get("msg", ""))[:500], "type": e.get("type")})
    return out[:50]


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at the request's path (Starlette's own ``Allow`` header
    names only the first route's methods when several routes share a path)."""
    from starlette.routing import Match

    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches({**request.scope, "method": "GET", "type": "http"})
        route_methods = getattr(route, "methods", None)
        if match != Match.NONE and route_methods:
            methods |= set(route_methods)
    return sorted(methods)


def install_error_handlers(app: FastAPI) -> None:
    """Map every error to the JSON body (any other exception: a 500 in
    :class:`~logitcache.server.api.middleware.InternalErrorMiddleware`)."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from .engine import EngineError, EngineInputError, EngineUnavailableError

    async def on_service_error(_request: Request, exc: ServiceError) -> Response:
        headers = {"WWW-Authenticate": "Bearer"} if isinstance(exc, UnauthorizedError) else None
        if exc.retry_after is not None:
            headers = {**(headers or {}), "Retry-After": str(int(exc.retry_after))}
        extra = getattr(exc, "extra", None)
        return error_response(exc.status, exc.code, exc.message, exc.detail, headers, extra)

    async def on_format_error(_request: Request, exc: FormatError) -> Response:
        status, code = format_error_status(exc)
        if status >= 500:
            log.error("cache store error: %s", exc, exc_info=exc)
            return error_response(
                status, code, f"the cache store failed ({type(exc).__name__}); see the server log"
            )
        return error_response(status, code, str(exc))

    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            headers["Allow"] = ", ".join(_allowed_methods(request))
        return error_response(exc.status_code, code, str(exc.detail), headers=headers or None)

    async def on_engine_error(_request: Request, exc: Exception) -> Response:
        if isinstance(exc, EngineInputError):
            return error_response(422, "invalid_input", str(exc))
        if isinstance(exc, EngineUnavailableError):  # the supervisor logged the death once
            log.info("engine unavailable: %s", exc)
        else:
            log.error("engine error: %s", exc)
        retry = max(1, math.ceil(getattr(exc, "retry_after", 5)))
        return error_response(
            503, "engine_unavailable", str(exc), headers={"Retry-After": str(retry)}
        )

    async def on_validation_error(_request: Request, exc: RequestValidationError) -> Response:
        details = _validation_details(exc.errors())
        first = details[0] if details else {"loc": [], "msg": ""}
        where = ".".join(str(x) for x in first["loc"] if x != "body")
        message = f"request validation failed: {where + ': ' if where else ''}{first['msg']}"
        return error_response(422, "invalid_request", message, details)

    app.add_exception_handler(ServiceError, on_service_error)  # type: ignore[arg-type]
    app.add_exception_handler(FormatError, on_format_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, on_http_error)  # type: ignore[arg-type]
    for exc_type in (EngineInputError, EngineError):  # 422 and 503
        app.add_exception_handler(exc_type, on_engine_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)  # type: ignore[arg-type]
    # any other exception: middleware.InternalErrorMiddleware (keeps the connection usable)

"""Pure ASGI middleware of the service: API-key auth, request-size limit, request metrics.

Pure ASGI (not ``BaseHTTPMiddleware``) so streaming responses pass through untouched.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from typing import TYPE_CHECKING, Any

from starlette.exceptions import HTTPException

from ..errors import error_body, error_response, log
from .ui import auth as ui_auth
from .ui.routes import PUBLIC_PATHS as UI_PUBLIC_PATHS
from .ui.routes import PUBLIC_PREFIXES

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from ..metrics import Metrics

#: Paths served without an API key (the UI's pages check the key themselves; see server/api/ui).
PUBLIC_PATHS = frozenset({"/health", *UI_PUBLIC_PATHS})


async def _send_json(send: Send, status: int, body: dict[str, Any], headers: list | None = None):
    data = json.dumps(body).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": hdrs + (headers or [])})
    await send({"type": "http.response.body", "body": data})


def _watched(send: Send, statuses: list[int]) -> Send:
    """``send`` that also appends the response's status to ``statuses`` once it starts."""

    async def watched(message: Message) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])
        await send(message)

    return watched


#: Path prefix naming a teacher: ``/teachers/<name>/v1/completions`` is ``/v1/completions``
#: for that teacher (a client that takes the first ``/v1/models`` entry as its model, as TRL's
#: do, gets one base URL per teacher).
TEACHER_PREFIX = "/teachers/"


class TeacherPrefixMiddleware:
    """Strip a :data:`TEACHER_PREFIX` ``<name>`` from the path, kept as ``state.teacher``."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and path.startswith(TEACHER_PREFIX):
            name, _, rest = path[len(TEACHER_PREFIX) :].partition("/")
            scope = {**scope, "path": "/" + rest, "raw_path": ("/" + rest).encode()}
            scope["state"] = {**scope.get("state", {}), "teacher": name}
        await self.app(scope, receive, send)


class ApiKeyMiddleware:
    """Require ``Authorization: Bearer <api_key>`` on every path but the public ones (on
    ``GET``/``HEAD`` a live login session's cookie also counts)."""

    def __init__(self, app: ASGIApp, api_key: str, sessions: ui_auth.Sessions):
        self.app = app
        self._sessions = sessions
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        got = headers.get(b"authorization", b"")
        if scope.get("method") in ui_auth.SAFE_METHODS and self._sessions.cookie_ok(
            headers.get(b"cookie", b"").decode("latin-1")
        ):
            await self.app(scope, receive, send)
            return
        if not secrets.compare_digest(got, self._expected):
            why = "missing" if not got else "invalid"
            await _send_json(
                send,
                401,
                error_body("unauthorized", f"{why} API key: send Authorization: Bearer <key>"),
                [(b"www-authenticate", b"Bearer")],
            )
            return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Answer 413 for a body over ``max_bytes`` and 408 when its next piece takes longer than
    ``timeout_s`` or the whole body longer than ``deadline_s``."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        timeout_s: float | None = None,
        deadline_s: float | None = None,
    ):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.deadline_s = deadline_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        too_large = error_body(
            "payload_too_large", f"request body exceeds the limit of {self.max_bytes} bytes"
        )
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await _send_json(send, 413, too_large)
            return
        seen = 0
        started: list[int] = []
        body_done = False
        loop = asyncio.get_running_loop()
        ends = None if self.deadline_s is None else loop.time() + self.deadline_s

        async def limited_receive() -> Message:
            nonlocal seen, body_done
            waits = [w for w in (self.timeout_s, ends and ends - loop.time()) if w is not None]
            if body_done or not waits:
                message = await receive()
            else:
                try:
                    message = await asyncio.wait_for(receive(), max(0.0, min(waits)))
                except TimeoutError:
                    raise HTTPException(
                        408,
                        f"the request body did not arrive in time ({self.timeout_s:g} s for "
                        f"each piece, {self.deadline_s:g} s in all)",
                    ) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if seen > self.max_bytes:
                    # HTTPException passes FastAPI's body parsing unchanged (-> 413 handler)
                    raise HTTPException(413, too_large["error"]["message"])
            return message

        try:
            await self.app(scope, limited_receive, _watched(send, started))
        except HTTPException as e:
            if e.status_code not in (408, 413) or started:
                raise
            if e.status_code == 413:
                await _send_json(send, 413, too_large)
            else:
                body = error_body("request_timeout", str(e.detail))
                await _send_json(send, 408, body, [(b"connection", b"close")])


class InternalErrorMiddleware:
    """Answer any unhandled exception with the JSON 500 body (the error type only; the traceback
    goes to the log) and keep the connection usable (Starlette's own handler re-raises, and
    uvicorn then closes it); an exception after the answer started is re-raised."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started: list[int] = []
        try:
            await self.app(scope, receive, _watched(send, started))
        except Exception as exc:  # noqa: BLE001 - the last net: a 500 body, never a dropped socket
            log.error("unhandled error: %r", exc, exc_info=exc)
            if started:
                raise
            response = error_response(
                500, "internal_error", f"internal server error ({type(exc).__name__}); see the log"
            )
            await response(scope, receive, send)


class MetricsMiddleware:
    """Count requests and observe latency per ``(method, route template, status)``."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        statuses: list[int] = []
        try:
            await self.app(scope, receive, _watched(send, statuses))
        finally:
            status = statuses[0] if statuses else 500
            route = scope.get("route")
            template = getattr(route, "path", None) or "<unmatched>"
            method = scope.get("method", "")
            self.metrics.requests.labels(method, template, str(status)).inc()
            self.metrics.latency.labels(method, template).observe(time.perf_counter() - t0)

"""Pure ASGI middleware of the service: API-key auth, request-size limit, request metrics.

Pure ASGI (not ``BaseHTTPMiddleware``) so streaming responses pass through untouched.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import TYPE_CHECKING, Any

from starlette.exceptions import HTTPException

from .errors import error_body

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from .metrics import Metrics

#: Paths served without an API key.
PUBLIC_PATHS = frozenset({"/health"})


async def _send_json(send: Send, status: int, body: dict[str, Any], headers: list | None = None):
    data = json.dumps(body).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": hdrs + (headers or [])})
    await send({"type": "http.response.body", "body": data})


class ApiKeyMiddleware:
    """Require ``Authorization: Bearer <api_key>`` on every path but :data:`PUBLIC_PATHS`."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        got = dict(scope["headers"]).get(b"authorization", b"")
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
    """Answer 413 for a body over ``max_bytes`` (by ``Content-Length``, or while streaming it)."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

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
        started = False

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    # HTTPException passes FastAPI's body parsing unchanged (-> 413 handler)
                    raise HTTPException(413, too_large["error"]["message"])
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except HTTPException as e:
            if e.status_code != 413 or started:
                raise
            await _send_json(send, 413, too_large)


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
        status = 500

        async def tracking_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "<unmatched>"
            method = scope.get("method", "")
            self.metrics.requests.labels(method, template, str(status)).inc()
            self.metrics.latency.labels(method, template).observe(time.perf_counter() - t0)

"""The app in-process with requests built exactly as uvicorn builds them (raw request line and
all), for tests that send what an HTTP client would normalise away (``//``, ``%2F``, ``..``,
odd ``Content-Length`` values)."""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import unquote

#: ``(status, headers (lower-case names), body)`` of one answer.
Reply = tuple[int, dict[str, str], bytes]


async def asgi_request(
    app: Any, method: str, target: str, headers: dict[str, str], body: bytes
) -> Reply:
    """One request to ``app`` with the scope uvicorn builds from the request line ``target``
    (the path percent-decoded, ``raw_path`` as sent, nothing normalised)."""
    raw_path, _, query = target.partition("?")
    hdrs = [(k.lower().encode(), v.encode("latin-1")) for k, v in headers.items()]
    hdrs += [(b"host", b"app"), (b"content-length", str(len(body)).encode())]
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
        "scheme": "http", "path": unquote(raw_path), "raw_path": raw_path.encode(),
        "query_string": query.encode(), "root_path": "", "headers": hdrs,
        "client": ("127.0.0.1", 1), "server": ("app", 80),
    }  # fmt: skip
    sent = False
    status, out_headers, chunks = 0, {}, []

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        nonlocal status, out_headers
        if message["type"] == "http.response.start":
            status = message["status"]
            out_headers = {k.decode().lower(): v.decode() for k, v in message["headers"]}
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, out_headers, b"".join(chunks)


class LiveApp:
    """``create_app(settings, engine)`` with its lifespan entered, driven request by request on
    its own event loop; :meth:`close` leaves the lifespan."""

    def __init__(self, settings: Any, engine: Any) -> None:
        from logitcache.server.app import create_app

        self.engine = engine
        self.app = create_app(settings, engine=engine)
        self.loop = asyncio.new_event_loop()
        self._life = self.app.router.lifespan_context(self.app)
        self.loop.run_until_complete(self._life.__aenter__())

    def request(self, method: str, target: str, headers: dict[str, str], body: bytes) -> Reply:
        return self.loop.run_until_complete(asgi_request(self.app, method, target, headers, body))

    def close(self) -> None:
        self.loop.run_until_complete(self._life.__aexit__(None, None, None))
        self.loop.close()

"""Connection limits of the HTTP server: what uvicorn is run with (:func:`uvicorn_options`).

A request's head must arrive within ``header_timeout_s`` (:class:`HeadDeadlineProtocol`, else the
connection is closed) and hold at most :data:`MAX_HEAD_BYTES`; past ``max_connections``
(uvicorn's ``limit_concurrency``) a new request is answered 503 at once.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

if TYPE_CHECKING:
    from ..settings import ServerSettings

#: Largest request head (request line and headers) h11 buffers, in bytes.
MAX_HEAD_BYTES = 64 * 1024


class HeadDeadlineProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
    """uvicorn's HTTP protocol (httptools, else h11) that closes a connection whose next request
    head has not arrived ``head_timeout_s`` after the connection opened or its last answer."""

    head_timeout_s: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._arm_head_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_deadline()
        super().connection_lost(exc)

    def _arm_head_deadline(self) -> None:
        self._disarm_head_deadline()
        waiting_after = self.cycle  # a new request's head replaces it
        self._head_timer = self.loop.call_later(
            self.head_timeout_s, self._head_too_late, waiting_after
        )

    def _disarm_head_deadline(self) -> None:
        timer = getattr(self, "_head_timer", None)
        if timer is not None:
            timer.cancel()
            self._head_timer = None

    def _head_too_late(self, waiting_after: Any) -> None:
        self._head_timer = None
        if self.cycle is waiting_after and not self.transport.is_closing():
            self.transport.close()


def uvicorn_options(settings: ServerSettings) -> dict[str, Any]:
    """Keyword arguments of ``uvicorn.run`` / ``uvicorn.Config`` for ``settings``'s limits."""
    protocol = type(
        "HeadDeadlineProtocol",
        (HeadDeadlineProtocol,),
        {"head_timeout_s": settings.header_timeout_s},
    )
    return {
        "http": protocol,
        "limit_concurrency": settings.max_connections,
        "h11_max_incomplete_event_size": MAX_HEAD_BYTES,
    }

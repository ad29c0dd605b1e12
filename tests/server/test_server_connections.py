"""Slow clients and many connections against the real app under real uvicorn, run with the
options ``logitcache-server`` uses (``server/api/connections.py``): a request head sent a byte at
a time and an idle connection are closed at ``header_timeout_s``, a drip-fed body is cut with 408
at ``body_deadline_s`` although every piece comes within ``body_timeout_s``, and past
``max_connections`` a request is answered 503 at once. Fake engine (fast tier)."""

from __future__ import annotations

import socket
import time

import httpx
import pytest
from engine_support import FakeEngine, app_settings
from server_support import ThreadedServer

pytestmark = pytest.mark.fast


@pytest.fixture
def srv(tmp_path):
    settings = app_settings(
        tmp_path, header_timeout_s=1.0, body_timeout_s=1.0, body_deadline_s=1.5, max_connections=4
    )
    with ThreadedServer(settings, FakeEngine()) as s:
        yield s


def _connect(srv: ThreadedServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    sock.settimeout(0.05)
    return sock


def _closed_within(sock: socket.socket, seconds: float, drip: bytes = b"") -> float | None:
    """Seconds until the server closed ``sock`` (None: still open after ``seconds``), sending
    one byte of ``drip`` every 0.2 s meanwhile."""
    t0 = time.monotonic()
    i = 0
    while time.monotonic() - t0 < seconds:
        if i < len(drip):
            try:
                sock.sendall(drip[i : i + 1])
            except OSError:
                return time.monotonic() - t0
            i += 1
        try:
            data = sock.recv(4096)
            if not data:
                return time.monotonic() - t0
        except TimeoutError:
            pass
        except OSError:
            return time.monotonic() - t0
        time.sleep(0.15)
    return None


def test_a_head_sent_a_byte_at_a_time_is_cut(srv) -> None:
    sock = _connect(srv)
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200 + b"\r\n\r\n"
    took = _closed_within(sock, 6.0, drip=head)
    sock.close()
    assert took is not None and took < 3.0, took


def test_an_idle_connection_is_closed(srv) -> None:
    sock = _connect(srv)
    took = _closed_within(sock, 6.0)
    sock.close()
    assert took is not None and took < 3.0, took


def test_keep_alive_requests_within_the_deadline_pass(srv) -> None:
    with httpx.Client(base_url=srv.url) as c:
        for _ in range(3):
            assert c.get("/health").status_code == 200
            time.sleep(0.5)  # under header_timeout_s between requests


def test_a_drip_fed_body_is_cut_with_408(srv) -> None:
    sock = _connect(srv)
    sock.sendall(
        b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n"
    )
    t0 = time.monotonic()
    got = b""
    while time.monotonic() - t0 < 6.0 and b"\r\n\r\n" not in got:
        try:
            sock.sendall(b" ")  # a piece every 0.3 s: each within body_timeout_s
            got += sock.recv(4096)
        except TimeoutError:
            pass
        except OSError:
            break
        time.sleep(0.3)
    took = time.monotonic() - t0
    sock.close()
    assert got.startswith(b"HTTP/1.1 408"), got[:200]
    assert took < 3.0, took


def test_past_max_connections_a_request_is_503(srv) -> None:
    idle = [_connect(srv) for _ in range(4)]
    try:
        time.sleep(0.2)
        r = httpx.get(f"{srv.url}/health")
        assert r.status_code == 503, r.text
    finally:
        for s in idle:
            s.close()
    time.sleep(0.2)
    assert httpx.get(f"{srv.url}/health").status_code == 200

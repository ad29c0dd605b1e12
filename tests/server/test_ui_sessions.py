"""Login sessions of the status page: a random id per login (no function of the API key), held by
the server with an expiry, ended by logout and by a restart; the cookie reads (GET/HEAD), never
writes. Real app under real uvicorn on the fake engine."""

from __future__ import annotations

import hashlib
import hmac
import time

import httpx
import pytest
from engine_support import FakeEngine, app_settings
from logitcache.server.api.ui.auth import COOKIE, Sessions
from server_support import ThreadedServer

pytestmark = pytest.mark.fast

KEY = "session-key"


def _login(url: str) -> str:
    r = httpx.post(f"{url}/login", data={"key": KEY}, follow_redirects=False)
    assert r.status_code == 303, r.text
    assert "max-age=" in r.headers["set-cookie"].lower()
    return r.cookies[COOKIE]


def _get(url: str, cookie: str, path: str = "/v1/caches") -> int:
    return httpx.get(f"{url}{path}", headers={"cookie": f"{COOKIE}={cookie}"}).status_code


def test_sessions_are_random_revoked_at_logout_and_expire(tmp_path, monkeypatch) -> None:
    settings = app_settings(tmp_path, api_key=KEY, session_ttl_s=1.5)
    now = [time.monotonic()]  # the sessions' clock: expiry does not depend on the box's speed
    with ThreadedServer(settings, FakeEngine(), api_key=KEY) as srv:
        monkeypatch.setattr(srv.app.state.ui_sessions, "_clock", lambda: now[0])
        a, b = _login(srv.url), _login(srv.url)
        old = hmac.new(KEY.encode(), b"logitcache-ui-v1", hashlib.sha256).hexdigest()
        assert a != b and old not in (a, b) and KEY not in a + b
        assert _get(srv.url, a) == 200 and _get(srv.url, b) == 200
        assert _get(srv.url, old) == 401  # the constant HMAC cookie of before is no login
        assert _get(srv.url, "forged") == 401
        # the cookie never writes
        w = httpx.post(f"{srv.url}/v1/score", json={"input_ids": [[1, 2, 3]]},
                       headers={"cookie": f"{COOKIE}={a}"})  # fmt: skip
        assert w.status_code == 401
        # logout ends that session only, even for a copy of the cookie kept elsewhere
        out = httpx.post(f"{srv.url}/logout", headers={"cookie": f"{COOKIE}={a}"})
        assert out.status_code in (200, 303)
        assert _get(srv.url, a) == 401 and _get(srv.url, b) == 200
        now[0] += 1.7  # past session_ttl_s
        assert _get(srv.url, b) == 401
        c = _login(srv.url)
        assert _get(srv.url, c) == 200
    with ThreadedServer(settings, FakeEngine(), api_key=KEY) as again:
        assert _get(again.url, c) == 401  # a restart ends every session


def test_session_table_expiry_and_bound() -> None:
    now = [0.0]
    s = Sessions(10.0, clock=lambda: now[0])
    t = s.start()
    assert s.valid(t) and not s.valid(t + "x") and not s.valid(None)
    now[0] = 9.9
    assert s.valid(t)
    now[0] = 10.0
    assert not s.valid(t)
    u = s.start()
    s.end(u)
    assert not s.valid(u)
    assert s.cookie_ok(f"other=1; {COOKIE}={s.start()}") and not s.cookie_ok("broken=\x00;;")

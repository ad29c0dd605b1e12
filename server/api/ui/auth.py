"""The status page's login sessions.

``POST /login`` with the right API key starts a session: a random id (256 bits) as the
``HttpOnly``, ``SameSite=Strict`` cookie :data:`COOKIE`, held by this process (its SHA-256)
until ``session_ttl_s``, ``POST /logout`` or a restart. The API-key middleware accepts it on
``GET``/``HEAD`` only: anything that changes state still needs ``Authorization: Bearer``.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections.abc import Callable
from http.cookies import SimpleCookie

#: Name of the login cookie.
COOKIE = "logitcache_session"

#: Methods on which the cookie stands in for the Authorization header.
SAFE_METHODS = frozenset({"GET", "HEAD"})


#: Most sessions held at once; past it the one closest to expiry is dropped.
MAX_SESSIONS = 10_000


class Sessions:
    """Login sessions of one app: random ids with their expiry (see the module docstring).
    Thread-safe; ``clock`` is ``time.monotonic`` (tests pass their own)."""

    def __init__(self, ttl_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._expiry: dict[str, float] = {}  # sha256(id) -> expiry
        self._lock = threading.Lock()

    @staticmethod
    def _digest(token: str) -> str:
        return hashlib.sha256(token.encode("utf-8", "replace")).hexdigest()

    def start(self) -> str:
        """A new session's id (the cookie value)."""
        token = secrets.token_urlsafe(32)
        now = self._clock()
        with self._lock:
            self._expiry = {d: t for d, t in self._expiry.items() if t > now}
            if len(self._expiry) >= MAX_SESSIONS:
                del self._expiry[min(self._expiry, key=self._expiry.__getitem__)]
            self._expiry[self._digest(token)] = now + self.ttl_s
        return token

    def valid(self, token: str | None) -> bool:
        """Whether ``token`` is a live session (an expired one is forgotten)."""
        if not token:
            return False
        digest = self._digest(token)
        with self._lock:
            expiry = self._expiry.get(digest)
            if expiry is None:
                return False
            if expiry <= self._clock():
                del self._expiry[digest]
                return False
            return True

    def end(self, token: str | None) -> None:
        """Forget session ``token`` (logout)."""
        if token:
            with self._lock:
                self._expiry.pop(self._digest(token), None)

    def cookie_ok(self, cookie_header: str | None) -> bool:
        """Whether ``cookie_header`` carries a live session's cookie."""
        return bool(cookie_header) and self.valid(cookie_from_header(cookie_header or ""))


def cookie_from_header(cookie_header: str) -> str | None:
    """The login cookie's value in a ``Cookie`` header, if any."""
    jar: SimpleCookie = SimpleCookie()
    try:
        jar.load(cookie_header)
    except Exception:  # a malformed Cookie header is simply no login
        return None
    morsel = jar.get(COOKIE)
    return morsel.value if morsel is not None else None

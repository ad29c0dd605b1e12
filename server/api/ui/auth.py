"""The status page's login cookie.

The login form (``POST /login``) takes the API key and, if it matches, sets the cookie
:data:`COOKIE` to :func:`cookie_token` ``(key)`` = ``HMAC-SHA256(key, "logitcache-ui-v1")`` (hex):
the key itself is never stored in the browser. The cookie is ``HttpOnly`` and ``SameSite=Strict``
(another site cannot make the browser send it), and the API-key middleware accepts it **only on
safe methods** (``GET``/``HEAD``): it lets a browser read the status page and the JSON API, while
anything that changes state (``POST /v1/jobs``, cancel) still needs ``Authorization: Bearer``.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from http.cookies import SimpleCookie

#: Name of the login cookie.
COOKIE = "logitcache_session"

#: Methods on which the cookie stands in for the Authorization header.
SAFE_METHODS = frozenset({"GET", "HEAD"})


def cookie_token(api_key: str) -> str:
    """The cookie value that proves knowledge of ``api_key``."""
    return hmac.new(api_key.encode(), b"logitcache-ui-v1", hashlib.sha256).hexdigest()


def cookie_from_header(cookie_header: str) -> str | None:
    """The login cookie's value in a ``Cookie`` header, if any."""
    jar: SimpleCookie = SimpleCookie()
    try:
        jar.load(cookie_header)
    except Exception:  # a malformed Cookie header is simply no login
        return None
    morsel = jar.get(COOKIE)
    return morsel.value if morsel is not None else None


def cookie_ok(api_key: str, cookie_header: str | None) -> bool:
    """Whether ``cookie_header`` carries a valid login cookie for ``api_key``."""
    if not cookie_header:
        return False
    got = cookie_from_header(cookie_header)
    return got is not None and secrets.compare_digest(got, cookie_token(api_key))

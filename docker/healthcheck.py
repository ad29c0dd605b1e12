"""Container health probe: exit 0 if the teacher service answers ``GET /health`` with 200.

Used by the images' ``HEALTHCHECK`` and by docker-compose. Reads the same variables as the
server (``LOGITCACHE_PORT``, default 8000) and always probes the loopback address, so it works
whatever ``LOGITCACHE_HOST`` the server binds (``0.0.0.0`` in the images). Standard library only.

Usage: ``python3 healthcheck.py [URL]`` (default ``http://127.0.0.1:$LOGITCACHE_PORT/health``).
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

TIMEOUT_S = 4.0


def health_url() -> str:
    """The probe URL: ``argv[1]`` if given, else loopback on ``$LOGITCACHE_PORT``."""
    if len(sys.argv) > 1:
        return sys.argv[1]
    port = os.environ.get("LOGITCACHE_PORT", "8000") or "8000"
    return f"http://127.0.0.1:{port}/health"


def main() -> int:
    """Return the process exit status: 0 healthy, 1 not (the reason goes to stderr)."""
    url = health_url()
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as resp:  # noqa: S310 (loopback)
            if resp.status == 200:
                return 0
            print(f"unhealthy: {url} answered {resp.status}", file=sys.stderr)
    except (urllib.error.URLError, OSError) as e:
        print(f"unhealthy: {url}: {e}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())

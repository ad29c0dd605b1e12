"""``logitcache-server`` / ``python -m logitcache.server``: run the teacher service with uvicorn.

Options come from the command line, ``LOGITCACHE_*`` environment variables and ``.env``
(see :class:`~logitcache.server.settings.ServerSettings`; ``--help`` lists them).
"""

from __future__ import annotations

import sys

import uvicorn

from . import preflight
from .app import create_app
from .settings import load_settings


def main(argv: list[str] | None = None) -> None:
    settings = load_settings(sys.argv[1:] if argv is None else argv)
    try:  # fail fast, in one line, before the engine loads (server/preflight.py)
        preflight.check(settings)
    except preflight.PreflightError as e:
        preflight.fail(str(e))
    app = create_app(settings)
    preflight.install_banner(app, settings)
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=30,
    )


if __name__ == "__main__":
    main()

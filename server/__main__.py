"""``logitcache-server`` / ``python -m logitcache.server``: run the teacher service with uvicorn.

Options come from the command line, ``LOGITCACHE_*`` environment variables and ``.env``
(see :class:`~logitcache.server.settings.ServerSettings`; ``--help`` lists them). The API key
comes from ``LOGITCACHE_API_KEY`` or ``--api-key-file`` (a command line is visible in ``ps``).
The service's own loggers (``logitcache.*``) log at ``--log-level`` (default INFO) through
uvicorn's handler, so start-up and job events are visible by default.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import uvicorn
from pydantic import ValidationError
from uvicorn.config import LOGGING_CONFIG

from . import preflight
from .api.connections import uvicorn_options
from .app import create_app
from .settings import load_settings


def log_config(level: str) -> dict[str, Any]:
    """uvicorn's logging configuration plus the ``logitcache`` logger at ``level``."""
    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["logitcache"] = {
        "handlers": ["default"],
        "level": level.upper(),
        "propagate": False,
    }
    return config


def main(argv: list[str] | None = None) -> None:
    try:
        settings = load_settings(sys.argv[1:] if argv is None else argv)
    except ValidationError as e:
        preflight.fail("; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors()))
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
        log_config=log_config(settings.log_level),
        timeout_graceful_shutdown=30,
        **uvicorn_options(settings),  # head deadline, connection limit (server/api/connections.py)
    )


if __name__ == "__main__":
    main()

"""The real app under uvicorn with the fake teacher (:class:`engine_support.FakeEngine`), as a
program: ``python tests/fake_server.py WORKDIR PORT [SETTINGS_JSON]``.

A server process without an engine's start-up cost, for tests that kill it (SIGKILL mid-load)
and for benchmarks that isolate the service's own cost from the engine's. Its store, data and
state live under ``WORKDIR`` (:func:`engine_support.app_settings`); ``SETTINGS_JSON`` overrides
settings fields. It prints ``READY`` once it answers, and serves until stopped.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv: list[str]) -> None:
    import uvicorn
    from engine_support import FakeEngine, app_settings
    from logitcache.server.app import create_app

    workdir, port = argv[0], int(argv[1])
    overrides = json.loads(argv[2]) if len(argv) > 2 else {}
    app = create_app(app_settings(workdir, **overrides), engine=FakeEngine())
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    main(sys.argv[1:])

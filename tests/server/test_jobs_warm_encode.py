"""The job runner warms the writer's compiled encode pass when it starts (issue #19), so the
first job's time does not include compiling or loading it (0.6-3.8 s on a 2-core box)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from engine_support import FakeEngine, app_settings, in_process
from logitcache.cache_format import fastencode

pytestmark = pytest.mark.fast


def test_the_encode_pass_is_settled_before_the_first_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fastencode, "_state", "unknown")  # as in a fresh process
    monkeypatch.setattr(fastencode, "_kernel", None)

    async def go() -> None:
        async with in_process(app_settings(tmp_path), FakeEngine()) as c:
            assert (await c.get("/v1/jobs")).status_code == 200
            assert fastencode._state in ("ready", "off")  # compiled (or refused), not pending

    asyncio.run(go())

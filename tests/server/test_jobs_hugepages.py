"""The job-running process stops numpy's transparent-huge-page requests (issue #19:
jobs.numpy_hugepages_off), unless NUMPY_MADVISE_HUGEPAGE says otherwise."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from engine_support import FakeEngine, app_settings, in_process
from logitcache.server import jobs

pytestmark = pytest.mark.fast

_set = np._core.multiarray._set_madvise_hugepage


@pytest.fixture
def restore() -> object:
    before = _set(True)
    yield
    _set(before)


def test_it_turns_numpy_huge_pages_off(restore: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NUMPY_MADVISE_HUGEPAGE", raising=False)
    assert jobs.numpy_hugepages_off() is True  # numpy asked for them before
    assert _set(False) is False  # and no longer does


def test_numpy_own_setting_stands(restore: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NUMPY_MADVISE_HUGEPAGE", "1")
    assert jobs.numpy_hugepages_off() is False
    assert _set(True) is True  # left on


def test_the_server_turns_them_off_when_it_starts(
    tmp_path: Path, restore: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NUMPY_MADVISE_HUGEPAGE", raising=False)

    async def go() -> None:
        async with in_process(app_settings(tmp_path), FakeEngine()) as c:
            assert (await c.get("/v1/jobs")).status_code == 200
            assert _set(False) is False

    asyncio.run(go())

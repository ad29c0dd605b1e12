"""One protocol for both sides (``logitcache.protocol``): the client's answers are the very models
the server answers with. Fast tier: the real app in-process (``httpx.ASGITransport``) behind
:class:`engine_support.FakeEngine`, driven by the real :class:`AsyncTeacherClient`."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from engine_support import FakeEngine, app_settings
from logitcache.cache_format import CacheReader
from logitcache.client import AsyncTeacherClient
from logitcache.client.errors import ConflictError, JobFailedError, NotFoundError
from logitcache.protocol import (
    TERMINAL_JOB_STATES,
    CacheInfo,
    ErrorDetail,
    Health,
    JobState,
    JobStatus,
)

pytestmark = pytest.mark.fast

SEQS = [[1, 5, 9, 20, 33], [1, 7, 7, 7, 30, 2, 250], [4, 4, 8]]


def _with_client(tmp_path: Path, body: Callable[[AsyncTeacherClient], Awaitable[Any]]) -> Any:
    """Run ``body(client)`` with an :class:`AsyncTeacherClient` talking to the app in-process."""
    from logitcache.server.app import create_app

    async def main() -> Any:
        app = create_app(app_settings(tmp_path), engine=FakeEngine())
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with AsyncTeacherClient(
                "http://app", transport=transport, progress=False, max_retries=0
            ) as client:
                return await body(client)

    return asyncio.run(main())


def test_client_answers_are_the_protocol_models(tmp_path: Path) -> None:
    async def body(c: AsyncTeacherClient) -> None:
        health = await c.health()
        assert isinstance(health, Health) and health.status == "ok" and health.k == 20
        records = [{"id": f"r{i}", "input_ids": ids} for i, ids in enumerate(SEQS)]
        job = await c.run_job("p", records=records, k=4, wait_poll_interval=0.02)
        assert isinstance(job, JobStatus)
        assert job.state is JobState.succeeded and job.state.terminal
        assert job.sequences_done == 3 and job.input is not None and job.input.records == 3
        assert isinstance(job.created_at, datetime)
        listed = await c.list_jobs()
        assert [j.id for j in listed] == [job.id] and isinstance(listed[0], JobStatus)
        info = await c.get_cache("p")
        assert isinstance(info, CacheInfo) and info.status == "ok"
        assert info.num_sequences == 3 and info.manifest["k"] == 4
        assert [x.name for x in await c.list_caches()] == ["p"]
        lengths = await c.cache_lengths("p")
        assert lengths.dtype == np.int64 and lengths.tolist() == [len(s) for s in SEQS]
        (scored,) = await c.score([SEQS[0]], k=4)
        (cached,) = CacheReader(str(tmp_path / "caches" / "p")).sequences([0])
        assert cached.key == "r0" and np.array_equal(scored.topk_ids, cached.topk_ids)
        # the API's error shape, typed: code and message of the protocol's ErrorDetail
        with pytest.raises(NotFoundError) as err:
            await c.get_job("no-such-job")
        assert isinstance(err.value.error, ErrorDetail) and err.value.code == "not_found"
        assert err.value.detail == err.value.error.message
        with pytest.raises(ConflictError) as conflict:
            await c.submit_job("p", input_ids=[[1, 2, 3]], k=2)  # the cache holds k=4
        assert conflict.value.code == "conflict"

    _with_client(tmp_path, body)


def test_a_failed_job_raises_with_its_typed_status() -> None:
    now = datetime.now(UTC)
    common: dict[str, Any] = {
        "id": "j1",
        "cache": "c",
        "k": 4,
        "created_at": now,
        "sequences_total": 2,
        "sequences_done": 1,
        "tokens_total": 10,
        "tokens_done": 5,
    }
    failed = JobStatus(state=JobState.failed, error="engine died", **common)
    err = JobFailedError(failed)
    assert err.job is failed and str(err) == "job j1 ended as failed: engine died"
    assert {s for s in JobState if s.terminal} == TERMINAL_JOB_STATES
    assert not JobStatus(state=JobState.running, **common).state.terminal

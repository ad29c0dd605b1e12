"""The job table (real SQLite) and on-demand admission: paged listing without inputs, retention
pruning, inputs stored once and compressed, old databases still read, pending job tokens, the
token gate and its 429 answer with ``Retry-After`` (real uvicorn, deterministic fake engine)."""

from __future__ import annotations

import json
import sqlite3
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from engine_support import FakeEngine
from logitcache.protocol import JobState
from logitcache.server.admission import TokenGate
from logitcache.server.job_store import JobStore
from server_support import ThreadedServer, server_settings

pytestmark = pytest.mark.fast


def _spec(n: int) -> dict:
    return {
        "cache": "c",
        "records": [{"id": f"r{i}", "input_ids": [1, 2, 3, i % 50]} for i in range(n)],
    }


def test_list_pages_without_inputs_and_get_keeps_them(tmp_path) -> None:
    store = JobStore(tmp_path / "jobs.sqlite")
    ids = [
        store.create(
            cache="c",
            k=4,
            spec=_spec(2000),
            input_digest="d",
            sequences_total=2000,
            tokens_total=8000,
        ).id
        for _ in range(5)
    ]
    page = store.list(limit=2, offset=1)
    assert [j.id for j in page] == ids[1:3]
    assert all(j.spec_json is None for j in page)
    with pytest.raises(ValueError, match="without its input"):
        _ = page[0].spec
    assert store.get(ids[0]).spec == _spec(2000)
    # stored once, compressed: far smaller than the JSON it holds
    row = store._db.execute("SELECT length(spec_z), length(spec) FROM jobs LIMIT 1").fetchone()
    raw = len(json.dumps(_spec(2000), separators=(",", ":")))
    assert row[0] < raw / 4 and row[1] == 0
    assert store.count() == 5 and store.count(JobState.queued) == 5
    assert store.pending_tokens() == 5 * 8000
    store.progress(ids[0], sequences_done=10, tokens_done=100)
    assert store.pending_tokens() == 5 * 8000 - 100
    assert [j.id for j in store.list(state=JobState.queued, limit=1)] == ids[:1]


def test_finished_jobs_are_pruned_after_retention(tmp_path) -> None:
    store = JobStore(tmp_path / "jobs.sqlite")
    done = store.create(
        cache="c", k=4, spec=_spec(1), input_digest="d", sequences_total=1, tokens_total=4
    )
    live = store.create(
        cache="c", k=4, spec=_spec(1), input_digest="d", sequences_total=1, tokens_total=4
    )
    store.finish(done.id, JobState.succeeded)
    assert store.prune(3600) == 0  # finished just now
    later = datetime.now(UTC) + timedelta(hours=2)
    assert store.prune(3600, now=later) == 1
    assert [j.id for j in store.list()] == [live.id]  # queued jobs are never pruned


def test_an_old_database_without_the_compressed_column_is_read(tmp_path) -> None:
    path = tmp_path / "jobs.sqlite"
    db = sqlite3.connect(path)
    db.execute(
        "CREATE TABLE jobs (id TEXT PRIMARY KEY, cache TEXT NOT NULL, k INTEGER NOT NULL,"
        " state TEXT NOT NULL, spec TEXT NOT NULL, input_digest TEXT NOT NULL,"
        " created_at TEXT NOT NULL, started_at TEXT, finished_at TEXT,"
        " sequences_total INTEGER NOT NULL, sequences_done INTEGER NOT NULL DEFAULT 0,"
        " tokens_total INTEGER NOT NULL, tokens_done INTEGER NOT NULL DEFAULT 0,"
        " errors TEXT NOT NULL DEFAULT '[]', cancel_requested INTEGER NOT NULL DEFAULT 0)"
    )
    db.execute(
        "INSERT INTO jobs (id, cache, k, state, spec, input_digest, created_at, sequences_total,"
        " tokens_total) VALUES ('old', 'c', 4, 'queued', ?, 'd', ?, 1, 4)",
        (json.dumps(_spec(1)), datetime.now(UTC).isoformat()),
    )
    db.commit()
    db.close()
    store = JobStore(path)
    assert store.get("old").spec == _spec(1)
    assert store.list()[0].id == "old"


def test_token_gate_admits_within_budget_and_estimates_retry() -> None:
    gate = TokenGate(100)
    assert gate.try_acquire(500)  # alone: always admitted
    assert not gate.try_acquire(1)
    gate.release(500, seconds=2.0)  # 250 tok/s observed
    assert gate.try_acquire(60) and gate.try_acquire(40) and not gate.try_acquire(1)
    assert gate.retry_after() == 1  # 100 tokens at 250 tok/s
    gate.release(60)
    gate.release(40)
    assert gate.in_flight == 0 and gate.refused == 2
    busy = TokenGate(10_000)
    busy.release(100, seconds=1.0)  # 100 tok/s
    assert busy.try_acquire(5000)
    assert busy.retry_after() == 50


def test_routes_page_jobs_and_refuse_over_budget(tmp_path) -> None:
    settings = server_settings(
        tmp_path, "fake-teacher", k=4, max_queued_tokens=50, max_pending_job_tokens=30
    )
    with ThreadedServer(settings, FakeEngine()) as srv, srv.client() as c:
        # on-demand: hold the budget as a request in flight would, then ask
        gate = srv.services.scoring.gate
        assert gate.try_acquire(45)
        r = c.post("/v1/score", json={"input_ids": [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]})
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "overloaded" and int(r.headers["retry-after"]) >= 1
        gate.release(45)
        assert c.post("/v1/score", json={"input_ids": [[1, 2, 3]]}).status_code == 200
        # jobs: accounted apart; refused once the pending job tokens reach the limit
        store = srv.services.jobs.store
        srv.services.jobs._stopping = True  # keep submitted jobs queued (pending)
        for i in range(3):
            r = c.post(
                "/v1/jobs", json={"cache": f"j{i}", "records": [{"input_ids": list(range(1, 13))}]}
            )
            assert r.status_code == 201, r.text
        assert store.pending_tokens() >= 30
        r = c.post("/v1/jobs", json={"cache": "j9", "records": [{"input_ids": [1, 2]}]})
        assert r.status_code == 429 and "retry-after" in r.headers
        assert c.post("/v1/score", json={"input_ids": [[1, 2, 3]]}).status_code == 200
        page1 = c.get("/v1/jobs", params={"limit": 2}).json()
        assert len(page1["jobs"]) == 2 and page1["next_offset"] == 2
        page2 = c.get("/v1/jobs", params={"limit": 2, "offset": 2}).json()
        assert len(page2["jobs"]) == 1 and page2["next_offset"] is None
        assert {j["id"] for j in page1["jobs"] + page2["jobs"]} == {j.id for j in store.list()}
        assert c.get("/v1/jobs", params={"limit": 0}).status_code == 422
        assert httpx.get(f"{srv.url}/health").status_code == 200


def test_starting_service_is_503_with_retry_after(tmp_path) -> None:
    import asyncio

    from logitcache.server.app import create_app

    app = create_app(server_settings(tmp_path, "fake-teacher"), engine=FakeEngine())

    async def ask() -> httpx.Response:  # no lifespan run: the service is not up yet
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
            return await c.get("/v1/jobs")

    r = asyncio.run(ask())
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    assert r.json()["error"]["code"] == "unavailable"

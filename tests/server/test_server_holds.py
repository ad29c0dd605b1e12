"""The service holds (issue #18), fast tier: the real app (in-process ``httpx.ASGITransport``, or
real uvicorn in a thread for the terminal client) on :class:`engine_support.FakeEngine`, real
zarr stores, real SQLite job table.

* caches left by a real ``SIGKILL`` during their creation are recognised at start-up and in
  ``GET /v1/caches`` (status ``incomplete`` with the reason, 409 on their routes: never a
  404/500), and completed by the next write;
* no public body shows a server path (the teacher given as a folder, store root, data dir);
* ``/health`` answers while the job table is locked (job-table reads run in worker threads);
* ``logitcache jobs submit`` (+ ``--watch``) and ``jobs list`` / the status page over more jobs
  than one page of ``GET /v1/jobs``;
* the OpenAPI schema has one operation id per operation (no FastAPI duplicate warning).
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import logging
import re
import signal
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
from engine_support import FakeEngine, app_settings, in_process
from server_support import ThreadedServer

#: Creates a cache with the format library's writer and SIGKILLs itself inside the creation:
#: before the root ``zarr.json`` is written (argv[2] = -1) or after argv[2] arrays.
_DIE_CREATING = r"""
import os, signal, sys
from logitcache.cache_format import CacheWriter, Manifest
from logitcache.cache_format import _writer as W

url, after = sys.argv[1], int(sys.argv[2])
made = 0
create_array = W.create_array

def dying(*a, **kw):
    global made
    if made == after:
        os.kill(os.getpid(), signal.SIGKILL)
    made += 1
    return create_array(*a, **kw)

W.create_array = dying
if after < 0:
    W.write_root_attrs = lambda *a, **kw: os.kill(os.getpid(), signal.SIGKILL)
m = Manifest(teacher_model="fake-teacher", tokenizer_fingerprint="fake-bytes-v1",
             vocab_size=300, k=4, logprob_dtype="float32")
CacheWriter.open(url, m)
"""


def _killed_while_creating(caches: Path, plan: dict[str, int]) -> None:
    """Leave, for each ``name: after``, the on-disk state of a process SIGKILLed while creating
    cache ``name`` (all processes run at once)."""
    procs = [
        subprocess.Popen([sys.executable, "-c", _DIE_CREATING, str(caches / name), str(after)])
        for name, after in plan.items()
    ]
    for p in procs:
        assert p.wait(timeout=120) == -signal.SIGKILL


@pytest.mark.subprocess
def test_stores_killed_during_creation_are_listed_incomplete_then_completed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caches = tmp_path / "caches"
    caches.mkdir()
    _killed_while_creating(caches, {"before-root": -1, "no-arrays": 0, "some-arrays": 3})
    assert not (caches / "before-root" / "zarr.json").exists()  # the states are the real ones
    assert "logitcache_incomplete" in (caches / "some-arrays" / "zarr.json").read_text()
    assert (caches / "some-arrays" / "topk_ids" / "zarr.json").exists()
    incomplete = ["before-root", "no-arrays", "some-arrays"]

    async def body(c: Any) -> None:
        r = await c.post("/v1/score", json={"input_ids": [[1, 2, 3]], "cache": "good"})
        assert r.status_code == 200, r.text
        listing = await c.get("/v1/caches")
        assert listing.status_code == 200, listing.text
        status = {x["name"]: x for x in listing.json()["caches"]}
        assert status["good"]["status"] == "ok"
        for name in incomplete:
            assert status[name]["status"] == "incomplete", status[name]
            assert "interrupted" in status[name]["error"]
            for route in ("", "/lengths", "/sequences"):
                r = await c.get(f"/v1/caches/{name}{route}")
                assert r.status_code == 409, (name, route, r.text)
                assert r.json()["error"]["code"] == "cache_incomplete"
        page = await c.get("/")
        assert page.status_code == 200
        assert page.text.count("incomplete:") == 3
        # repair: the next write completes the creation (a score request, and a job)
        r = await c.post(
            "/v1/score", json={"input_ids": [[1, 2, 3]], "cache": "some-arrays", "keys": ["a"]}
        )
        assert r.status_code == 200 and r.json()["stored"] == 1, r.text
        job = await c.post(
            "/v1/jobs", json={"cache": "before-root", "records": [{"input_ids": [1, 5, 6, 7]}]}
        )
        assert job.status_code == 201, job.text
        for _ in range(600):
            state = (await c.get(f"/v1/jobs/{job.json()['id']}")).json()["state"]
            if state not in ("queued", "running"):
                break
            await asyncio.sleep(0.05)
        assert state == "succeeded"
        after = {x["name"]: x for x in (await c.get("/v1/caches")).json()["caches"]}
        assert after["some-arrays"]["status"] == "ok" and after["some-arrays"]["num_sequences"] == 1
        assert after["before-root"]["status"] == "ok" and after["before-root"]["num_rows"] == 3
        assert after["no-arrays"]["status"] == "incomplete"

    with caplog.at_level(logging.WARNING, logger="logitcache.server"):

        async def main() -> None:
            async with in_process(app_settings(tmp_path), FakeEngine()) as c:
                await body(c)

        asyncio.run(main())
    warned = " ".join(r.getMessage() for r in caplog.records)
    for name in incomplete:  # recognised at start-up
        assert f"cache {name!r} is incomplete" in warned


def test_no_public_body_shows_a_server_path(tmp_path: Path) -> None:
    teacher = tmp_path / "models" / "teacher-x"
    engine = FakeEngine()
    engine.info = dataclasses.replace(engine.info, model_id=str(teacher))
    secret = str(tmp_path)
    data = tmp_path / "data"
    data.mkdir()
    (data / "in.jsonl").write_text(json.dumps({"id": "a", "input_ids": [1, 4, 5]}) + "\n")

    async def body(c: Any) -> list[tuple[str, Any]]:
        got = []
        score = await c.post("/v1/score", json={"input_ids": [[1, 2, 3]], "cache": "x"})
        job = await c.post("/v1/jobs", json={"cache": "y", "file": {"path": "in.jsonl"}})
        missing = await c.post("/v1/jobs", json={"cache": "z", "file": {"path": "nope.jsonl"}})
        got += [("score", score), ("job", job), ("missing input", missing)]
        for _ in range(600):
            r = await c.get(f"/v1/jobs/{job.json()['id']}")
            if r.json()["state"] not in ("queued", "running"):
                break
            await asyncio.sleep(0.05)
        for path in (
            "/health",
            "/v1/caches",
            "/v1/caches/x",
            "/v1/caches/y",
            "/v1/caches/absent",
            "/v1/jobs",
            f"/v1/jobs/{job.json()['id']}",
            "/v1/models",
            "/",
        ):
            got.append((path, await c.get(path)))
        return got

    async def main() -> list[tuple[str, Any]]:
        async with in_process(app_settings(tmp_path), engine) as c:
            return await body(c)

    answers = asyncio.run(main())
    for what, r in answers:
        assert r.status_code < 500, (what, r.text)
        assert secret not in r.text, (what, r.text)
    by = dict(answers)
    assert by["/v1/caches/x"].json()["manifest"]["teacher_model"] == "teacher-x"
    assert by["/health"].json()["model"] == "teacher-x"
    assert by["missing input"].status_code == 422
    assert "teacher-x" in by["/"].text


def test_public_status_drops_directories_from_job_errors() -> None:
    from datetime import UTC, datetime

    from logitcache.protocol import JobStatus
    from logitcache.server.api.deps import public_status

    job = JobStatus(
        id="j",
        cache="c",
        state="failed",
        k=4,
        created_at=datetime.now(UTC),
        sequences_total=1,
        sequences_done=0,
        tokens_total=3,
        tokens_done=0,
        error="cannot read /srv/secret/data/in.jsonl: gone",
        errors=["cannot read /srv/secret/data/in.jsonl: gone"],
    )
    shown = public_status(job)
    assert shown.error == "cannot read in.jsonl: gone" and shown.errors == [shown.error]


def test_health_answers_while_the_job_table_is_locked(tmp_path: Path) -> None:
    """Job-table calls (the routes' reads and the job runner's own, which runs right after
    start-up) wait for its lock (held by the job writer through each fsync'd commit) in worker
    threads: the event loop, and so ``/health``, never waits for them. (With the runner's
    ``next_queued`` on the loop this test took the holder's full 60 s.)"""

    async def main() -> None:
        async with in_process(app_settings(tmp_path), FakeEngine()) as c:
            store = c._transport.app.state.services.jobs.store
            held, done = threading.Event(), threading.Event()

            def hold() -> None:
                with store._lock:
                    held.set()
                    done.wait(60)

            holder = threading.Thread(target=hold)
            holder.start()
            held.wait(10)
            try:
                listing = asyncio.ensure_future(c.get("/v1/jobs"))
                await asyncio.sleep(0.2)
                health = await asyncio.wait_for(c.get("/health"), 30)
                assert health.status_code == 200
                assert not listing.done()  # still waiting for the lock, off the loop
            finally:
                done.set()
                holder.join()
            assert (await listing).status_code == 200

    asyncio.run(main())


def test_operation_ids_are_unique_without_warnings(tmp_path: Path) -> None:
    from logitcache.server.app import create_app

    app = create_app(app_settings(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # FastAPI's "Duplicate Operation ID" is a UserWarning
        schema = app.openapi()
    ids = [op["operationId"] for ops in schema["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids))
    store = schema["paths"]["/v1/caches/{name}/store/{key}"]
    assert set(store) == {"get", "head"}


def _cli(url: str, *argv: str) -> tuple[int, str]:
    from logitcache.client.cli import main

    out = io.StringIO()
    rc = main(["jobs", "--url", url, *argv], out=out)
    return rc, out.getvalue()


def test_jobs_submit_watch_list_and_status_page_over_pages(tmp_path: Path) -> None:
    """``jobs submit --watch`` runs a job to the end; with more jobs than one page of ``GET
    /v1/jobs`` (100), ``jobs list`` and the status page still reach every job."""
    from logitcache.protocol import JobState
    from logitcache.server.batch.job_store import JobStore

    settings = app_settings(tmp_path, job_retention_s=86400)
    store = JobStore(settings.job_db_path)  # 103 finished jobs already in the table
    store._db.execute("PRAGMA synchronous=OFF")  # this set-up connection only: no fsyncs
    for i in range(103):
        job = store.create(
            cache="old", k=4, spec={}, input_digest=f"d{i}", sequences_total=1, tokens_total=2
        )
        store.finish(job.id, JobState.succeeded)
    store.close()
    (tmp_path / "data" / "in.jsonl").write_text(
        "".join(json.dumps({"id": f"r{i}", "input_ids": [1, 2 + i, 3, 4]}) + "\n" for i in range(5))
    )
    local = tmp_path / "local.jsonl"
    local.write_text(json.dumps({"id": "t", "text": "hello"}) + "\n\n")
    with ThreadedServer(settings, FakeEngine()) as srv:
        rc, out = _cli(srv.url, "submit", "c", "in.jsonl", "--k", "5", "--watch",
                       "--interval", "0.05")  # fmt: skip
        assert rc == 0, out
        assert out.startswith("submitted: ") and "5/5 seqs" in out.splitlines()[-1]
        assert "succeeded" in out.splitlines()[-1]
        rc, out = _cli(srv.url, "submit", "c", "--records", str(local), "--json")
        assert rc == 0 and json.loads(out)["sequences_total"] == 1
        bad = _cli(srv.url, "submit", "c", "in.jsonl", "--records", str(local))
        assert bad[0] == 2
        with srv.client() as c:
            first = c.get("/v1/jobs").json()
            assert len(first["jobs"]) == 100 and first["next_offset"] == 100
            every = [j["id"] for j in first["jobs"]] + [
                j["id"] for j in c.get("/v1/jobs?offset=100").json()["jobs"]
            ]
            newest = c.get("/").text
            oldest = c.get("/?jobs_offset=0").text
        assert len(every) == 105
        rc, out = _cli(srv.url, "list", "--json")
        assert rc == 0 and [j["id"] for j in json.loads(out)] == every
        rc, out = _cli(srv.url, "list")
        assert rc == 0 and len(out.splitlines()) == 105
        assert "jobs 6-105 of 105" in newest and 'id="jobs-earlier"' in newest
        assert f'data-job="{every[-1]}"' in newest and f'data-job="{every[0]}"' not in newest
        assert "jobs 1-100 of 105" in oldest and 'id="jobs-later"' in oldest
        assert f'data-job="{every[0]}"' in oldest
        assert len(re.findall(r'<tr class="job"', oldest)) == 100

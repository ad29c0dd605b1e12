"""The app's lifespan with the shared real vLLM engine, through the full ASGI stack (httpx).

A graceful stop in the middle of a job (what uvicorn does on SIGTERM) puts the job back in the
queue with its committed progress; the next app on the same directories resumes and finishes it.
An engine given to ``create_app`` is the caller's: the app must not close it.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from logitcache.cache_format import CacheReader, validate
from logitcache.server.app import create_app
from logitcache.server.settings import ServerSettings

pytestmark = pytest.mark.vllm


def settings_for(tmp_path, tiny) -> ServerSettings:
    return ServerSettings(
        model=str(tiny.teacher_dir),
        k=8,
        store_root=str(tmp_path / "caches"),
        data_dir=tmp_path / "data",
        state_dir=tmp_path / "state",
        job_batch_sequences=4,
        job_write_fill_s=0,  # commit per batch group (0.1 s): the stop lands mid-job
    )


async def _poll(client: httpx.AsyncClient, job_id: str, cond, timeout: float = 300.0) -> dict:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        job = (await client.get(f"/v1/jobs/{job_id}")).raise_for_status().json()
        if cond(job):
            return job
        if loop.time() > deadline:
            raise AssertionError(f"timed out: {job}")
        await asyncio.sleep(0.02)


def test_graceful_stop_requeues_and_the_next_app_resumes(tmp_path, tiny, vllm_engine) -> None:
    seqs = tiny.token_sequences("train", max_len=96, min_len=8, limit=120)
    records = [{"id": f"s{i}", "input_ids": s} for i, s in enumerate(seqs)]
    settings = settings_for(tmp_path, tiny)

    async def first() -> tuple[str, int]:
        app = create_app(settings, engine=vllm_engine)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
                r = await c.post("/v1/jobs", json={"cache": "c", "records": records})
                assert r.status_code == 201, r.text
                job_id = r.json()["id"]
                await _poll(c, job_id, lambda j: j["sequences_done"] >= 8)
        return job_id, r.json()["sequences_total"]

    async def second(job_id: str) -> dict:
        app = create_app(settings, engine=vllm_engine)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
                before = (await c.get(f"/v1/jobs/{job_id}")).json()
                assert before["state"] in ("queued", "running"), before
                return await _poll(c, job_id, lambda j: j["state"] == "succeeded")

    job_id, total = asyncio.run(first())
    from logitcache.server.batch.job_store import JobStore

    store = JobStore(settings.job_db_path)
    stopped = store.get(job_id)
    store.close()
    assert stopped.state.value == "queued"  # not failed, not left running
    assert 0 < stopped.sequences_done < total
    assert CacheReader(tmp_path / "caches" / "c").num_sequences >= stopped.sequences_done

    done = asyncio.run(second(job_id))
    assert done["sequences_done"] == total == len(records)
    reader = CacheReader(tmp_path / "caches" / "c")
    assert sorted(reader.keys) == sorted(r["id"] for r in records)  # each exactly once
    assert validate(tmp_path / "caches" / "c").ok
    # the shared engine still works: the apps did not close it
    assert asyncio.run(vllm_engine.score([seqs[0]], 4))[0].k == 4

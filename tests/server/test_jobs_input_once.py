"""A job reads its input once (issue #19): it runs from the sequences its submission checked,
kept in memory up to the ``job_keep_input_tokens`` setting; past that budget (or after a
restart) it reads and checks the input again. Both ways store the same bytes (fake teacher, in
process)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from engine_support import FakeEngine, app_settings, in_process
from logitcache.cache_format import CacheReader
from logitcache.server import inputs
from test_jobs_targets import _done

pytestmark = pytest.mark.fast


def _stored(url: Path) -> list[tuple[Any, ...]]:
    r = CacheReader(url)
    out = []
    for i in range(r.num_sequences):
        s = r.sequence(i)
        out.append((s.key, *(np.ascontiguousarray(a).tobytes() for a in (s.input_ids, s.topk_ids))))
    return out


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache: str, **settings: Any) -> int:
    """Submit a job over a file and wait for it; returns how often the input was read."""
    reads = []
    original = inputs.raw_records

    def counted(**kw: Any) -> Any:
        reads.append(kw)
        return original(**kw)

    monkeypatch.setattr(inputs, "raw_records", counted)

    async def go() -> None:
        conf = app_settings(tmp_path, job_batch_sequences=3, **settings)
        async with in_process(conf, FakeEngine()) as c:
            body = {"cache": cache, "file": {"path": "in.jsonl"}, "k": 5}
            r = await c.post("/v1/jobs", json=body)
            assert r.status_code == 201, r.text
            job = await _done(c, r.json()["id"])
            assert job["state"] == "succeeded", job
            assert job["sequences_done"] == 9 and job["tokens_done"] == job["tokens_total"]

    asyncio.run(go())
    return len(reads)


def test_a_job_runs_from_its_checked_input_without_reading_it_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "data").mkdir()
    rows = [{"id": f"r{i}", "input_ids": [1, 2 + i, 9, 44, 3, i]} for i in range(8)]
    rows.append({"text": "a text record"})
    (tmp_path / "data" / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _run(tmp_path, monkeypatch, "once") == 1  # the submission's read only
    # too small a budget: read again to run
    assert _run(tmp_path, monkeypatch, "twice", job_keep_input_tokens=10) == 2
    once, twice = _stored(tmp_path / "caches" / "once"), _stored(tmp_path / "caches" / "twice")
    assert len(once) == 9 and once == twice


def test_a_cancelled_queued_job_drops_its_kept_input(tmp_path: Path) -> None:
    """A job cancelled before it runs leaves nothing kept (the budget is not held by it)."""
    settings = app_settings(tmp_path)

    async def go() -> None:
        async with in_process(settings, FakeEngine()) as c:
            runner = c._transport.app.state.services.jobs  # type: ignore[attr-defined]
            runner._stopping = True  # the loop takes no job: both stay queued
            runner._wake.set()
            await asyncio.sleep(0.05)
            ids = []
            for name in ("a", "b"):
                body = {"cache": name, "records": [{"input_ids": [1, 2, 3]}], "k": 5}
                r = await c.post("/v1/jobs", json=body)
                assert r.status_code == 201, r.text
                ids.append(r.json()["id"])
            assert set(runner._kept) == set(ids)
            assert (await c.delete(f"/v1/jobs/{ids[0]}")).json()["state"] == "cancelled"
            assert set(runner._kept) == {ids[1]}

    asyncio.run(go())

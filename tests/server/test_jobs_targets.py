"""A job's status says what it writes: top-k rows or sampled targets with their parameters
(issue #12), in ``GET /v1/jobs/{id}``, ``GET /v1/jobs`` and ``logitcache jobs list``, also after
a restart of the service (fake teacher, in process)."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest
from engine_support import FakeEngine, app_settings, in_process
from logitcache.client.jobs_cli import summary_line, targets_label
from logitcache.protocol import JobStatus

pytestmark = pytest.mark.fast

SAMPLED = {"draws": 16, "proposal_temperature": 1.5, "seed": 7}


async def _done(c: Any, job_id: str) -> dict[str, Any]:
    while True:
        job = (await c.get(f"/v1/jobs/{job_id}")).json()
        if job["state"] in ("succeeded", "failed", "cancelled"):
            return job
        await asyncio.sleep(0.02)


def test_job_status_and_list_show_the_targets(tmp_path: Path) -> None:
    settings = app_settings(tmp_path)
    rows = [{"id": f"r{i}", "input_ids": [1, 2 + i, 9, 44, 3]} for i in range(4)]
    (tmp_path / "data" / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    engine = FakeEngine()
    bodies = {
        "topk": {"cache": "t", "file": {"path": "in.jsonl"}, "k": 5},
        "sampled": {
            "cache": "s",
            "file": {"path": "in.jsonl"},
            "targets": "sampled",
            "sampling": SAMPLED,
        },
        # no parameters: the sampled cache's own (resolved at submission)
        "again": {
            "cache": "s",
            "records": [{"id": "x", "input_ids": [1, 2, 3]}],
            "targets": "sampled",
        },
    }
    want = {"topk": ("topk", None), "sampled": ("sampled", SAMPLED), "again": ("sampled", SAMPLED)}

    async def first() -> dict[str, str]:
        ids = {}
        async with in_process(settings, engine) as c:
            for name, body in bodies.items():
                r = await c.post("/v1/jobs", json=body)
                assert r.status_code == 201, r.text
                ids[name] = r.json()["id"]
                job = await _done(c, ids[name])
                assert job["state"] == "succeeded", job
                assert (job["targets"], job["sampling"]) == want[name], job
            listed = {j["id"]: j for j in (await c.get("/v1/jobs")).json()["jobs"]}
            for name, job_id in ids.items():
                assert (listed[job_id]["targets"], listed[job_id]["sampling"]) == want[name]
        return ids

    ids = asyncio.run(first())

    async def restarted() -> list[dict[str, Any]]:  # a new process's runner: nothing memoised
        async with in_process(settings, engine) as c:
            listed = {j["id"]: j for j in (await c.get("/v1/jobs")).json()["jobs"]}
            for name, job_id in ids.items():
                assert (listed[job_id]["targets"], listed[job_id]["sampling"]) == want[name]
                job = (await c.get(f"/v1/jobs/{job_id}")).json()
                assert (job["targets"], job["sampling"]) == want[name]
            return list(listed.values())

    listed = asyncio.run(restarted())
    lines = {j["id"]: summary_line(j) for j in listed}
    for name, label in (
        ("topk", "top-5"),
        ("sampled", "sampled 16 tau 1.5 seed 7"),
        ("again", "sampled 16 tau 1.5 seed 7"),
    ):
        assert re.search(rf"succeeded\s+\w+\s+\d+/\d+ seqs.*ETA \S+  {label}$", lines[ids[name]])


def test_targets_label_of_older_servers_and_models() -> None:
    assert targets_label({"k": 20}) == "k=20"  # a server without the field
    assert targets_label({"k": 8, "targets": "sampled", "sampling": None}) == "sampled 8"
    common = dict(
        id="j",
        cache="c",
        state="queued",
        k=4,
        created_at="2026-01-01T00:00:00Z",
        sequences_total=1,
        sequences_done=0,
        tokens_total=3,
        tokens_done=0,
    )
    assert JobStatus(**common).targets == "topk"  # the default: top-k
    with pytest.raises(ValueError):
        JobStatus(**common, targets="dense")

"""A job chooses its new cache's layout preset (``layout``, issue #14 item of #19): the store it
creates reads back with that preset (``CacheReader.layout_name``, ``logitcache info``) and the
same values as a default-layout job's; an unknown preset is a 422, another preset than an
existing cache's a 409, neither leaving a job or a cache. Real service (uvicorn in a thread,
``jobs submit --layout``), fake teacher."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from engine_support import FakeEngine, app_settings
from logitcache.cache_format import CacheReader, validate
from logitcache.cache_format.cli import app as format_cli
from server_support import ThreadedServer
from typer.testing import CliRunner

pytestmark = pytest.mark.fast


def _cli(url: str, *argv: str) -> tuple[int, str]:
    from logitcache.client.jobs_cli import main

    out = io.StringIO()
    rc = main(["--url", url, *argv], out=out)
    return rc, out.getvalue()


def _wait(c, job_id: str) -> dict:  # noqa: ANN001
    job = c.get(f"/v1/jobs/{job_id}").json()
    while job["state"] not in ("succeeded", "failed", "cancelled"):
        job = c.get(f"/v1/jobs/{job_id}").json()
    return job


def test_a_job_creates_its_cache_with_the_preset_it_names(tmp_path: Path) -> None:
    settings = app_settings(tmp_path, job_batch_sequences=4)
    rows = [{"id": f"r{i}", "input_ids": [1, 2 + i, 9, 44, 3, i, 7]} for i in range(10)]
    (tmp_path / "data" / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    caches = tmp_path / "caches"
    with ThreadedServer(settings, FakeEngine()) as srv:
        flags = ["--layout", "random_access", "--watch", "--interval", "0.05"]
        rc, out = _cli(srv.url, "submit", "ra", "in.jsonl", "--k", "8", *flags)
        assert rc == 0 and "succeeded" in out.splitlines()[-1], out
        with srv.client() as c:
            r = c.post("/v1/jobs", json={"cache": "plain", "file": {"path": "in.jsonl"}, "k": 8})
            assert r.status_code == 201, r.text
            assert r.json()["layout"] is None
            assert _wait(c, r.json()["id"])["state"] == "succeeded"
            listed = c.get("/v1/jobs").json()["jobs"]
            assert [j["layout"] for j in listed] == ["random_access", None]
            jobs_before = len(listed)
            # an unknown preset: the typed 422 of a request that fails validation
            bad = {"cache": "x", "file": {"path": "in.jsonl"}, "layout": "fastest"}
            r = c.post("/v1/jobs", json=bad)
            assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request", r.text
            assert "layout" in r.json()["error"]["message"]
            # another preset than the existing cache's: 409, no job
            for cache, layout in (("ra", "default"), ("plain", "random_access")):
                body = {"cache": cache, "file": {"path": "in.jsonl"}, "layout": layout}
                r = c.post("/v1/jobs", json=body)
                assert r.status_code == 409 and r.json()["error"]["code"] == "conflict", r.text
            # the preset it has: accepted (nothing new to write)
            body = {"cache": "ra", "file": {"path": "in.jsonl"}, "layout": "random_access"}
            r = c.post("/v1/jobs", json=body)
            assert r.status_code == 201, r.text
            assert _wait(c, r.json()["id"])["state"] == "succeeded"
            assert len(c.get("/v1/jobs").json()["jobs"]) == jobs_before + 1
        with pytest.raises(SystemExit) as exit_:  # refused by the CLI before anything is sent
            _cli(srv.url, "submit", "y", "in.jsonl", "--layout", "nope")
        assert exit_.value.code == 2
    assert not (caches / "x").exists() and not (caches / "y").exists()
    ra, plain = CacheReader(caches / "ra"), CacheReader(caches / "plain")
    assert ra.layout_name == "random_access" and plain.layout_name == "default"
    assert validate(str(caches / "ra")).ok
    assert ra.num_sequences == plain.num_sequences == 10
    for i in range(10):  # the same values, in another layout
        a, b = ra.sequence(i), plain.sequence(i)
        assert a.key == b.key
        for x, y in ((a.input_ids, b.input_ids), (a.topk_ids, b.topk_ids)):
            np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(a.topk_logprobs, b.topk_logprobs)
    res = CliRunner().invoke(format_cli, ["info", str(caches / "ra")])
    assert res.exit_code == 0, res.output
    assert any(
        line.split() == ["layout", "preset", "random_access"] for line in res.output.splitlines()
    ), res.output

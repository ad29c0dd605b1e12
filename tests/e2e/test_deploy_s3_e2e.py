"""End to end on object storage: the real teacher service (the app under uvicorn on a real port,
on the suite's in-process vLLM engine on the tiny teacher; its settings parsed from the
command-line flags ``logitcache-server`` takes, the bucket's storage options among them) writes a
cache to ``s3://bucket/caches/<name>`` on a real S3 server (moto, 127.0.0.1), and the client
streams training items straight from the bucket, without the service. The service as its own
process (``python -m logitcache.server``) is started in ``tests/server/test_server_api.py``.

Also: the container health probe (docker/healthcheck.py) against the real service. The Ray path
into a bucket (per-shard staging caches on S3, then one commit) is in test_deploy_ray.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from deploy_support import REPO, s3_bucket_fixture, s3_keys  # noqa: F401
from logitcache.cache_format import CacheReader, validate
from logitcache.client import CacheDataset, StreamConfig, open_source
from logitcache.client.http import TeacherClient
from logitcache.server.settings import load_settings
from server_support import ThreadedServer

pytestmark = pytest.mark.vllm

K = 8
CACHE = "corpus-k8"


def _texts(tiny, n: int) -> list[str]:
    out = []
    for doc in tiny.docs("heldout"):
        if len(doc.text) > 60:
            out.append(doc.text[:200])
        if len(out) == n:
            break
    return out


def _probe(port: int) -> int:
    env = {"PATH": "/usr/bin:/bin", "LOGITCACHE_PORT": str(port)}
    probe = [sys.executable, str(REPO / "docker" / "healthcheck.py")]
    return subprocess.run(probe, env=env, capture_output=True, timeout=30).returncode


def test_service_writes_to_s3_and_the_client_streams_from_it(
    tiny, vllm_engine, s3_bucket, tmp_path
):
    endpoint, bucket, options = s3_bucket
    root = f"s3://{bucket}/caches"
    texts = _texts(tiny, 10)
    work = tmp_path / "srv"
    (work / "data").mkdir(parents=True)
    settings = load_settings([
        "--model", str(tiny.teacher_dir), "-k", str(K), "--max-seq-len", "256",
        "--dtype", "float32", "--store-root", root, "--storage-options", json.dumps(options),
        "--data-dir", str(work / "data"), "--state-dir", str(work / "state"),
        "--host", "127.0.0.1", "--log-level", "warning",
    ])  # fmt: skip
    assert settings.storage_options == options
    server = ThreadedServer(settings, vllm_engine)
    with server:
        assert _probe(server.port) == 0, "the container health probe fails on a healthy server"
        with TeacherClient(server.url, progress=False, timeout=120) as client:
            job = client.run_job(CACHE, texts=texts, wait_timeout=240, wait_poll_interval=0.2)
            assert job.state == "succeeded", job
            listed = {c.name: c for c in client.list_caches()}
            assert listed[CACHE].num_sequences == len(texts)
            direct = client.score(texts=texts, k=K)  # on demand, not stored
    assert _probe(server.port) == 1, "the probe must fail once the server is gone"

    # the cache lives in the bucket, nothing under the server's working directory
    names = s3_keys(endpoint, bucket, "caches/")
    assert f"caches/{CACHE}/zarr.json" in names
    assert any(n.startswith(f"caches/{CACHE}/topk_ids/") for n in names)
    assert not (tmp_path / "srv" / "caches").exists() or not any(
        (tmp_path / "srv" / "caches").iterdir()
    )
    url = f"{root}/{CACHE}"
    assert validate(url, options).ok
    stored = CacheReader(url, storage_options=options)
    assert stored.manifest.k == K and stored.num_sequences == len(texts)

    # the trainer's side: stream padded items straight from S3, in cache (= input) order
    ds = CacheDataset(
        open_source(url, storage_options=options),
        StreamConfig(tokens_per_item=256, mode="pad", shuffle=False),
    )
    items = list(ds)
    assert len(items) == len(texts)
    for i, (item, want) in enumerate(zip(items, direct, strict=True)):
        n = int(item["attention_mask"].sum())
        assert n == len(want.input_ids)
        assert np.array_equal(item["input_ids"][:n].numpy(), want.input_ids)
        rows = item["labels"] != -100
        assert int(rows.sum()) == n - 1
        np.testing.assert_array_equal(item["labels"][: n - 1].numpy(), want.input_ids[1:])
        # exactly what is stored, and what the teacher computed (up to the float16 storage)
        rec = stored.sequence(i)
        np.testing.assert_array_equal(item["topk_ids"][: n - 1].numpy(), rec.topk_ids)
        np.testing.assert_array_equal(item["topk_logprobs"][: n - 1].numpy(), rec.topk_logprobs)
        np.testing.assert_array_equal(rec.topk_ids, want.topk_ids)
        np.testing.assert_allclose(rec.topk_logprobs, want.topk_logprobs, rtol=2e-3, atol=2e-3)

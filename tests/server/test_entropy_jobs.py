"""The service with ``entropy`` on (FORMAT.md 4.9), transformers backend on the tiny teacher:
a job and a ``/v1/score`` into a cache store each row's teacher entropy (equal to the engine's,
float16-rounded), the answers of ``/v1/score`` (JSON and frames) carry it; a cache whose flag
differs is a 409 with nothing written."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from logitcache.cache_format import CacheReader, CacheWriter, validate
from server_support import ThreadedServer, server_settings, tree_snapshot, wait_job


@pytest.fixture(scope="module")
def entropy_engine(tiny: Any) -> Iterator[Any]:
    from logitcache.server.engine import build_engine

    engine = build_engine(
        model=str(tiny.teacher_dir), backend="transformers", max_k=16, dtype="float32", entropy=True
    )
    yield engine
    asyncio.run(engine.aclose())


def test_jobs_and_score_store_the_entropy(tmp_path, tiny, entropy_engine) -> None:
    seqs = tiny.token_sequences("heldout", max_len=40, min_len=10, limit=6)
    records = [{"id": f"r{i}", "input_ids": s} for i, s in enumerate(seqs)]
    settings = server_settings(tmp_path, str(tiny.teacher_dir), backend="hf", entropy=True)
    caches = tmp_path / "caches"
    want = asyncio.run(entropy_engine.score(seqs, 8))
    with ThreadedServer(settings, entropy_engine) as srv, srv.client() as c:
        r = c.post("/v1/jobs", json={"cache": "a", "k": 8, "records": records})
        assert r.status_code == 201, r.text
        assert wait_job(c, r.json()["id"], timeout=120)["state"] == "succeeded"
        reader = CacheReader(caches / "a")
        assert reader.manifest.entropy is True and validate(caches / "a").ok
        for i, w in enumerate(want):
            got = reader.get(f"r{i}").entropy
            assert np.array_equal(got, w.entropy.astype(np.float16))
        # the loader selects the same rows over HTTP as from the store
        from logitcache.client import CacheDataset, StreamConfig, open_source

        cfg = StreamConfig(tokens_per_item=48, mode="pad", shuffle=False, entropy_top_fraction=0.5)
        local = [x["loss_mask"].tolist() for x in CacheDataset(str(caches / "a"), cfg)]
        remote = CacheDataset(open_source(srv.url, cache="a"), cfg)
        assert [x["loss_mask"].tolist() for x in remote] == local
        assert 0 < sum(map(sum, local)) < sum(len(s) - 1 for s in seqs)
        r = c.post("/v1/score", json={"input_ids": seqs[:2], "cache": "s"})
        assert r.status_code == 200, r.text
        answered = r.json()["sequences"][0]["entropy"]  # the JSON answer carries it (as stored)
        np.testing.assert_array_equal(answered, want[0].entropy.astype(np.float16))
        from logitcache.client import TeacherClient
        from logitcache.client.http import _parse_scores

        with TeacherClient(srv.url) as tc:  # the client's records (frames) carry it
            got = tc.score(input_ids=seqs[:1])
        np.testing.assert_allclose(got[0].entropy, want[0].entropy, rtol=1e-3)
        as_json = c.post(
            "/v1/score", json={"input_ids": seqs[:1]}, headers={"accept": "application/json"}
        )
        np.testing.assert_allclose(_parse_scores(as_json)[0].entropy, want[0].entropy, rtol=1e-6)
        stored = list(CacheReader(caches / "s"))
        assert len(stored) == 2 and all(s.entropy is not None for s in stored)
        np.testing.assert_array_equal(stored[0].entropy, want[0].entropy.astype(np.float16))
        # a cache made without entropy: 409, nothing written
        plain = CacheReader(caches / "a").manifest.model_copy(
            update={"entropy": False, "num_sequences": 0, "num_rows": 0, "num_tokens": 0}
        )
        with CacheWriter.open(caches / "old", plain):
            pass
        before = tree_snapshot(caches / "old")
        r = c.post("/v1/jobs", json={"cache": "old", "k": 8, "records": records})
        assert r.status_code == 409 and "entropy" in r.text, r.text
        r = c.post("/v1/score", json={"input_ids": seqs[:1], "cache": "old"})
        assert r.status_code == 409 and "entropy" in r.text, r.text
        assert tree_snapshot(caches / "old") == before


def test_distributed_targets_keep_the_entropy_flag(tmp_path, tiny) -> None:
    """``logitcache-distributed``: the final manifest keeps entropy with the setting, and an
    existing cache with the other flag is refused before anything is scored."""
    from format_support import make_manifest
    from logitcache.cache_format.errors import ManifestMismatchError
    from logitcache.server.batch import shards
    from logitcache.server.engine.config import engine_config, planned_info
    from logitcache.server.serving.targets import new_manifest

    for on in (True, False):
        settings = server_settings(tmp_path, str(tiny.teacher_dir), backend="hf", entropy=on)
        info = planned_info(engine_config(settings))
        assert new_manifest(info, settings, info.max_k, "d").entropy is on

    url = str(tmp_path / "c")
    with CacheWriter.open(url, make_manifest(k=4, vocab_size=50)):
        pass
    plain = CacheReader(url).manifest
    assert shards.check_target(url, plain, None) == frozenset()
    with pytest.raises(ManifestMismatchError, match="entropy"):
        shards.check_target(url, plain.model_copy(update={"entropy": True}), None)


def test_distributed_keeps_the_actual_token_and_commits_into_a_cache_without_it(
    tmp_path, tiny
) -> None:
    """``logitcache-distributed``: a top-k run's final manifest keeps the actual tokens'
    logprobs (FORMAT.md 4.12) with the setting; staged rows that have them commit into an
    existing cache made without the array (the values are not kept there)."""
    from dataclasses import replace

    from format_support import make_manifest, make_records
    from logitcache.server.batch import shards
    from logitcache.server.engine.config import engine_config, planned_info
    from logitcache.server.serving.targets import new_manifest

    for on in (True, False):
        settings = server_settings(tmp_path, str(tiny.teacher_dir), backend="hf", actual_logprob=on)
        info = planned_info(engine_config(settings))
        assert new_manifest(info, settings, info.max_k, "d").actual_logprob is on
    recs = make_records(3, k=4, vocab=50, seed=2)
    staged = [replace(r, actual_logprob=-np.ones(r.num_rows)) for r in recs]
    stage = str(tmp_path / "stage")
    with CacheWriter.open(stage, make_manifest(k=4, vocab_size=50, actual_logprob=True)) as w:
        w.append(staged)
    final = str(tmp_path / "final")
    old = make_manifest(k=4, vocab_size=50)
    with CacheWriter.open(final, old) as w:
        w.append(recs[:1])
    keys = tuple(r.key for r in recs)
    result = shards.ShardResult(0, stage, 3, keys, 3, sum(r.length for r in recs), 0.0)
    assert shards.commit([result], final, old.model_copy(update={"actual_logprob": True})) == 2
    got = CacheReader(final)
    assert got.num_sequences == 3 and got.manifest.actual_logprob is False

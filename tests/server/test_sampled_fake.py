"""Sampled targets around the engine, fast tier (issue #12): the fake teacher's sampled rows,
``logitcache jobs submit --targets sampled``, and the shard steps of the Ray path
(server/batch/shards.py) run in one process, all on :class:`engine_support.FakeEngine` (whose
sampled rows are the format's estimator on its own distributions). The real engines' sampled rows
have their own tests (test_sampled_targets.py, test_deploy_ray.py, test_server_restart.py)."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from engine_support import FakeEngine, app_settings, fake_logprobs, fake_sampled, in_process
from logitcache.cache_format import CacheReader, validate
from logitcache.cache_format.sampling import PAD_LOGPROB, sampling_manifest
from logitcache.server.engine import EngineInputError, SampledTargets
from server_support import ThreadedServer


def _records(n: int = 9) -> list[dict[str, Any]]:
    """Explicit ids, texts keyed by content, and one token-id record."""
    out: list[dict[str, Any]] = [
        {"id": f"r{i}", "text": f"sampled record {i}: " + "abcdefgh"[: 3 + i % 5] * (1 + i % 3)}
        for i in range(n - 2)
    ]
    out.insert(2, {"text": "a text without an id"})
    out.append({"id": "ids", "input_ids": [1, 7, 9, 44, 3, 250, 12]})
    return out


def _rows(url: Path | str) -> dict[str, tuple[bytes, ...]]:
    """Every sequence's arrays as bytes, by key (input ids, ids, log-weights, tail mass)."""
    reader = CacheReader(url)
    out = {}
    for i in range(reader.num_sequences):
        s = reader.sequence(i)
        out[s.key] = tuple(
            np.ascontiguousarray(a).tobytes()
            for a in (s.input_ids, s.topk_ids, s.topk_logprobs, s.tail_mass)
        )
    return out


def test_fake_engine_samples_its_own_distribution() -> None:
    engine = FakeEngine()
    prompts = [[1, 5, 9, 200, 7, 33, 2], [1, 2, 3, 4]]
    t = SampledTargets(draws=12, proposal_temperature=1.0, seed=4)
    got = asyncio.run(engine.score_sampled(prompts, ["a", "b"], t))
    again = asyncio.run(engine.score_sampled(prompts[::-1], ["b", "a"], t))  # order, batch
    other = asyncio.run(engine.score_sampled(prompts, ["a", "b"], SampledTargets(12, seed=5)))
    for s, ids, key in zip(got, prompts, ("a", "b"), strict=True):
        assert s.topk_ids.shape == (len(ids) - 1, 12)
        w = np.exp(s.topk_logprobs.astype(np.float64)) * (s.topk_logprobs > PAD_LOGPROB)
        np.testing.assert_allclose(w.sum(1), 1.0, atol=1e-6)
        np.testing.assert_allclose(w * 12, np.round(w * 12), atol=1e-5)  # tau 1: counts / N
        lp = fake_logprobs(ids, engine.info.vocab_size)
        drawn = np.take_along_axis(lp, s.topk_ids.astype(np.int64), 1)[w > 0]
        assert drawn.min() > np.log(1e-6)  # every draw has real mass under the teacher
        ref = fake_sampled(ids, key, t, engine.info)
        assert (s.topk_ids == ref.topk_ids).all()
    assert all((a.topk_ids == b.topk_ids).all() for a, b in zip(got, again[::-1], strict=True))
    assert any((a.topk_ids != b.topk_ids).any() for a, b in zip(got, other, strict=True))
    with pytest.raises(EngineInputError, match="draws"):
        asyncio.run(engine.score_sampled(prompts, ["a", "b"], SampledTargets(draws=301)))


def test_score_route_returns_the_fake_sampled_rows(tmp_path: Path) -> None:
    """``POST /v1/score`` with ``targets="sampled"`` on the fake teacher: the engine's sampled
    rows (keyed by the request's keys); without ``sampling``, the defaults (64 draws, seed 0)."""
    engine = FakeEngine()
    prompts = [[1, 5, 9, 200, 7, 33, 2], [1, 2, 3, 4]]
    ask = {"targets": "sampled", "sampling": {"draws": 8, "seed": 2}}

    async def main() -> list[Any]:
        async with in_process(app_settings(tmp_path), engine) as c:
            out = []
            for body in (ask, {"targets": "sampled"}, {**ask, "k": 4}):
                r = await c.post("/v1/score", json={"input_ids": prompts, "keys": ["a", "b"],
                                                    **body})  # fmt: skip
                out.append(r)
            return out

    given, default, bad = asyncio.run(main())
    assert given.status_code == 200 and given.json()["k"] == 8, given.text
    assert default.status_code == 200 and default.json()["k"] == 64, default.text
    assert bad.status_code == 422, bad.text
    for resp, t in ((given, SampledTargets(8, seed=2)), (default, SampledTargets(64))):
        for seq, ids, key in zip(resp.json()["sequences"], prompts, ("a", "b"), strict=True):
            ref = fake_sampled(ids, key, t, engine.info)
            assert seq["topk_ids"] == ref.topk_ids.tolist()
            np.testing.assert_allclose(seq["topk_logprobs"], ref.topk_logprobs, rtol=1e-6)


def _cli(url: str, *argv: str) -> tuple[int, str]:
    from logitcache.client.cli import main

    out = io.StringIO()
    rc = main(["jobs", "--url", url, *argv], out=out)
    return rc, out.getvalue()


def test_jobs_cli_submits_a_sampled_job(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """``jobs submit --targets sampled --draws --seed --proposal-temperature`` writes a sampled
    cache of the engine's own rows; a bare ``--targets sampled`` continues it with the cache's
    parameters; contradictory flags are refused by the CLI (exit 2, one line, no job)."""
    settings = app_settings(tmp_path)
    records = _records()
    (tmp_path / "data" / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    more = tmp_path / "more.jsonl"
    more.write_text(json.dumps({"id": "extra", "input_ids": [1, 2, 3, 4, 5]}) + "\n")
    engine = FakeEngine()
    with ThreadedServer(settings, engine) as srv:
        flags = ["--targets", "sampled", "--draws", "16", "--seed", "7"]
        flags += ["--proposal-temperature", "1.5", "--watch", "--interval", "0.05"]
        rc, out = _cli(srv.url, "submit", "s", "in.jsonl", *flags)
        assert rc == 0, out
        assert "succeeded" in out.splitlines()[-1] and f"{len(records)}/{len(records)}" in out
        rc, out = _cli(srv.url, "submit", "s", "--records", str(more), "--targets", "sampled",
                       "--json")  # fmt: skip
        assert rc == 0 and json.loads(out)["k"] == 16, out
        with srv.client() as c:
            job = c.get(f"/v1/jobs/{json.loads(out)['id']}").json()
            while job["state"] not in ("succeeded", "failed", "cancelled"):
                job = c.get(f"/v1/jobs/{job['id']}").json()
            assert job["state"] == "succeeded", job
            jobs_before = len(c.get("/v1/jobs").json()["jobs"])
        capsys.readouterr()  # the watched job's progress bar
        for bad, why in (
            (["--draws", "8"], "--draws only apply with --targets sampled"),
            (["--targets", "topk", "--seed", "1"], "--seed only apply with --targets sampled"),
            (["--targets", "sampled", "--k", "4"], "--k does not apply to --targets sampled"),
        ):
            rc, _ = _cli(srv.url, "submit", "t", "in.jsonl", *bad)
            err = capsys.readouterr().err
            assert rc == 2 and why in err and err.count("\n") == 1, err
        # the server's own 422 (draws beyond the vocabulary) is one line too
        rc, _ = _cli(srv.url, "submit", "t", "in.jsonl", "--targets", "sampled", "--draws", "301")
        err = capsys.readouterr().err
        assert rc == 2 and "HTTP 422" in err and "draws" in err, err
        with srv.client() as c:
            assert len(c.get("/v1/jobs").json()["jobs"]) == jobs_before
    assert not (tmp_path / "caches" / "t").exists()
    url = tmp_path / "caches" / "s"
    reader = CacheReader(url)
    assert reader.manifest.targets == "sampled"
    assert reader.manifest.sampling == sampling_manifest(16, 1.5, 7) and reader.manifest.k == 16
    assert validate(str(url)).ok
    t = SampledTargets(draws=16, proposal_temperature=1.5, seed=7)
    for i in range(reader.num_sequences):
        s = reader.sequence(i)
        ref = fake_sampled(s.input_ids.tolist(), s.key, t, engine.info)
        assert (s.topk_ids == ref.topk_ids).all(), s.key
        np.testing.assert_array_equal(s.topk_logprobs, ref.topk_logprobs)
    assert "extra" in reader.keys and len(reader.keys) == len(records) + 1


def _shards_run(engine: FakeEngine, raws: list, url: str, manifest: Any, shard_size: int) -> int:
    """The Ray path's steps in one process (server/batch/shards.py): plan, scan, check, score every
    shard into its staging cache (in reverse order: the order must not matter), commit."""
    from logitcache.server.batch import shards
    from logitcache.server.inputs import records as inputs

    limits = inputs.Limits(vocab_size=engine.info.vocab_size, max_seq_len=engine.info.max_seq_len)
    work = shards.plan_shards(raws, shard_size)
    scans = [shards.scan_shard(s, engine.tokenize, limits) for s in work]
    skips = shards.check_scans(scans, shards.check_target(url, manifest, None))
    stage = shards.staging_manifest(manifest, url)

    async def score() -> list[shards.ShardResult]:
        return [
            await shards.score_shard(
                engine,
                shards.ShardTask(s, shards.staging_url(url + ".staging", s.index), skips[s.index]),
                manifest=stage,
                limits=limits,
                batch_sequences=2,
                batch_tokens=4096,
            )
            for s in reversed(work)
        ]

    return shards.commit(asyncio.run(score()), url, manifest)


def test_shard_steps_write_the_jobs_sampled_rows(tmp_path: Path) -> None:
    """The sharded path (staging caches, commit in shard order) with sampled targets gives the
    one-process job's cache: same keys in the same order, byte-equal arrays, same identity; a
    re-run adds nothing; a top-k run into that cache is refused (one cache, one kind)."""
    from logitcache.cache_format import ManifestMismatchError
    from logitcache.server.batch.distributed import read_input
    from logitcache.server.batch.distributed_config import chosen_targets
    from logitcache.server.errors import InvalidInputError
    from logitcache.server.serving.targets import new_manifest

    settings = app_settings(tmp_path, job_batch_sequences=3)
    records = _records(11)
    path = tmp_path / "data" / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    sampling = {"draws": 10, "proposal_temperature": 1.0, "seed": 3}
    engine = FakeEngine()
    with ThreadedServer(settings, engine) as srv, srv.client() as c:
        r = c.post("/v1/jobs", json={"cache": "job", "file": {"path": "in.jsonl"},
                                     "targets": "sampled", "sampling": sampling})  # fmt: skip
        assert r.status_code == 201, r.text
        job = r.json()
        while job["state"] not in ("succeeded", "failed", "cancelled"):
            job = c.get(f"/v1/jobs/{job['id']}").json()
        assert job["state"] == "succeeded", job
    job_url = tmp_path / "caches" / "job"

    chosen = chosen_targets(SampledTargets(**sampling), None, engine.info)
    manifest = new_manifest(engine.info, settings, engine.info.max_k, "in.jsonl", chosen)
    url = str(tmp_path / "sharded")
    assert _shards_run(engine, read_input(path), url, manifest, shard_size=4) == len(records)
    a, b = CacheReader(url), CacheReader(job_url)
    assert a.keys == b.keys
    assert a.manifest.identity() == b.manifest.identity()
    assert a.manifest.sampling == sampling_manifest(10, 1.0, 3)
    assert _rows(url) == _rows(job_url)
    assert validate(url).ok
    assert _shards_run(engine, read_input(path), url, manifest, shard_size=4) == 0
    # an existing sampled cache: "sampled" takes its parameters; top-k or others are refused
    assert chosen_targets("sampled", a.manifest, engine.info) == chosen
    top = new_manifest(engine.info, settings, engine.info.max_k, "in.jsonl")
    with pytest.raises(ManifestMismatchError, match="targets"):
        _shards_run(engine, read_input(path), url, top, shard_size=4)
    with pytest.raises(InvalidInputError, match="draws"):
        chosen_targets(SampledTargets(draws=engine.info.vocab_size + 1), None, engine.info)
    with pytest.raises(InvalidInputError, match="proposal_temperature"):
        chosen_targets(SampledTargets(draws=4, proposal_temperature=0.0), None, engine.info)


def test_distributed_settings_read_the_sampled_flags(tmp_path: Path) -> None:
    """``logitcache-distributed``'s sampled flags as the run's ``targets``: the parameters given
    (defaults for the rest), ``"sampled"`` when none is given (the cache's own, else the
    defaults), ``None`` for top-k; a sampling flag without ``--targets sampled`` is refused."""
    from logitcache.server.batch.distributed_config import load_distributed_settings
    from pydantic import ValidationError

    base = ["--input", str(tmp_path / "in.jsonl"), "--cache", str(tmp_path / "c"), "--model", "m"]
    read = lambda *a: load_distributed_settings([*base, *a]).sampled_targets()  # noqa: E731
    assert read() is None and read("--targets", "topk") is None
    assert read("--targets", "sampled") == "sampled"
    got = read("--targets", "sampled", "--draws", "12", "--sampling-seed", "5")
    assert got == SampledTargets(draws=12, proposal_temperature=1.0, seed=5)
    assert read("--targets", "sampled", "--proposal-temperature", "2") == SampledTargets(64, 2.0)
    assert read("--targets", "sampled", "--head", "8") == SampledTargets(64, head=8)
    got = read("--targets", "sampled", "--draws", "4", "--head", "16")
    assert got == SampledTargets(draws=4, head=16) and got.slots == 20
    for bad in (["--draws", "4"], ["--targets", "topk", "--sampling-seed", "1"],
                ["--head", "2"], ["--targets", "sampled", "--head", "-1"],
                ["--targets", "sampled", "--draws", "0"], ["--targets", "other"]):  # fmt: skip
        with pytest.raises(ValidationError):
            read(*bad)

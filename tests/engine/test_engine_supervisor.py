"""A supervised engine (``server/engine/supervisor.py``) that dies: requests get 503
``engine_unavailable`` with ``Retry-After``, ``/health`` says so, the engine is built again, and a
job interrupted by the death resumes and ends with the cache a job run in one go makes.

Fast tier: the fake teacher, made to die after some engine calls (its ``alive`` turns false and
the call raises ``EngineUnavailableError``, as the vLLM backend's does when its process is gone).
The real engine's process is killed in ``test_engine_supervisor_vllm.py``."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from engine_support import FakeEngine, app_settings, in_process, job_done, until
from logitcache.cache_format import CacheReader
from logitcache.server.engine import EngineUnavailableError, SupervisedEngine


class MortalEngine(FakeEngine):
    """The fake teacher, dead from its ``die_after``-th engine call on (None: never)."""

    def __init__(self, die_after: int | None = None) -> None:
        super().__init__()
        self.die_after = die_after
        self.dead = False

    @property
    def alive(self) -> bool:
        return not self.dead and not self._closed

    async def _generate(self, prompts: list[list[int]], k: int, temperature: float) -> list[Any]:
        if self.die_after is not None and len(self.calls) >= self.die_after:
            self.dead = True
        if self.dead:
            raise EngineUnavailableError("the engine process died")
        return await super()._generate(prompts, k, temperature)


class Builds:
    """The supervisor's ``build``: the first engine dies after ``die_after`` calls, later ones
    live; ``delay_s`` stands for a start-up's duration."""

    def __init__(self, die_after: int | None, delay_s: float = 0.0) -> None:
        self.die_after = die_after
        self.delay_s = delay_s
        self.built: list[MortalEngine] = []

    def __call__(self) -> MortalEngine:
        if self.built:
            time.sleep(self.delay_s)
        engine = MortalEngine(self.die_after if not self.built else None)
        self.built.append(engine)
        return engine


def test_dead_engine_gives_503_with_retry_after_then_is_restarted(tmp_path: Path) -> None:
    builds = Builds(die_after=None, delay_s=1.0)
    settings = app_settings(tmp_path)

    async def run() -> None:
        engine = SupervisedEngine(builds)
        await engine.start()
        try:
            async with in_process(settings, engine) as c:
                assert (await c.get("/health")).status_code == 200
                body = {"input_ids": [[1, 5, 9, 20]], "k": 4}
                assert (await c.post("/v1/score", json=body)).status_code == 200
                builds.built[0].dead = True  # the engine process is gone
                r = await c.post("/v1/score", json=body)
                assert r.status_code == 503, r.text
                assert r.json()["error"]["code"] == "engine_unavailable", r.text
                assert int(r.headers["retry-after"]) >= 1
                health = await c.get("/health")
                assert health.status_code == 503, health.text
                assert health.json()["error"]["code"] == "engine_unavailable"
                assert "retry-after" in health.headers
                assert not engine.alive
                await until(lambda: engine.alive)
                assert engine.restarts == 1 and len(builds.built) == 2
                assert builds.built[0]._closed  # the dead one was closed (its processes ended)
                assert (await c.get("/health")).status_code == 200
                r = await c.post("/v1/score", json=body)
                assert r.status_code == 200, r.text
        finally:
            await engine.aclose()
        assert builds.built[1]._closed

    asyncio.run(run())


def test_monitor_notices_a_death_without_any_request(tmp_path: Path) -> None:
    builds = Builds(die_after=None)

    async def run() -> None:
        engine = SupervisedEngine(builds)
        await engine.start()
        try:
            builds.built[0].dead = True
            await until(lambda: engine.restarts == 1)
            assert engine.alive and engine.engine is builds.built[1]
        finally:
            await engine.aclose()

    asyncio.run(run())


def _arrays_by_key(path: Path) -> dict[str, tuple[bytes, ...]]:
    r = CacheReader(path)
    out = {}
    for i in range(r.num_sequences):
        s = r.sequence(i)
        out[s.key] = tuple(
            np.ascontiguousarray(a).tobytes()
            for a in (s.input_ids, s.topk_ids, s.topk_logprobs, s.tail_mass)
        )
    assert len(out) == r.num_sequences, "a key is stored twice"
    return out


def test_job_interrupted_by_engine_death_resumes_and_equals_one_go(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    rows = [
        {"id": f"s{i}", "input_ids": rng.integers(1, 300, size=int(rng.integers(2, 60))).tolist()}
        for i in range(60)
    ]
    settings = app_settings(tmp_path, job_batch_sequences=4)
    (tmp_path / "data" / "corpus.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    builds = Builds(die_after=5, delay_s=0.5)

    async def job(c: Any, cache: str) -> dict[str, Any]:
        r = await c.post("/v1/jobs", json={"cache": cache, "file": {"path": "corpus.jsonl"}})
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        deadline = time.monotonic() + 60
        while True:
            state = (await c.get(f"/v1/jobs/{job_id}")).json()
            if state["state"] in ("succeeded", "failed", "cancelled"):
                return state
            assert time.monotonic() < deadline, state
            await asyncio.sleep(0.05)

    async def run() -> None:
        engine = SupervisedEngine(builds)
        await engine.start()
        try:
            async with in_process(settings, engine) as c:
                resumed = await job(c, "resumed")
                assert resumed["state"] == "succeeded", resumed
                assert resumed["sequences_done"] == len(rows)
                assert engine.restarts == 1
                assert builds.built[0].dead and len(builds.built[0].calls) >= 5
                one_go = await job(c, "one-go")
                assert one_go["state"] == "succeeded", one_go
        finally:
            await engine.aclose()

    asyncio.run(run())
    resumed, one_go = (_arrays_by_key(tmp_path / "caches" / n) for n in ("resumed", "one-go"))
    assert len(resumed) == len(rows) and resumed.keys() == one_go.keys()
    assert [k for k in resumed if resumed[k] != one_go[k]] == []


def test_an_engine_given_to_the_app_is_not_restarted_and_its_job_fails(tmp_path: Path) -> None:
    """Without a supervisor nothing brings the engine back: the job fails with the reason
    (it does not wait forever)."""
    settings = app_settings(tmp_path, job_batch_sequences=2)
    (tmp_path / "data" / "c.jsonl").write_text(
        "\n".join(json.dumps({"input_ids": [1, 2, 3 + i]}) for i in range(10)) + "\n"
    )

    async def run() -> None:
        engine = MortalEngine(die_after=1)
        async with in_process(settings, engine) as c:
            r = await c.post("/v1/jobs", json={"cache": "c", "file": {"path": "c.jsonl"}})
            job_id = r.json()["id"]
            for _ in range(400):
                state = (await c.get(f"/v1/jobs/{job_id}")).json()
                if state["state"] != "queued" and state["state"] != "running":
                    break
                await asyncio.sleep(0.05)
            assert state["state"] == "failed" and "died" in state["error"], state
            r = await c.post("/v1/score", json={"input_ids": [[1, 2, 3]], "k": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"

    asyncio.run(run())


def test_weights_changed_in_place_are_a_409_after_the_engine_restarts(tmp_path: Path) -> None:
    """The restarted engine hashes its weights again (every byte, :mod:`.identity`): one changed
    byte of the weights file makes the next score into the existing cache a 409 ``conflict``,
    and nothing is written."""
    from logitcache.server.engine.identity import weights_hash
    from safetensors.numpy import save_file

    model = tmp_path / "model"
    model.mkdir()
    weights = model / "model.safetensors"
    save_file({"norm": np.ones(256, dtype=np.float32)}, str(weights))
    digests = tmp_path / "digests.json"
    built: list[MortalEngine] = []

    def build() -> MortalEngine:
        engine = MortalEngine()
        h = weights_hash(str(model), cache_path=digests)
        engine.info = replace(engine.info, weights_hash=h)
        built.append(engine)
        return engine

    settings = app_settings(tmp_path)

    async def run() -> None:
        engine = SupervisedEngine(build)
        await engine.start()
        try:
            async with in_process(settings, engine) as c:
                body = {"input_ids": [[1, 5, 9, 20]], "k": 4, "cache": "c"}
                assert (await c.post("/v1/score", json=body)).status_code == 200
                data = bytearray(weights.read_bytes())
                data[-7] ^= 0x01  # one byte of the 1 KiB tensor, in place
                with weights.open("r+b") as fh:
                    fh.write(data)
                built[0].dead = True
                await until(lambda: engine.restarts == 1)
                assert built[1].info.weights_hash != built[0].info.weights_hash
                r = await c.post("/v1/score", json={**body, "input_ids": [[1, 2, 3]]})
                assert r.status_code == 409, r.text
                assert "weights_hash" in r.text
        finally:
            await engine.aclose()
        assert CacheReader(tmp_path / "caches" / "c").num_sequences == 1

    asyncio.run(run())


def test_a_job_the_engine_keeps_dying_on_fails_after_three_deaths(tmp_path: Path) -> None:
    """An input that kills every engine (a poison pill) does not loop forever: after
    ``MAX_ENGINE_DEATHS`` deaths without a committed sequence the job fails, and the service
    scores again once the engine is back."""
    from logitcache.server.batch.jobs import MAX_ENGINE_DEATHS

    built: list[MortalEngine] = []

    def build() -> MortalEngine:
        built.append(MortalEngine(die_after=0 if len(built) < MAX_ENGINE_DEATHS else None))
        return built[-1]

    settings = app_settings(tmp_path, job_batch_sequences=2)
    (tmp_path / "data" / "c.jsonl").write_text(
        "\n".join(json.dumps({"input_ids": [1, 2, 3 + i]}) for i in range(6)) + "\n"
    )

    async def run() -> None:
        engine = SupervisedEngine(build)
        await engine.start()
        try:
            async with in_process(settings, engine) as c:
                r = await c.post("/v1/jobs", json={"cache": "c", "file": {"path": "c.jsonl"}})
                job_id = r.json()["id"]
                state = await job_done(c, job_id)
                assert state["state"] == "failed", state
                assert f"died {MAX_ENGINE_DEATHS} times" in state["error"], state
                await until(lambda: engine.alive and engine.restarts == MAX_ENGINE_DEATHS)
                r = await c.post("/v1/score", json={"input_ids": [[1, 2, 3]], "k": 2})
                assert r.status_code == 200, r.text
        finally:
            await engine.aclose()

    asyncio.run(run())

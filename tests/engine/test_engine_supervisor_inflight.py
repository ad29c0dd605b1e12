"""Calls in flight on an engine the supervisor declares dead fail at once
(``server/engine/supervisor.py``), also when the engine itself never fails them.

The order is forced: the fake engine's call hangs forever once the engine is dead (as vLLM's
requests do when ``AsyncLLM.shutdown`` cancels the output handler before it failed them), and
nothing but the supervisor's liveness check notices the death. The call must still end, with
``EngineUnavailableError`` (a job pauses and resumes), or ``EngineClosedError`` when the
supervisor is closed; the engine's side of the call is cancelled.
The real engine's processes are killed mid-job in ``test_engine_supervisor_vllm.py``."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from engine_support import FakeEngine, app_settings, in_process, job_done, until
from logitcache.cache_format import CacheReader, validate
from logitcache.server.engine import EngineClosedError, EngineUnavailableError, SupervisedEngine
from logitcache.server.engine import supervisor as supervisor_module

pytestmark = pytest.mark.fast

#: Seconds a failed call may take once the engine is dead (the monitor runs every 0.05 s here).
PROMPT_S = 10.0


class HangingEngine(FakeEngine):
    """The fake teacher; from its ``hang_at``-th engine call on (None: never) it is dead and its
    calls never return, unless cancelled (``hung`` / ``cancelled`` count them)."""

    def __init__(self, hang_at: int | None = None) -> None:
        super().__init__()
        self.hang_at = hang_at
        self.dead = False
        self.hung = 0
        self.cancelled = 0
        self.entered = asyncio.Event()

    @property
    def alive(self) -> bool:
        return not self.dead and not self._closed

    async def _generate(self, prompts: list[list[int]], k: int, temperature: float) -> list[Any]:
        if self.hang_at is not None and len(self.calls) >= self.hang_at:
            self.dead = True
            self.hung += 1
            self.entered.set()
            try:
                await asyncio.get_running_loop().create_future()  # never resolved
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        return await super()._generate(prompts, k, temperature)


class Builds:
    """The supervisor's ``build``: the first engine hangs from its ``hang_at``-th call, later
    ones work."""

    def __init__(self, hang_at: int) -> None:
        self.hang_at = hang_at
        self.built: list[HangingEngine] = []

    def __call__(self) -> HangingEngine:
        engine = HangingEngine(self.hang_at if not self.built else None)
        self.built.append(engine)
        return engine


@pytest.fixture(autouse=True)
def _fast_monitor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervisor_module, "CHECK_S", 0.05)


def test_a_call_in_flight_fails_when_the_monitor_declares_the_engine_dead() -> None:
    builds = Builds(hang_at=1)

    async def run() -> None:
        engine = SupervisedEngine(builds)
        await engine.start()
        try:
            first = builds.built[0]
            assert len(await engine.score([[1, 5, 9]], 4)) == 1
            call = asyncio.create_task(engine.score([[1, 5, 9, 20]], 4))
            await first.entered.wait()
            assert first.dead and not call.done()
            t0 = time.monotonic()
            with pytest.raises(EngineUnavailableError) as err:
                await asyncio.wait_for(call, PROMPT_S)
            assert time.monotonic() - t0 < PROMPT_S
            assert "the engine stopped" in str(err.value), err.value
            assert err.value.retry_after >= 1
            await until(lambda: first.cancelled == 1)  # the engine's side was cancelled
            await until(lambda: engine.alive)
            assert engine.restarts == 1 and first._closed
            assert len(await engine.score([[1, 5, 9, 20]], 4)) == 1
        finally:
            await engine.aclose()

    asyncio.run(run())


def test_closing_the_supervisor_fails_a_call_in_flight() -> None:
    builds = Builds(hang_at=0)

    async def run() -> None:
        engine = SupervisedEngine(builds)  # not started: no monitor notices the death
        first = builds.built[0]
        call = asyncio.create_task(engine.score([[1, 5, 9]], 4))
        await first.entered.wait()
        await asyncio.wait_for(engine.aclose(), PROMPT_S)
        with pytest.raises(EngineClosedError):
            await asyncio.wait_for(call, PROMPT_S)
        await until(lambda: first.cancelled == 1)
        assert first._closed and engine.restarts == 0

    asyncio.run(run())


@pytest.mark.timeout(120)  # a call left hanging would hang the app's shut-down too
def test_a_job_whose_engine_hangs_dead_pauses_and_resumes(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    rows = [
        {"id": f"s{i}", "input_ids": rng.integers(1, 300, size=int(rng.integers(2, 40))).tolist()}
        for i in range(40)
    ]
    settings = app_settings(tmp_path, job_batch_sequences=4)
    (tmp_path / "data" / "corpus.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    builds = Builds(hang_at=4)

    async def run() -> None:
        engine = SupervisedEngine(builds)
        await engine.start()
        try:
            async with in_process(settings, engine) as c:
                r = await c.post("/v1/jobs", json={"cache": "c", "file": {"path": "corpus.jsonl"}})
                assert r.status_code == 201, r.text
                job_id = r.json()["id"]
                job = await job_done(c, job_id)
                assert job["state"] == "succeeded", job
                assert job["sequences_done"] == len(rows)
                first = builds.built[0]
                assert engine.restarts == 1 and first.hung >= 1
                assert first.cancelled == first.hung  # no engine call left hanging
        finally:
            await engine.aclose()

    asyncio.run(run())
    assert validate(tmp_path / "caches" / "c").ok
    reader = CacheReader(tmp_path / "caches" / "c")
    keys = {reader.sequence(i).key for i in range(reader.num_sequences)}
    assert reader.num_sequences == len(rows) and keys == {r["id"] for r in rows}

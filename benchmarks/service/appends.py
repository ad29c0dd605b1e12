"""Small on-demand scoring requests into one cache: requests/s and latency with caching on.

Usage (from the repository root)::

    python -m benchmarks.service appends [--requests 600] [--concurrency 32] [--min-len 8]
        [--max-len 64] [--k 20] [--rounds 2] [--baseline REV] [--json OUT.json]

The server is the real app under uvicorn in its own process with the fake teacher
(``tests/fake_server.py``: :class:`engine_support.FakeEngine`, ~0.1 ms of numpy per sequence), so
what is measured is the service's own cost per request, the cache's read-through path
(lookup, store, commit) above all, not the engine's. ``--concurrency`` clients (one
``httpx.AsyncClient`` each, in this process) send ``--requests`` requests in all, each one
``POST /v1/score`` of one sequence of ``--min-len``..``--max-len`` random ids with
``cache="bench"``: every request is a miss, scored, stored and answered. A warm-up of a few
requests creates the cache first. Per run: requests/s (answered 200 over the wall time), p50 and
p99 latency, the server process's CPU-ms per request (psutil; the machine is shared, so
requests/s follows its load, CPU per request much less), and the check that every answered
``stored`` count is in the cache afterwards (its sequences read by :class:`CacheReader` after
the server has stopped).

With ``--baseline REV`` the same load runs against the packages of revision ``REV`` too
(``git archive``, :func:`benchmarks.harness.export_tree`), alternating with this checkout for
``--rounds`` rounds, so both are measured in one session (the machine is shared: load drifts).
Goal (issue #38): >= 100 requests/s into one cache on the 2-core VM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from benchmarks.harness import ROOT, export_tree, free_port, options, percentile, server_process
from benchmarks.service.common import mode_parser, parse, recorded

FAKE_SERVER = ROOT / "tests" / "fake_server.py"
VOCAB = 300  # the fake teacher's vocabulary
CACHE = "bench"


def fake_server(workdir: Path, tree: Path | None, k: int) -> Any:
    """``tests/fake_server.py`` in a subprocess, with this checkout's packages or ``tree``'s:
    a context yielding ``(url, process)``."""
    port = free_port()
    script = [str(FAKE_SERVER), str(workdir), str(port), json.dumps({"k": k, "max_seq_len": 512})]
    if tree is not None:
        script = ["-m", "benchmarks.harness", "with-tree", str(tree), "--", *script]
    url = f"http://127.0.0.1:{port}"
    log = workdir / "server.log"
    return server_process([sys.executable, *script], url + "/health", log=log, timeout=120,
                          every=0.2), url  # fmt: skip


def _body(rng: random.Random, lo: int, hi: int, k: int) -> dict[str, Any]:
    ids = [rng.randrange(3, VOCAB) for _ in range(rng.randint(lo, hi))]
    return {"input_ids": [ids], "k": k, "cache": CACHE}


async def _load(
    url: str, args: argparse.Namespace, seed: int, pid: int | None = None
) -> dict[str, Any]:
    """``args.requests`` requests from ``args.concurrency`` clients; latencies, counts and (with
    ``pid``) the server process's CPU seconds per request."""
    rng = random.Random(seed)
    bodies = [_body(rng, args.min_len, args.max_len, args.k) for _ in range(args.requests)]
    todo = iter(bodies)
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

    proc = psutil.Process(pid) if pid is not None else None
    cpu0 = sum(proc.cpu_times()[:2]) if proc is not None else 0.0
    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(args.concurrency)))
    wall = time.perf_counter() - t0
    cpu = sum(proc.cpu_times()[:2]) - cpu0 if proc is not None else 0.0
    return {
        "server_cpu_ms_per_request": 1e3 * cpu / max(len(lat), 1),
        "wall_s": wall,
        "status": status,
        "requests_per_s": len(lat) / wall,
        "p50_ms": 1e3 * percentile(lat, 50),
        "p99_ms": 1e3 * percentile(lat, 99),
        "mean_ms": 1e3 * statistics.fmean(lat),
        "stored": stored,
    }


def one_run(tree: Path | None, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    from logitcache.cache_format import CacheReader

    with tempfile.TemporaryDirectory(prefix="lc-appends-") as tmp:
        server, url = fake_server(Path(tmp), tree, args.k)
        with server as proc:
            warm_args = argparse.Namespace(**{**vars(args), "requests": 8, "concurrency": 2})
            warm = asyncio.run(_load(url, warm_args, seed + 1))  # creates the cache
            out = asyncio.run(_load(url, args, seed, proc.pid))
        held = CacheReader(Path(tmp) / "caches" / CACHE).num_sequences
    out["cache_sequences"] = held
    out["all_stored_readable"] = held == out["stored"] + warm["stored"]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = mode_parser("appends", __doc__)
    options(ap, requests=600, concurrency=32, min_len=8, max_len=64, k=20, rounds=2)
    options(ap, baseline=(None, "a git revision to measure beside"))
    args = parse(ap, argv)

    runs: dict[str, list[dict[str, Any]]] = {"head": []}
    with tempfile.TemporaryDirectory(prefix="lc-appends-tree-") as tmp:
        trees: dict[str, Path | None] = {"head": None}
        if args.baseline:
            trees = {"baseline": export_tree(args.baseline, Path(tmp) / "base"), "head": None}
            runs["baseline"] = []
        for r in range(args.rounds):
            for label, tree in trees.items():
                res = one_run(tree, args, seed=1000 * r)
                print(label, json.dumps(res), flush=True)
                runs[label].append(res)

    metrics = ("requests_per_s", "p50_ms", "p99_ms", "server_cpu_ms_per_request")
    summary: dict[str, Any] = {
        label: {m: statistics.median(x[m] for x in rows) for m in metrics}
        for label, rows in runs.items()
    }
    if "baseline" in runs:
        head_, base = summary["head"], summary["baseline"]
        summary["head_over_baseline_requests_per_s"] = (
            head_["requests_per_s"] / base["requests_per_s"]
        )
        summary["baseline_over_head_server_cpu_per_request"] = (
            base["server_cpu_ms_per_request"] / head_["server_cpu_ms_per_request"]
        )
    head, rec = recorded("appends", args)
    result = {
        **head,
        "engine": "fake (tests/engine_support.FakeEngine) in the server process",
        "runs": runs,
        "summary": summary,
        "all_stored_readable": all(x["all_stored_readable"] for v in runs.values() for x in v),
        "goal_met": summary["head"]["requests_per_s"] >= 100,
    }
    for label, values in summary.items():
        if isinstance(values, dict):
            rec.add_flat(label, values)
        else:
            rec.add("head vs baseline", label, "ratio", values)
    rec.finish(result, args.json)


if __name__ == "__main__":
    main()

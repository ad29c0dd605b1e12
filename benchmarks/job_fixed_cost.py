"""A batch job's fixed CPU cost: small jobs, one after another, into one cache (issue #19).

What a job costs whatever its size: its submission (HTTP, input check, job-table rows), the
cache's manifest checks, the cache's writer (opened, or taken up again), its one append's fixed
part and the job-table commits. The service runs in-process (``create_app`` over
``httpx.ASGITransport``) behind ``job_cpu_bench.py``'s replay engine; the cache first holds
``--prefill`` sequences (written untimed, by a job); then ``--jobs`` jobs of ``--job-sequences``
new sequences each are timed one by one: process CPU (``getrusage``, all threads) from the POST
to the job's end. The first timed job is reported apart (it may open the writer), the rest as
median and min. A cache of many short sequences (``--prefill-length``) shows the costs that grow
with the number of sequences (reading every committed key at a writer's open).

Usage (A/B through another tree: ``benchmarks/run_with_tree.py TREE benchmarks/job_fixed_cost.py
...``)::

    .venv/bin/python benchmarks/job_fixed_cost.py --prefill 1600 --jobs 8
    .venv/bin/python benchmarks/job_fixed_cost.py --prefill 50000 --prefill-length 8 --jobs 8
    .venv/bin/python benchmarks/job_fixed_cost.py --prefill 16 --jobs 8 --new-caches
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import job_cpu_bench as jb  # noqa: E402


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _write_jsonl(path: Path, prompts: list[list[int]], prefix: str) -> None:
    lines = (json.dumps({"id": f"{prefix}{i}", "input_ids": p}) for i, p in enumerate(prompts))
    path.write_text("\n".join(lines))


async def _job(client: Any, db: Path, file: str, cache: str = "c") -> None:
    """Submit a job over ``file`` into ``cache`` and wait for its end (succeeded or raise)."""
    r = await client.post("/v1/jobs", json={"cache": cache, "file": {"path": file}})
    r.raise_for_status()
    await jb._wait(client, db, r.json()["id"])
    state = (await client.get(f"/v1/jobs/{r.json()['id']}")).json()["state"]
    if state != "succeeded":
        raise SystemExit(f"job ended {state}")


async def run(a: argparse.Namespace, work: Path) -> list[float]:
    """CPU seconds of each timed job."""
    import httpx
    from logitcache.server.app import create_app
    from logitcache.server.settings import ServerSettings

    rng = np.random.default_rng(0)
    pre = [rng.integers(0, jb.VOCAB, a.prefill_length).tolist() for _ in range(a.prefill)]
    jobs = [
        [rng.integers(0, jb.VOCAB, a.length).tolist() for _ in range(a.job_sequences)]
        for _ in range(a.jobs)
    ]
    data = work / "data"
    data.mkdir()
    _write_jsonl(data / "pre.jsonl", pre, "p")
    for j, prompts in enumerate(jobs):
        _write_jsonl(data / f"j{j}.jsonl", prompts, f"j{j}_")
    engine = jb.build_engine(pre + [p for ps in jobs for p in ps], a.k, seed=0)
    settings = ServerSettings(
        model="replay",
        store_root=str(work / "caches"),
        data_dir=data,
        state_dir=work / "state",
        k=a.k,
        logprob_dtype="float16",
        log_level="warning",
    )
    app = create_app(settings, engine=engine)
    out = []
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
            if a.prefill:
                await _job(c, settings.job_db_path, "pre.jsonl")
            for j in range(a.jobs):
                await asyncio.sleep(a.pause)  # the writer's threads settle
                c0 = _cpu()
                await _job(
                    c, settings.job_db_path, f"j{j}.jsonl", f"new{j}" if a.new_caches else "c"
                )
                out.append(_cpu() - c0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefill", type=int, default=1600, help="sequences in the cache first")
    p.add_argument("--prefill-length", type=int, default=256, help="tokens per prefill sequence")
    p.add_argument("--jobs", type=int, default=8, help="timed jobs")
    p.add_argument("--job-sequences", type=int, default=4, help="sequences per timed job")
    p.add_argument("--length", type=int, default=256, help="tokens per timed sequence")
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--pause", type=float, default=0.2, help="seconds between timed jobs")
    p.add_argument(
        "--new-caches",
        action="store_true",
        help="every timed job into a cache of its own, made by that job (a first job into a new "
        "cache: the cache's creation and its writer's first open are in the figure)",
    )
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    if a.jobs < 2 or a.job_sequences < 1 or a.length < 2 or a.prefill_length < 2:
        p.error("--jobs >= 2, --job-sequences >= 1, --length >= 2, --prefill-length >= 2")
    load = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="job-fixed-"))
    t0 = time.perf_counter()
    try:
        cpu = asyncio.run(run(a, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ms = [c * 1e3 for c in cpu]
    result = {
        "command": " ".join(["python", "benchmarks/job_fixed_cost.py", *sys.argv[1:]]),
        "machine": f"{os.cpu_count()} CPU cores (shared), no GPU",
        "load_avg_1min_before": load,
        "load_avg_1min_after": os.getloadavg()[0],
        "wall_s": time.perf_counter() - t0,
        "new_caches": a.new_caches,
        "job_cpu_ms": ms,
        "first_ms": ms[0],
        "median_ms": statistics.median(ms[1:]),
        "min_ms": min(ms[1:]),
    }
    print(
        f"{a.job_sequences}-sequence jobs into "
        + ("new caches" if a.new_caches else f"a {a.prefill}-sequence cache")
        + ", process CPU per job: "
        f"first {ms[0]:.1f} ms, then median {result['median_ms']:.1f} (min {result['min_ms']:.1f})"
        f" ms; load {load:.1f} -> {result['load_avg_1min_after']:.1f}",
        flush=True,
    )
    if a.json:
        a.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

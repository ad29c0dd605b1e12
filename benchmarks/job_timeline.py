"""Where an in-process job's wall time goes around the engine: start, engine span, tail (issue #19).

The service runs in this process (``create_app`` over ``httpx.ASGITransport``) with the real vLLM
engine on the tiny fixture teacher; every engine call (``VllmEngine._generate``, one per job
batch) is timed. Per job: ``started_at`` -> first engine call (opening the cache, planning), the
span of the engine calls, and the last call's end -> ``finished_at`` (the last batch's records,
append, commit), with the job's tokens/s from its own timestamps, as ``server_bench.py``
computes it. ``--settings`` overrides service settings (JSON), e.g. the job batch size::

    .venv/bin/python benchmarks/job_timeline.py --jobs 4 --k 20
    .venv/bin/python benchmarks/job_timeline.py --settings '{"job_batch_tokens": 8192}'

The first job of a process pays the engine's warm-up; compare the later ones.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

from server_support import VLLM_ENV  # noqa: E402

os.environ.update(VLLM_ENV)

SPANS: list[tuple[float, float]] = []


def _time_engine_calls() -> None:
    from logitcache.server.engine.vllm import VllmEngine

    original = VllmEngine._generate

    async def timed(self: Any, prompts: list[list[int]], k: int) -> list[Any]:
        t0 = time.time()
        try:
            return await original(self, prompts, k)
        finally:
            SPANS.append((t0, time.time()))

    VllmEngine._generate = timed  # type: ignore[method-assign]


async def run(args: argparse.Namespace) -> list[dict]:
    import httpx
    import server_bench
    from logitcache.fixtures.tiny import build_tiny_models
    from logitcache.server.app import create_app
    from logitcache.server.settings import ServerSettings

    tiny = build_tiny_models()
    prompts = server_bench.make_inputs(args.length, args.sequences)
    work = Path(tempfile.mkdtemp(prefix="job-timeline-"))
    (work / "data").mkdir()
    (work / "data" / "in.jsonl").write_text(
        "\n".join(json.dumps({"id": f"w{i}", "input_ids": x}) for i, x in enumerate(prompts))
    )
    settings = ServerSettings(
        model=str(tiny.teacher_dir),
        k=max(args.k, 20),
        dtype="float32",
        max_seq_len=max(args.length, 512),
        store_root=str(work / "caches"),
        data_dir=work / "data",
        state_dir=work / "state",
        log_level="warning",
        **json.loads(args.settings),
    )
    _time_engine_calls()
    app = create_app(settings)
    out = []
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
            for n in range(args.jobs):
                SPANS.clear()
                body = {"cache": f"c{n}", "k": args.k, "file": {"path": "in.jsonl"}}
                r = await c.post("/v1/jobs", json=body)
                r.raise_for_status()
                while (job := (await c.get(f"/v1/jobs/{r.json()['id']}")).json())["state"] not in (
                    "succeeded",
                    "failed",
                    "cancelled",
                ):
                    await asyncio.sleep(0.05)
                if job["state"] != "succeeded":
                    raise SystemExit(f"job failed: {job}")
                start = datetime.fromisoformat(job["started_at"]).timestamp()
                end = datetime.fromisoformat(job["finished_at"]).timestamp()
                first, last = min(a for a, _ in SPANS), max(b for _, b in SPANS)
                row = {
                    "job": n,
                    "seconds": end - start,
                    "start_s": first - start,
                    "engine_span_s": last - first,
                    "tail_s": end - last,
                    "engine_calls": len(SPANS),
                    "tokens_per_s": job["tokens_total"] / (end - start),
                    "load_avg_1min": os.getloadavg()[0],
                }
                out.append(row)
                print(
                    f"job {n} k={args.k}: {row['seconds']:.3f} s = start {row['start_s']:.3f} "
                    f"+ engine span {row['engine_span_s']:.3f} ({len(SPANS)} calls) + tail "
                    f"{row['tail_s']:.3f}; {row['tokens_per_s']:,.0f} tok/s, "
                    f"load {row['load_avg_1min']:.1f}",
                    flush=True,
                )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sequences", type=int, default=256)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--k", type=int, default=20)
    p.add_argument("--jobs", type=int, default=4)
    p.add_argument("--settings", default="{}", help="service settings (JSON object)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    rows = asyncio.run(run(args))
    if args.json:
        cmd = " ".join(["python", "benchmarks/job_timeline.py", *sys.argv[1:]])
        args.json.write_text(json.dumps({"command": cmd, "jobs": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()

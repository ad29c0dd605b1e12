"""CPU cost per position of the batch-job path outside the engine.

The real job pipeline runs in this process (``create_app`` + ``httpx.ASGITransport``, ``POST
/v1/jobs`` over a JSONL file, ``CacheWriter`` on local disk, the SQLite job table) behind a replay
engine (:mod:`benchmarks.service.replay`: ``--form``, ``--ids``), so every CPU-second counted is
the job path's, none the model's. Measured in CPU time (``getrusage`` of the process over the job,
per position scored), split by thread (``/proc`` schedstat; a thread that ends inside the job
counts its ``thread_time()`` at its end) and by stage (``time.thread_time()`` around each, in the
thread that spends it): ``engine`` (the engine's host work less its replayed ``device`` stage,
which is reported apart and not counted), ``convert``, ``pair`` (rows as the writer's parts),
``encode`` (``writer.encode_batch``), ``compress`` (``shardwrite.encode_chunk``: blosc + CRC32C),
``write`` (shard assembly, object writes, fsyncs, renames, the commit), ``sqlite`` (progress),
``read`` (input -> batches), ``submit`` (the input checked before the job exists),
``bookkeeping`` (the job writer thread's other work), ``event_loop`` (HTTP, tasks),
``handoffs`` (``to_thread`` workers outside the stages); ``other`` is what no thread or stage
accounts for. Examples::

    python -m benchmarks.service cpu --k 20 100 --sequences 512 --length 256 --ids zipf
    python -m benchmarks.service cpu --form hf --ids random --k 100 --sequences 128 \\
        --length 2048 --repeats 3 --rate 105000

The second is the ``gpu`` mode's job at the 1B shape's H100 pace (``--rate 29000 --sigma 1.3``:
the 8B shape).
"""

from __future__ import annotations

import asyncio
import inspect
import os
import resource
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import thread_cpu
from benchmarks.service.common import parse, recorded, write_jsonl
from benchmarks.service.replay import ROWS, build_engine


class StageClock:
    """Thread-CPU seconds per stage (a stage runs in one thread at a time) and the rows of every
    append (per-append costs depend on how the job's writer grouped the batches)."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = {}
        self.appends: list[int] = []

    def add(self, name: str, seconds: float) -> None:
        self.cpu[name] = self.cpu.get(name, 0.0) + seconds

    def wrap(self, name: str, fn: Any) -> Any:
        """``fn`` timed as stage ``name``: a function, a generator function (each step), or a
        coroutine function that never suspends (its whole body runs in one step)."""
        if inspect.iscoroutinefunction(fn):

            async def timed_async(*a: Any, **kw: Any) -> Any:
                t0 = time.thread_time()
                try:
                    return await fn(*a, **kw)
                finally:
                    self.add(name, time.thread_time() - t0)

            return timed_async
        if inspect.isgeneratorfunction(fn):

            def steps(*a: Any, **kw: Any) -> Any:
                it = fn(*a, **kw)
                while True:
                    t0 = time.thread_time()
                    item = next(it, StopIteration)
                    self.add(name, time.thread_time() - t0)
                    if item is StopIteration:
                        return
                    yield item

            return steps

        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                self.add(name, time.thread_time() - t0)

        return timed

    def count_append(self, fn: Any) -> Any:
        def counted(handle: Any, records: Any) -> Any:
            records = list(records)
            self.appends.append(sum(r.num_rows for r in records))
            return fn(handle, records)

        return counted


#: Threads that ended while a job ran: ``tid -> (name, CPU seconds of the thread's whole life)``.
ENDED: dict[int, tuple[str, float]] = {}


def track_thread_ends() -> None:
    """Record every thread's CPU time as it ends (``threading.Thread.run`` wrapped once)."""
    if getattr(threading.Thread.run, "_tracked", False):
        return
    original = threading.Thread.run

    def run(self: threading.Thread) -> None:
        try:
            original(self)
        finally:
            ENDED[threading.get_native_id()] = (self.name, time.thread_time())

    run._tracked = True  # type: ignore[attr-defined]
    threading.Thread.run = run  # type: ignore[method-assign]


async def run_job(
    work: Path, engine: Any, settings_kw: dict, clock: StageClock, prefill: bool
) -> dict:
    """The timed job (after the untimed ``prefill`` job) through the app behind ``engine``, its
    stages patched into ``clock``: process CPU, wall, per-thread CPU and the job's final state."""
    import httpx
    from logitcache.cache_format import _shardwrite as shardwrite
    from logitcache.cache_format import _writer as writer
    from logitcache.cache_format import store
    from logitcache.server.app import create_app
    from logitcache.server.batch import job_store, jobs, pipeline
    from logitcache.server.serving.caches import WriterHandle
    from logitcache.server.settings import ServerSettings

    dirs = {"store_root": str(work / "caches"), "data_dir": work / "data"}
    settings = ServerSettings(model="replay", state_dir=work / "state", **dirs, **settings_kw)
    ended = threading.Event()  # set by the job table's last write of a job (no polling)
    finish = job_store.JobStore.finish

    def finished(*a: Any, **kw: Any) -> Any:
        try:
            return finish(*a, **kw)
        finally:
            ended.set()

    own = {"_convert": clock.wrap("convert", engine._convert)}
    if hasattr(engine, "_score_sync"):  # the transformers backend: its worker thread's work
        own["_score_sync"] = clock.wrap("engine", engine._score_sync)
        own["_hidden"] = clock.wrap("device", engine._hidden)  # the device's work (or replay)
        own["_topk_rows"] = clock.wrap("device", engine._topk_rows)
    else:
        own["_generate"] = clock.wrap("engine", engine._generate)
    for name, fn in own.items():  # on this engine object only, until the job ends
        setattr(engine, name, fn)
    put = store.DurableLocalStore._write_durable
    patches = [
        (pipeline, "to_batches", clock.wrap("pair", pipeline.to_batches)),
        (WriterHandle, "append", clock.wrap("append", clock.count_append(WriterHandle.append))),
        (writer, "encode_batch", clock.wrap("encode", writer.encode_batch)),
        (shardwrite, "encode_chunk", clock.wrap("compress", shardwrite.encode_chunk)),
        (store.DurableLocalStore, "_write_durable", clock.wrap("put", put)),
        (job_store.JobStore, "progress", clock.wrap("sqlite", job_store.JobStore.progress)),
        (jobs.JobRunner, "_batches", clock.wrap("read", jobs.JobRunner._batches)),
        (jobs.JobRunner, "_scan", clock.wrap("submit", jobs.JobRunner._scan)),
        (job_store.JobStore, "finish", finished),
    ]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, fn in patches:
        setattr(obj, name, fn)

    async def job(c: Any, path: str) -> str:
        r = await c.post("/v1/jobs", json={"cache": "c", "file": {"path": path}})
        job_id = r.raise_for_status().json()["id"]
        await asyncio.to_thread(ended.wait)
        ended.clear()
        return job_id

    try:
        app = create_app(settings, engine=engine)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
                if prefill:  # untimed: the cache already holds rows, as in a long job
                    await job(c, "pre.jsonl")
                    clock.cpu.clear()
                    clock.appends.clear()
                ENDED.clear()
                threads0 = thread_cpu()
                cpu0, wall0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
                job_id = await job(c, "in.jsonl")
                cpu1, wall1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
                threads1 = thread_cpu()
                state = (await c.get(f"/v1/jobs/{job_id}")).json()
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)
        for name in own:
            delattr(engine, name)
    if state["state"] != "succeeded":
        raise SystemExit(f"job failed: {state}")
    for tid, (name, cpu_s) in ENDED.items():  # ended inside the job: its whole life's CPU
        threads1.setdefault(f"{tid}:{name}", cpu_s)
    per_thread = {n: v - threads0.get(n, 0.0) for n, v in threads1.items()}
    sys_s = cpu1.ru_stime - cpu0.ru_stime
    return {
        "cpu_s": (cpu1.ru_utime - cpu0.ru_utime) + sys_s, "sys_s": sys_s,
        "wall_s": wall1 - wall0, "job": state,
        "threads": {n: v for n, v in per_thread.items() if v > 0},
    }  # fmt: skip


#: Thread name prefix -> role (the rest: ``other_threads``).
ROLES = {"asyncio_": "workers", "logitcache-forward": "workers", "job-writer": "job_writer",
         "zarr_io": "zarr_io"}  # fmt: skip


def thread_groups(per_thread: dict[str, float]) -> dict[str, float]:
    """Per-thread CPU summed by role: ``event_loop`` (the main thread) or :data:`ROLES`."""
    out = dict.fromkeys(("event_loop", "workers", "job_writer", "zarr_io", "other_threads"), 0.0)
    for key, v in per_thread.items():
        name = key.split(":", 1)[1]
        role = next((r for p, r in ROLES.items() if name.startswith(p)), "other_threads")
        out["event_loop" if name == "MainThread" else role] += v
    return out


def breakdown(stage_s: dict[str, float], groups: dict[str, float], total_s: float) -> dict:
    """Seconds per stage, each thread's CPU split into the stages it ran; ``other``: the total
    (less ``device``) less every share. The transformers backend's ``engine`` stage runs in a
    worker thread (it has a ``device`` stage), vLLM's hook on the event loop."""
    g = stage_s.get
    device = g("device", 0.0)
    out = {n: g(n, 0.0) for n in ("engine", "convert", "pair", "encode", "compress", "sqlite")}
    out["engine"] -= device
    in_loop = 0.0 if "device" in stage_s else out["engine"]
    out["read"], out["submit"] = g("read", 0.0), g("submit", 0.0)
    append, put = g("append", 0.0), g("put", 0.0)
    # compress runs in the job writer thread or in zarr's IO thread: taken once from the two
    out["write"] = max(groups["zarr_io"] + append - g("compress", 0.0) - g("encode", 0.0), 0.0)
    out["write"] += put
    out["bookkeeping"] = max(groups["job_writer"] - append - g("sqlite", 0.0), 0.0)
    out["event_loop"] = max(groups["event_loop"] - in_loop - g("convert", 0.0), 0.0)
    in_workers = g("read", 0.0) + g("submit", 0.0) + g("pair", 0.0) + put
    in_workers += g("engine", 0.0) if "device" in stage_s else 0.0
    out["handoffs"] = max(groups["workers"] - in_workers, 0.0) + groups["other_threads"]
    out["other"] = total_s - device - sum(out.values())
    return out


def one_run(
    k: int, prompts: list[list[int]], settings_kw: dict, rows: Any, form: str = "arrays",
    prefill: int = 0, rate: float = 0.0,
) -> dict:  # fmt: skip
    """One timed job over ``prompts`` behind a replay engine (:func:`replay.build_engine`)."""
    engine = build_engine(prompts, k, rows, form, rate)
    return {"form": form, "rate_tokens_per_s": rate} | job_run(
        k, prompts, settings_kw, engine, prefill
    )


def job_run(
    k: int, prompts: list[list[int]], settings_kw: dict, engine: Any, prefill: int = 0
) -> dict:
    """One timed job over ``prompts`` through the service in this process, behind ``engine``: its
    CPU per position, by stage and by thread. ``prefill``: an untimed job of that many sequences
    (the same prompts under other ids) first, so the timed appends land in partly filled shards
    as a long job's do. ``us_per_position``: the process's CPU less the ``device`` stage;
    ``outside_engine_us_per_position``: less the ``engine`` stage too."""
    work = Path(tempfile.mkdtemp(prefix="job-cpu-"))
    write_jsonl(work / "data", prompts, "in.jsonl")
    if prefill:
        again = [prompts[i % len(prompts)] for i in range(prefill)]
        write_jsonl(work / "data", again, "pre.jsonl", prefix="p")
    clock = StageClock()
    load = os.getloadavg()[0]
    res = asyncio.run(run_job(work, engine, settings_kw, clock, prefill > 0))
    shutil.rmtree(work, ignore_errors=True)
    positions = sum(len(p) - 1 for p in prompts)
    groups = thread_groups(res["threads"])
    split = breakdown(clock.cpu, groups, res["cpu_s"])
    device = clock.cpu.get("device", 0.0)

    def per(x: float) -> float:
        return x / positions * 1e6

    return {
        "k": k, "positions": positions, "cpu_s": res["cpu_s"], "wall_s": res["wall_s"],
        "positions_per_s": positions / res["wall_s"],
        "us_per_position": per(res["cpu_s"] - device),
        "outside_engine_us_per_position": per(res["cpu_s"] - device - split["engine"]),
        "device_us_per_position": per(device), "sys_us_per_position": per(res["sys_s"]),
        "appends": len(clock.appends), "rows_per_append": clock.appends,
        "prefill_sequences": prefill,
        "stage_us_per_position": {n: per(v) for n, v in split.items()},
        "load_avg_1min_before": load, "load_avg_1min_after": os.getloadavg()[0],
        "thread_cpu_s": res["threads"],
        "thread_group_us_per_position": {n: per(v) for n, v in groups.items()},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = parse(
        "cpu", __doc__, argv, k=[20, 100], sequences=256, length=256, repeats=3,
        warmup=(1, "untimed jobs of 16 sequences per k first (imports, first calls; 0: none)"),
        form=("arrays", "engine output: vLLM's through the service's array hook, or the "
              "transformers backend's own code with the device work replayed",
              {"choices": ["arrays", "hf"]}),
        prefill=(0, "sequences written (untimed) into the cache before the timed job"),
        ids=("zipf", "top-k rows: 'zipf' (the synthetic teacher over 131,072 ids, the format's "
             "bytes/position data; ~8 s to make) or 'random' (a random-weights teacher over "
             "128,256 ids, as the gpu mode scores; ~2 s)", {"choices": sorted(ROWS)}),
        rate=(0.0, "--form hf: the replayed device's pace in tokens/s (0: rows at once)"),
        sigma=(0.9, "--ids random: the logits' spread (0.9: the 1B shape, 1.3: 8B)"),
    )  # fmt: skip
    if args.sequences < 1 or args.length < 2 or args.repeats < 1:
        raise SystemExit("--sequences >= 1, --length >= 2 and --repeats >= 1 are needed")
    rows = ROWS[args.ids](sigma=args.sigma) if args.ids == "random" else ROWS[args.ids]()
    track_thread_ends()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, rows.vocab, args.length).tolist() for _ in range(args.sequences)]
    settings_kw = {"k": max(args.k), "log_level": "warning"}  # the server's job batching
    for _ in range(args.warmup):  # the first job in a process pays imports and first calls
        for k in args.k:
            one_run(k, prompts[:16], settings_kw, rows, form=args.form)
    runs = []
    for rep in range(args.repeats):
        for k in args.k:
            r = one_run(k, prompts, settings_kw, rows, args.form, args.prefill, args.rate)
            runs.append(r)
            st = ", ".join(f"{n} {v:.2f}" for n, v in r["stage_us_per_position"].items())
            print(f"k={k} rep {rep}: {r['us_per_position']:.2f} CPU-us/position (sys "
                  f"{r['sys_us_per_position']:.2f}) ({st}); {r['appends']} appends; wall "
                  f"{r['wall_s']:.1f} s, load {r['load_avg_1min_before']:.1f}")  # fmt: skip
    head, rec = recorded("cpu", args, vocab=rows.vocab)
    summary = {}
    for k in args.k:
        xs = [r["us_per_position"] for r in runs if r["k"] == k]
        med = statistics.median(xs)
        summary[str(k)] = {"median_us_per_position": med, "min_us_per_position": min(xs)}
        rec.add(f"job path k={k}", "cpu_us_per_position", "us/pos", med, p20=min(xs),
                p80=max(xs), samples=len(xs), config={"k": k})  # fmt: skip
    rec.finish(
        head | {"settings": settings_kw, "runs": runs, "summary": summary}, args.json, show=-1
    )
    print(rec.table())


if __name__ == "__main__":
    main()

"""CPU cost per position of the batch-job path outside the engine.

What a GPU engine does not pay for: after the engine produced a request's top-k rows, the job
path converts the engine's output to arrays, pairs them with the sequences, compresses,
checksums and writes them to the Zarr cache (one commit per batch), records progress in SQLite,
and runs the asyncio/thread plumbing around all that. This bench runs the **real** job pipeline
in-process (``create_app`` + ``httpx.ASGITransport``, ``POST /v1/jobs`` over a JSONL file, real
``CacheWriter`` on local disk, real SQLite job table) behind a *replay* engine
(:mod:`benchmarks.service.replay`; ``--form``: vLLM 0.32's output through the service's vLLM hook
and conversion, ``engine/vllm_rows.py``, or the transformers backend's own code with its decoder
and lm-head replaced, ``hf``; ``--ids``: which rows). So every CPU-second counted is job-path
work, none is the model's.

Measured in CPU time, not wall time (the box is shared; wall-clock ratios drift with the load):
``getrusage`` user+sys of this process over the job (microsecond resolution), divided by the
positions scored (``L - 1`` per sequence). The breakdown is by thread and by stage, every figure
measured in the thread that spends it (``time.thread_time()`` around a stage; a thread's own CPU
from ``/proc/self/task/<tid>/schedstat``, in ns, and for a thread that ends inside the job, such as
the job's writer thread, its ``thread_time()`` at its end). Stages: ``engine`` (the engine's
host work: the service's vLLM hook, which keeps vLLM 0.32's buffers or copies them, on the event
loop; or the transformers backend's batching, hand-over of each decoder batch's top-k and
per-sequence rows, in its worker thread, less its ``device`` stage: the replayed rows' making,
or on a GPU the decoder's and lm-head's launches, ``_hidden`` and ``_topk_rows``, reported apart
and not counted), ``convert`` (the engine output's rows, on the event loop),
``pair`` (``to_batches``: the rows as the writer's parts; ``to_records`` in a tree that
pairs each sequence with its rows), ``encode`` (``writer.encode_batch``: checks, float16, row
deltas, in the job writer thread), ``compress`` (``shardwrite.encode_chunk``: blosc + CRC32C,
in the job writer thread, or zarr's IO thread for an array zarr opens), ``write`` (the rest of
zarr's IO thread and of the append's shard assembly; the store's object
writes, fsyncs and renames in its ``to_thread`` workers; and the rest of ``CacheWriter.append`` in
the job writer thread: directory fsyncs, manifest commit), ``sqlite`` (progress rows), ``read``
(input -> batches, missing-key checks), ``submit`` (the whole input checked before the job exists),
``bookkeeping`` (the job writer thread's other work: progress, coverage, its queue), ``event_loop``
(the event loop thread's CPU outside ``engine`` and ``convert``: HTTP, tasks, futures), ``handoffs``
(the ``asyncio.to_thread`` workers' CPU outside the stages they run); ``other`` is what no thread or
stage accounts for (threads ended before being seen, and the difference between the clocks). The
replayed outputs are built before the clock starts and moved out of the garbage collector's sight
(``gc.freeze``): in the service an output lives only until its batch is converted, so the collector
never walks millions of them; the ``hf`` form's rows are copied from a pool as a device's
output arrives in fresh memory. The load average is recorded beside every figure.

Usage::

    python -m benchmarks.service cpu --k 20 100 --sequences 256 --length 256 --repeats 3 \\
        --ids zipf --json benchmarks/results/job_cpu.json
    python -m benchmarks.service cpu --form hf --ids random --k 100 --sequences 128 \\
        --length 2048 --repeats 3 --rate 105000

The second is the GPU mode's job (2,048-token sequences, rows over 128,256 ids) at the pace the
1B shape ran on an H100 (``--rate 29000 --sigma 1.3``: the 8B shape).
"""

from __future__ import annotations

import asyncio
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

from benchmarks.harness import Recorder, machine_line, options, thread_cpu
from benchmarks.service.common import mode_parser, parse, write_jsonl
from benchmarks.service.replay import ROWS, RandomTeacherRows, StrideRows, ZipfRows, build_engine


class StageClock:
    """Thread-CPU seconds per stage (each stage runs in one thread at a time), and the rows of
    every append (how the job's writer grouped the scored batches: per-append costs, and the
    rewrites of partly filled shards, FORMAT.md W3, depend on it)."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = {}
        self.appends: list[int] = []

    def count_append(self, fn: Any) -> Any:
        def counted(handle: Any, records: Any) -> Any:
            records = list(records)
            self.appends.append(sum(r.num_rows for r in records))
            return fn(handle, records)

        return counted

    def add(self, name: str, seconds: float) -> None:
        self.cpu[name] = self.cpu.get(name, 0.0) + seconds

    def wrap(self, name: str, fn: Any) -> Any:
        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                self.add(name, time.thread_time() - t0)

        return timed

    def wrap_async(self, name: str, fn: Any) -> Any:
        """Time a coroutine function that never suspends (its whole body runs in one step)."""

        async def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.thread_time()
            try:
                return await fn(*a, **kw)
            finally:
                self.add(name, time.thread_time() - t0)

        return timed


#: Threads that ended while a job ran: ``tid -> (name, CPU seconds of the thread's whole life)``
#: (a thread's /proc entry is gone once it ends, e.g. the job's writer thread).
ENDED: dict[int, tuple[str, float]] = {}


def _track_thread_ends() -> None:
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


def _signal_finish(finish: Any, ended: threading.Event) -> Any:
    """``JobStore.finish`` that also sets ``ended`` (the job table's last write of a job)."""

    def finished(*a: Any, **kw: Any) -> Any:
        try:
            return finish(*a, **kw)
        finally:
            ended.set()

    return finished


async def _wait(ended: threading.Event) -> None:
    """Until the job ends, without polling (a poll of the job table every 50 ms cost ~0.15
    CPU-us/position of event-loop time at 29K positions/s: the bench's, not the job's)."""
    await asyncio.to_thread(ended.wait)
    ended.clear()


async def run_job(
    work: Path, engine: Any, settings_kw: dict, clock: StageClock, prefill: bool = False
) -> dict:
    import httpx
    from logitcache.server.app import create_app
    from logitcache.server.batch import job_store, jobs, pipeline
    from logitcache.server.serving.caches import WriterHandle
    from logitcache.server.settings import ServerSettings

    settings = ServerSettings(
        model="replay",
        store_root=str(work / "caches"),
        data_dir=work / "data",
        state_dir=work / "state",
        **settings_kw,
    )
    from logitcache.cache_format import _shardwrite as shardwrite
    from logitcache.cache_format import _writer as writer
    from logitcache.cache_format import store

    put_durable = store.DurableLocalStore._write_durable
    ended = threading.Event()

    own = {"_convert": clock.wrap("convert", engine._convert)}
    if hasattr(engine, "_score_sync"):  # the transformers backend: its worker thread's work
        own["_score_sync"] = clock.wrap("engine", engine._score_sync)
        own["_hidden"] = clock.wrap("device", engine._hidden)  # the device's work (or replay)
        own["_topk_rows"] = clock.wrap("device", engine._topk_rows)
    else:
        own["_generate"] = clock.wrap_async("engine", engine._generate)
    for name, fn in own.items():  # on this engine object only, until the job ends
        setattr(engine, name, fn)
    # the engine's rows as the writer takes them: parts (to_batches), or records in a tree
    # that pairs each sequence with its rows (to_records)
    pair = "to_batches" if hasattr(pipeline, "to_batches") else "to_records"
    patches = [
        (pipeline, pair, clock.wrap("pair", getattr(pipeline, pair))),
        (WriterHandle, "append", clock.wrap("append", clock.count_append(WriterHandle.append))),
        (writer, "encode_batch", clock.wrap("encode", writer.encode_batch)),
        (shardwrite, "encode_chunk", clock.wrap("compress", shardwrite.encode_chunk)),
        (store.DurableLocalStore, "_write_durable", clock.wrap("put", put_durable)),
        (job_store.JobStore, "progress", clock.wrap("sqlite", job_store.JobStore.progress)),
        (jobs.JobRunner, "_batches", _wrap_gen(clock, jobs.JobRunner._batches)),
        (jobs.JobRunner, "_scan", clock.wrap("submit", jobs.JobRunner._scan)),
        (job_store.JobStore, "finish", _signal_finish(job_store.JobStore.finish, ended)),
    ]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, fn in patches:
        setattr(obj, name, fn)
    try:
        app = create_app(settings, engine=engine)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
                if prefill:  # untimed: the cache already holds rows, as in a long job
                    r = await c.post("/v1/jobs", json={"cache": "c", "file": {"path": "pre.jsonl"}})
                    r.raise_for_status()
                    await _wait(ended)
                    clock.cpu.clear()
                    clock.appends.clear()
                ENDED.clear()
                threads0 = thread_cpu()
                cpu0, wall0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
                r = await c.post("/v1/jobs", json={"cache": "c", "file": {"path": "in.jsonl"}})
                r.raise_for_status()
                job_id = r.json()["id"]
                await _wait(ended)
                cpu1, wall1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
                threads1 = thread_cpu()
                job = (await c.get(f"/v1/jobs/{job_id}")).json()
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)
        for name in own:
            delattr(engine, name)
    if job["state"] != "succeeded":
        raise SystemExit(f"job failed: {job}")
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    sys_s = cpu1.ru_stime - cpu0.ru_stime
    for tid, (name, cpu_s) in ENDED.items():  # ended inside the job: its whole life's CPU
        threads1.setdefault(f"{tid}:{name}", cpu_s)
    per_thread = {n: v - threads0.get(n, 0.0) for n, v in threads1.items()}
    per_thread = {n: v for n, v in per_thread.items() if v > 0}
    return {
        "cpu_s": cpu,
        "sys_s": sys_s,
        "wall_s": wall1 - wall0,
        "job": job,
        "threads": per_thread,
    }


def thread_groups(per_thread: dict[str, float]) -> dict[str, float]:
    """Per-thread CPU summed by role: ``event_loop`` (the main thread), ``workers``
    (``asyncio.to_thread`` and the transformers backend's forward thread), ``job_writer``,
    ``zarr_io`` (zarr's own event loop thread), ``other_threads``."""
    out = dict.fromkeys(("event_loop", "workers", "job_writer", "zarr_io", "other_threads"), 0.0)
    for key, v in per_thread.items():
        name = key.split(":", 1)[1]
        role = (
            "event_loop"
            if name == "MainThread"
            else "workers"
            if name.startswith(("asyncio_", "logitcache-forward"))
            else "job_writer"
            if name.startswith("job-writer")
            else "zarr_io"
            if name.startswith("zarr_io")
            else "other_threads"
        )
        out[role] += v
    return out


def breakdown(stage_s: dict[str, float], groups: dict[str, float], total_s: float) -> dict:
    """Seconds per stage, each thread's CPU split into the stages it ran (see the module
    docstring); ``other``: the total (less the ``device`` stage) less every thread's and
    stage's share. The transformers backend's ``engine`` stage runs in a worker thread (it has a
    ``device`` stage), vLLM's hook on the event loop."""
    g = stage_s.get
    device = g("device", 0.0)
    out = {n: g(n, 0.0) for n in ("engine", "convert", "pair", "encode", "compress", "sqlite")}
    out["engine"] -= device
    in_loop = 0.0 if "device" in stage_s else out["engine"]
    out["read"], out["submit"] = g("read", 0.0), g("submit", 0.0)
    append = g("append", 0.0)
    put = g("put", 0.0)  # object files: write, fsync, rename (zarr's to_thread workers)
    # compress runs in the job writer thread (objects encoded by the append itself) or in
    # zarr's IO thread (arrays zarr opens): taken once from the two together
    out["write"] = max(groups["zarr_io"] + append - g("compress", 0.0) - g("encode", 0.0), 0.0)
    out["write"] += put
    out["bookkeeping"] = max(groups["job_writer"] - append - g("sqlite", 0.0), 0.0)
    out["event_loop"] = max(groups["event_loop"] - in_loop - g("convert", 0.0), 0.0)
    in_workers = g("read", 0.0) + g("submit", 0.0) + g("pair", 0.0) + put
    in_workers += g("engine", 0.0) if "device" in stage_s else 0.0
    out["handoffs"] = max(groups["workers"] - in_workers, 0.0) + groups["other_threads"]
    out["other"] = total_s - device - sum(out.values())
    return out


def _wrap_gen(clock: StageClock, gen_fn: Any) -> Any:
    """Time a generator method's own work (each ``next``) as ``read``."""

    def wrapped(*a: Any, **kw: Any) -> Any:
        it = gen_fn(*a, **kw)
        while True:
            t0 = time.thread_time()
            try:
                item = next(it)
            except StopIteration:
                clock.cpu["read"] = clock.cpu.get("read", 0.0) + time.thread_time() - t0
                return
            clock.cpu["read"] = clock.cpu.get("read", 0.0) + time.thread_time() - t0
            yield item

    return wrapped


def one_run(
    k: int,
    prompts: list[list[int]],
    settings_kw: dict,
    rows: Any,
    form: str = "arrays",
    prefill: int = 0,
    rate: float = 0.0,
) -> dict:
    """One timed job over ``prompts`` behind a replay engine of ``form`` over ``rows``
    (:mod:`benchmarks.service.replay`; ``rate``: the ``hf`` form's device pace in tokens/s, 0:
    rows at once): :func:`job_run`."""
    engine = build_engine(prompts, k, rows, form, rate)
    return {"form": form, "rate_tokens_per_s": rate} | job_run(
        k, prompts, settings_kw, engine, prefill
    )


def job_run(
    k: int, prompts: list[list[int]], settings_kw: dict, engine: Any, prefill: int = 0
) -> dict:
    """One timed job over ``prompts`` through the service in this process, behind ``engine``;
    its CPU per position, by stage and by thread (see the module docstring). With ``prefill``,
    an untimed job of that many sequences (the same prompts again, other ids) fills the cache
    first, so the timed appends land where a long job's do: inside partly filled shards of every
    array (the whole-object rewrites of FORMAT.md W3 grow with how full a shard already is).
    ``us_per_position``: the process's CPU less the ``device`` stage;
    ``outside_engine_us_per_position``: less the ``engine`` stage too (the engine's own host
    work, and on a GPU whatever its worker thread spends waiting outside ``device``)."""
    work = Path(tempfile.mkdtemp(prefix="job-cpu-"))
    write_jsonl(work / "data", prompts, "in.jsonl")
    if prefill:  # the same prompts again under other ids
        again = [prompts[i % len(prompts)] for i in range(prefill)]
        write_jsonl(work / "data", again, "pre.jsonl", prefix="p")
    clock = StageClock()
    load = os.getloadavg()[0]
    res = asyncio.run(run_job(work, engine, settings_kw, clock, prefill=prefill > 0))
    shutil.rmtree(work, ignore_errors=True)
    positions = sum(len(p) - 1 for p in prompts)
    groups = thread_groups(res["threads"])
    split = breakdown(clock.cpu, groups, res["cpu_s"])
    stages = {n: v / positions * 1e6 for n, v in split.items()}
    device = clock.cpu.get("device", 0.0)
    return {
        "k": k,
        "positions": positions,
        "cpu_s": res["cpu_s"],
        "wall_s": res["wall_s"],
        "positions_per_s": positions / res["wall_s"],
        "us_per_position": (res["cpu_s"] - device) / positions * 1e6,
        "outside_engine_us_per_position": (res["cpu_s"] - device - split["engine"])
        / positions
        * 1e6,
        "device_us_per_position": device / positions * 1e6,
        "sys_us_per_position": res["sys_s"] / positions * 1e6,
        "appends": len(clock.appends),
        "rows_per_append": clock.appends,
        "prefill_sequences": prefill,
        "stage_us_per_position": stages,
        "stage_clock_us_per_position": {n: v / positions * 1e6 for n, v in clock.cpu.items()},
        "load_avg_1min_before": load,
        "load_avg_1min_after": os.getloadavg()[0],
        "thread_cpu_s": res["threads"],
        "thread_group_us_per_position": {n: v / positions * 1e6 for n, v in groups.items()},
    }


def main(argv: list[str] | None = None) -> None:
    p = mode_parser("cpu", __doc__)
    options(p, k=[20, 100], sequences=256, length=256, repeats=3)
    options(
        p,
        warmup=(1, "untimed jobs of 16 sequences per k first (imports, first calls; 0: none)"),
        form=("arrays", "engine output: vLLM's through the service's array hook, or the "
              "transformers backend's (its own code, the device work replayed)",
              {"choices": ["arrays", "hf"]}),
        prefill=(0, "sequences written (untimed) into the cache before the timed job, e.g. "
                 "1600: the timed appends then rewrite partly filled shards as a long job's do"),
        ids=("stride", "top-k rows: 'stride' (arithmetic progressions modulo 4,096 tokens), "
             "'zipf' (the synthetic teacher over 131,072 tokens, what the format's "
             "bytes/position goal is measured on; ~8 s to make) or 'random' (a random-weights "
             "teacher over 128,256 tokens, as the GPU mode scores; ~2 s to make)",
             {"choices": sorted(ROWS)}),
        rate=(0.0, "--form hf: the replayed device's pace in tokens/s, e.g. 105000 (the 1B "
              "shape on an H100) or 29000 (8B); 0: rows at once"),
        sigma=(0.9, "--ids random: the logits' spread (0.9: the 1B shape, 1.3: 8B)"),
    )  # fmt: skip
    args = parse(p, argv)
    shared: Any = None  # the pooled rows are made once
    if args.ids == "zipf":
        shared = ZipfRows()
    elif args.ids == "random":
        shared = RandomTeacherRows(sigma=args.sigma)

    def rows(seed: int) -> Any:  # the stride rows are made per run, from the run's seed
        return shared if shared is not None else StrideRows(seed)

    vocab = rows(0).vocab
    _track_thread_ends()
    if args.sequences < 1 or args.length < 2 or args.repeats < 1:
        p.error("--sequences >= 1, --length >= 2 and --repeats >= 1 are needed")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab, args.length).tolist() for _ in range(args.sequences)]
    settings_kw = {"k": max(args.k), "log_level": "warning"}  # the server's job batching
    rec = Recorder("service", "cpu", csv_path=args.csv)
    for _ in range(args.warmup):  # the first job in a process pays imports and first calls
        for k in args.k:
            one_run(k, prompts[:16], settings_kw, rows(0), form=args.form)
    runs = []
    for rep in range(args.repeats):
        for k in args.k:
            r = one_run(k, prompts, settings_kw, rows(rep), args.form, args.prefill, args.rate)
            runs.append(r)
            st = ", ".join(f"{n} {v:.2f}" for n, v in r["stage_us_per_position"].items())
            print(
                f"k={k} rep {rep}: {r['us_per_position']:.2f} CPU-us/position "
                f"(sys {r['sys_us_per_position']:.2f}) ({st}); {r['appends']} appends; "
                f"wall {r['wall_s']:.1f} s, load {r['load_avg_1min_before']:.1f}",
                flush=True,
            )
    summary = {}
    inputs = {"sequences": args.sequences, "length": args.length, "vocab": vocab, "ids": args.ids}
    for k in args.k:
        xs = [r["us_per_position"] for r in runs if r["k"] == k]
        summary[str(k)] = {
            "median_us_per_position": statistics.median(xs),
            "min_us_per_position": min(xs),
        }
        rec.add(
            f"job path k={k}",
            "cpu_us_per_position",
            "us/pos",
            statistics.median(xs),
            p20=min(xs),
            p80=max(xs),
            samples=len(xs),
            config=settings_kw
            | inputs
            | {"k": k, "form": args.form, "prefill": args.prefill, "rate": args.rate},
        )
        print(f"k={k}: median {statistics.median(xs):.2f} CPU-us/position")
    result = {
        "machine": machine_line(rec.machine),
        "command": rec.command,
        "inputs": inputs,
        "settings": settings_kw,
        "form": args.form,
        "prefill_sequences": args.prefill,
        "runs": runs,
        "summary": summary,
    }
    rec.finish(result, args.json, show=-1)


if __name__ == "__main__":
    main()

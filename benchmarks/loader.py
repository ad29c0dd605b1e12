"""The data path at trainer scale: positions/s delivered, worker scaling, shuffle cost, HTTP,
data wait of a training step.

Modes (every figure of ``benchmarks/results/loader.md`` comes from them)::

    python -m benchmarks.loader scaling --positions 20e6 --workers 1 2 4 8 12 --plot
    python -m benchmarks.loader http --positions 20e6 --http-workers 0 8
    python -m benchmarks.loader datawait --positions 20e6 --ddp       # on a CUDA GPU
    python -m benchmarks.loader hidden --positions 4e6 --dim 4096 --workers 1 2 4 8 12
    python -m benchmarks.loader hidden --quick                        # smoke size

The cache (built once under ``--root``): ``Teacher.pooled`` sequences (median 490 tokens), k=100,
vocab 128,256. Loader rates are steady-state: positions with ``loss_mask`` over ``--seconds``
after the first ``2 * max(1, w)`` batches, with the full shuffle users are told to copy
(:data:`SHUFFLE`), ``pin_memory``.

* ``scaling``: ``CacheReader.rows`` + ``tokens`` in storage order (one process); ``CacheDataset``
  in one process, sequential vs full shuffle (and with one lane); ``CacheDataLoader`` per
  ``--workers``.
* ``http``: the store route under uvicorn on loopback and ``HttpSource``: one process per
  ``--http-threads``, then ``--http-workers``; the server's CPU per position.
* ``datawait`` (CUDA): a ~200M-parameter student trained by ``topk_distill_loss`` from the local
  store and over HTTP (``--ddp``: in a one-process NCCL DDP group): the share of step time spent
  in ``next()`` once the prefilled queues are drained, beside the step on one batch kept on the GPU.
* ``hidden``: a ``targets="hidden"`` cache of bfloat16 rows of ``--dim`` values (slices of a pool
  of :data:`HIDDEN_POOL` standard-normal states): one process sequential and shuffled, then
  ``--workers``; positions/s and MB/s. ``--quick``: d=256, 200K positions, workers 0 and 1, 1 s
  each (a smoke run, no measurement).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import (
    RESULTS,
    Recorder,
    add_csv_option,
    free_port,
    line_plot,
    log,
    machine_line,
    options,
    proc_cpu,
    server_process,
    suite_parser,
)
from benchmarks.synthetic import Teacher, store_bytes, write_cache

K = 100
VOCAB = 128_256
CACHE = "bench"
#: The full shuffle users are told to copy (order.py states its randomness).
SHUFFLE = {"shuffle_block_size": 64, "shuffle_window": 4, "lanes": 24}  # = dataset.TRAINER_SHUFFLE
#: The loader settings of every measurement (items of 2048 tokens, packed, 8 per batch).
LOADER: dict[str, Any] = {"tokens_per_item": 2048, "mode": "pack", "batch_size": 8}


def build(url: str, positions: int, seed: int = 0) -> dict[str, Any]:
    """Write the benchmark cache; counts and timings."""
    import numcodecs.blosc

    numcodecs.blosc.set_nthreads(1)
    teacher = Teacher(vocab=VOCAB, k=K, seed=seed)
    t0 = time.perf_counter()
    data = teacher.pooled(positions)
    write_cache(url, data, teacher.manifest("loader"), append_positions=1_000_000)
    wall = time.perf_counter() - t0
    nbytes = store_bytes(url)
    return {
        "sequences": data.sequences,
        "positions": data.positions,
        "build_s": wall,
        "store_bytes": nbytes,
        "bytes_per_position": nbytes / data.positions,
    }


# --------------------------------------------------------------------------- 2. reader
def reader_rate(url: str, seconds: float) -> dict[str, Any]:
    """Sequential ``rows`` + ``tokens`` over 64-sequence ranges for ``seconds``."""
    from logitcache.cache_format import CacheReader

    r = CacheReader(url)
    rs = np.append(r.row_starts, r.num_rows)
    r.rows(0, int(rs[min(64, r.num_sequences)]))  # warm: first-call set-up not timed
    pos, t0, c0 = 0, time.perf_counter(), time.process_time()
    for a in range(0, r.num_sequences, 64):
        b = min(a + 64, r.num_sequences)
        r.rows(int(rs[a]), int(rs[b]))
        r.tokens(int(rs[a]) + a, int(rs[b]) + b)
        pos += int(rs[b] - rs[a])
        if time.perf_counter() - t0 > seconds:
            break
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"positions": pos, "wall_s": wall, "pos_per_s": pos / wall, "pos_per_cpu_s": pos / cpu}


# --------------------------------------------------------------------------- 3-5. loaders
def loader_rate(
    source: Any,
    workers: int,
    seconds: float,
    *,
    pin: bool,
    shuffle: bool,
    warm: int | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Steady positions/s delivered by ``CacheDataLoader``."""
    import torch
    from logitcache.client import CacheDataLoader, CacheDataset, ReadOptions, StreamConfig

    settings = {**LOADER, **(SHUFFLE if shuffle else {}), **extra}
    read_names = {f.name for f in dataclasses.fields(ReadOptions)}
    read = ReadOptions(**{n: v for n, v in settings.items() if n in read_names})
    stream = {n: v for n, v in settings.items() if n not in read_names}
    ds = CacheDataset(
        source, StreamConfig(shuffle=shuffle, ids_dtype=torch.int32, seed=1, **stream), read=read
    )
    kwargs: dict[str, Any] = {"num_workers": workers, "pin_memory": pin}
    if workers:
        kwargs["prefetch_factor"] = 4
    loader = CacheDataLoader(ds, **kwargs)
    warm = max(warm or 0, 2 * max(1, workers))
    t_start = time.perf_counter()
    pos = units = 0
    t0 = None
    pinned = True
    for unit in loader:
        units += 1
        if units == warm:
            t0, t_first = time.perf_counter(), time.perf_counter() - t_start
            continue
        if t0 is None:
            continue
        pos += int(unit["loss_mask"].sum())
        pinned = pinned and (not pin or unit.get("hidden", unit.get("topk_ids")).is_pinned())
        if time.perf_counter() - t0 >= seconds:
            break
    if t0 is None:
        raise RuntimeError("epoch shorter than the warm-up; use a larger cache")
    wall = time.perf_counter() - t0
    from logitcache.client.readahead import default_read_threads

    threads = ds.read.read_threads or default_read_threads(workers, os.cpu_count())
    return {
        "workers": workers,
        "read_threads": threads,
        "pin_memory": pin,
        "pinned": pinned,
        "shuffle": shuffle,
        "settings": {k: v for k, v in settings.items()},
        "warm_units": warm,
        "startup_s": t_first,
        "positions": pos,
        "wall_s": wall,
        "pos_per_s": pos / wall,
    }


def serve(root: str, port: int) -> None:
    """The server part of the HTTP step: the real store route under uvicorn (no engine)."""
    from types import SimpleNamespace

    import uvicorn
    from fastapi import FastAPI
    from logitcache.server.api import store as routes_store
    from logitcache.server.errors import install_error_handlers
    from logitcache.server.serving.caches import CacheRegistry

    app = FastAPI()
    app.include_router(routes_store.router)
    install_error_handlers(app)
    app.state.services = SimpleNamespace(caches=CacheRegistry(root))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


@contextlib.contextmanager
def http_server(root: str) -> Iterator[tuple[str, int]]:
    """A server process (``serve``) on a free loopback port; yields ``(url, pid)``."""
    port = free_port()
    cmd = [sys.executable, "-m", "benchmarks.loader", "serve", "--root", root, "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    ready = f"{url}/v1/caches/{CACHE}/store/zarr.json"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with server_process(cmd, ready, timeout=30, env=env) as proc:
        yield url, proc.pid


def http_rates(
    root: str, workers: list[int], seconds: float, threads: list[int]
) -> list[dict[str, Any]]:
    """HttpSource against a server process on loopback: one client process with each
    ``threads`` (``read_threads``), then each ``workers`` (> 0) count of workers."""
    from logitcache.client.sources import HttpSource

    runs: list[tuple[int, int | None]] = [(0, t) for t in threads] if 0 in workers else []
    runs += [(w, None) for w in workers if w > 0]
    out = []
    with http_server(root) as (url, pid):
        for w, t in runs:
            c0 = proc_cpu(pid, children=True)
            r = loader_rate(
                HttpSource(url, CACHE), w, seconds, pin=w > 0, shuffle=True, read_threads=t
            )
            r["server_cpu_s"] = proc_cpu(pid, children=True) - c0
            # CPU over the whole run (start-up reads included) per steady position: an upper bound
            r["server_cpu_us_per_position_upper"] = 1e6 * r["server_cpu_s"] / r["positions"]
            out.append(r)
            log("http", json.dumps(r))
    return out


# --------------------------------------------------------------------------- 7. data wait
def data_wait(
    source: Any, workers: int, steps: int, warmup: int, ddp: bool = True, fed_steps: int = 120
) -> dict[str, Any]:
    """Student steps fed by the loader: fraction of step time spent waiting in ``next()``.

    ``ddp``: the model is wrapped in ``DistributedDataParallel`` in a one-process NCCL group (the
    gradient all-reduce path of a DDP trainer; ``CacheDataset`` takes its rank from the group).
    """
    import torch
    import torch.distributed as dist
    from logitcache.client import CacheDataLoader, CacheDataset, StreamConfig
    from logitcache.client.loss import topk_distill_loss as loss_fn

    from benchmarks.service.gpu import Shape, bf16_llama

    hidden = 768  # a ~200M-parameter student at this vocab
    config = Shape(hidden, 12, 12, 12, 2048, VOCAB, tied=False).config(LOADER["tokens_per_item"])
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    torch.cuda.set_device(0)
    model = bf16_llama(config, "cuda")

    class Distill(torch.nn.Module):
        """Forward = student hidden states + top-k distillation loss (one DDP forward)."""

        def __init__(self, m: Any) -> None:
            super().__init__()
            self.m = m

        def forward(self, b: dict[str, torch.Tensor]) -> torch.Tensor:
            out = self.m.model(input_ids=b["input_ids"], position_ids=b["position_ids"])
            h = out.last_hidden_state.reshape(-1, hidden)
            return loss_fn(
                h,
                self.m.lm_head.weight,
                b["topk_ids"].reshape(h.shape[0], K).long(),
                b["topk_logprobs"].reshape(h.shape[0], K),
                b["tail_mass"].reshape(-1),
                mask=b["loss_mask"].reshape(-1),
            )

    net: torch.nn.Module = Distill(model)
    if ddp:
        init = f"tcp://127.0.0.1:{free_port()}"
        dist.init_process_group("nccl", init_method=init, rank=0, world_size=1)
        net = torch.nn.parallel.DistributedDataParallel(net, device_ids=[0])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(b: dict[str, torch.Tensor]) -> None:
        net(b).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    ds = CacheDataset(source, StreamConfig(ids_dtype=torch.int32, seed=2, **LOADER, **SHUFFLE))
    loader = CacheDataLoader(ds, num_workers=workers, pin_memory=True, prefetch_factor=4)
    it = iter(loader)

    def to_gpu(u: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: v.to("cuda", non_blocking=True) for n, v in u.items()}

    first = to_gpu(next(it))
    for _ in range(warmup):  # pure step: one batch kept on the GPU
        step(first)
    torch.cuda.synchronize()
    pure = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step(first)
        torch.cuda.synchronize()
        pure.append(time.perf_counter() - t0)
    # the workers filled their queues (num_workers x prefetch_factor batches) during the pure
    # steps: the first fed steps are served from that buffer, so the steady figures leave them out
    skip = warmup + workers * 4
    waits: list[float] = []
    totals: list[float] = []
    pos = 0
    for i in range(skip + fed_steps):
        if i == skip:
            waits, totals, pos = [], [], 0
        t0 = time.perf_counter()
        u = next(it)
        t1 = time.perf_counter()
        pos += int(u["loss_mask"].sum())
        step(to_gpu(u))
        torch.cuda.synchronize()
        waits.append(t1 - t0)
        totals.append(time.perf_counter() - t0)
    params = sum(p.numel() for p in model.parameters())
    positions = LOADER["batch_size"] * LOADER["tokens_per_item"]
    del it, loader
    if ddp:
        dist.destroy_process_group()
    return {
        "source": repr(ds.source),
        "ddp_world_1_nccl": ddp,
        "loader": {**LOADER, **SHUFFLE, "num_workers": workers, "pin_memory": True},
        "gpu": torch.cuda.get_device_name(),
        "params": params,
        "workers": workers,
        "steps": steps,
        "fed_steps_timed": fed_steps,
        "fed_steps_skipped": skip,
        "wait_s_max": float(np.max(waits)),
        "pure_step_s_median": float(np.median(pure)),
        "pure_positions_per_s": positions / float(np.median(pure)),
        "fed_step_s_mean": float(np.mean(totals)),
        "wait_s_mean": float(np.mean(waits)),
        "wait_fraction": float(np.sum(waits) / np.sum(totals)),
        "supervised_positions_per_s_fed": pos / float(np.sum(totals)),
    }


# --------------------------------------------------------------------------- main
def plot(doc: dict[str, Any], path: Path) -> Path:
    """Positions/s vs workers (local, HTTP), the one-process reader and the 1M goal."""
    series = {
        "local store, full shuffle": [
            (r["workers"], r["pos_per_s"] / 1e6) for r in doc.get("scaling", [])
        ]
    }
    http = [(r["workers"], r["pos_per_s"] / 1e6) for r in doc.get("http", []) if r["workers"]]
    if http:
        series["HTTP (store transport)"] = http
    return line_plot(
        path,
        series,
        title=f"CacheDataLoader, k={K}, vocab {VOCAB:,}",
        xlabel="DataLoader workers (pin_memory=True)",
        ylabel="positions/s delivered (millions)",
        hline=1.0,
        hline_label="goal: 1M at 8 workers",
        note=doc["machine_line"],
    )


def one_process(url: str, args: argparse.Namespace, reader_pos_per_s: float) -> dict[str, Any]:
    """One process: sequential vs full shuffle, same window and warm-up (past the 24-lane
    start-up: lanes x window blocks are read before every lane's first batch)."""
    kw = {"pin": False, "warm": args.shuffle_warm}
    out: dict[str, Any] = {
        name: loader_rate(url, 0, args.shuffle_seconds, shuffle=shuffle, **kw, **extra)
        for name, shuffle, extra in [
            ("sequential", False, {}),
            ("full_shuffle", True, {}),
            ("full_shuffle_lanes1", True, {"lanes": 1}),
        ]
    }
    seq = out["sequential"]["pos_per_s"]
    out["ratio"] = out["full_shuffle"]["pos_per_s"] / seq
    out["ratio_lanes1"] = out["full_shuffle_lanes1"]["pos_per_s"] / seq
    out["x_reader"] = out["full_shuffle"]["pos_per_s"] / reader_pos_per_s
    return out


#: mode -> its options beside ``--positions``, ``--seconds``, ``--root`` and ``--csv``
MODE_OPTIONS: dict[str, dict[str, Any]] = {
    "scaling": dict(workers=[1, 2, 4, 8, 12], shuffle_seconds=10.0, shuffle_warm=30)
    | {"plot": (None, None, {"nargs": "?", "type": Path, "const": RESULTS / "loader_scaling.png"})},
    "http": dict(http_workers=[0, 8], http_threads=[4, 8]),
    "datawait": dict(workers=8, steps=40, fed_steps=120, ddp=(False, "under a world-1 NCCL DDP")),
    "hidden": dict(dim=4096, workers=[1, 2, 4, 8, 12])
    | {"quick": (False, "smoke size (see the docstring)")},
}


def main(argv: list[str] | None = None) -> None:
    p, sub = suite_parser("loader", __doc__)
    srv = sub.add_parser("serve", help="(internal) the HTTP mode's server process")
    srv.add_argument("--root", required=True)
    srv.add_argument("--port", type=int, required=True)
    for name, spec in MODE_OPTIONS.items():
        s = options(sub.add_parser(name), positions=20e6, seconds=6.0, **spec)
        options(s, root=("/tmp/lc-loader-bench", "the cache is kept here"))
        add_csv_option(s)
    args = p.parse_args(argv)
    if args.mode == "serve":
        serve(args.root, args.port)
        return
    root = Path(args.root)
    url = str(root / CACHE)
    rec = Recorder("loader", args.mode, csv_path=args.csv)
    doc: dict[str, Any] = {"machine_line": machine_line(rec.machine)}
    if args.mode == "hidden":
        run_hidden(args, root, rec, doc)
        return rec.finish(doc, indent=1, show=6000)
    cfg = {"positions": int(args.positions), "k": K, "vocab": VOCAB, **LOADER}
    if not (root / CACHE / "zarr.json").exists():
        doc["build"] = build(url, int(args.positions))
        log("build", doc["build"])
    if args.mode == "scaling":
        doc["reader"] = reader_rate(url, args.seconds)
        rec.add("reader", "pos_per_s", "pos/s", doc["reader"]["pos_per_s"], config=cfg)
        doc["shuffle"] = one_process(url, args, doc["reader"]["pos_per_s"])
        for case in ("sequential", "full_shuffle", "full_shuffle_lanes1"):
            rate = doc["shuffle"][case]["pos_per_s"]
            rec.add(f"1 process {case}", "pos_per_s", "pos/s", rate, config=cfg | SHUFFLE)
        doc["scaling"] = [
            loader_rate(url, w, args.seconds, pin=True, shuffle=True) for w in args.workers
        ]
        for r in doc["scaling"]:
            c = cfg | SHUFFLE | {"workers": r["workers"], "pin_memory": True}
            rec.add(f"{r['workers']} workers", "pos_per_s", "pos/s", r["pos_per_s"], config=c)
        if args.plot:
            print(plot(doc, args.plot))
    elif args.mode == "http":
        doc["http"] = http_rates(str(root), args.http_workers, args.seconds, args.http_threads)
        for r in doc["http"]:
            c = cfg | SHUFFLE | {"workers": r["workers"], "read_threads": r["read_threads"]}
            case = f"http {r['workers']} workers {r['read_threads']} threads"
            rec.add(case, "pos_per_s", "pos/s", r["pos_per_s"], config=c)
            cpu = r["server_cpu_us_per_position_upper"]
            rec.add(case, "server_cpu_us_per_position", "us/pos", cpu, config=c)
    else:
        doc["datawait"] = data_wait(url, args.workers, args.steps, 5, args.ddp, args.fed_steps)
        with http_server(str(root)) as (http_url, pid):
            from logitcache.client.sources import HttpSource

            doc["datawait_http"] = data_wait(
                HttpSource(http_url, CACHE), args.workers, args.steps, 5, args.ddp, args.fed_steps
            )
        for case in ("datawait", "datawait_http"):
            d = doc[case]
            c = cfg | SHUFFLE | {"workers": args.workers, "ddp": args.ddp}
            rec.add(case, "wait_fraction", "ratio", d["wait_fraction"], config=c)
            rec.add(case, "fed_step_s", "s", d["fed_step_s_mean"], config=c)
            rec.add(case, "pure_step_s", "s", d["pure_step_s_median"], config=c)
    rec.finish(doc, indent=1, show=6000)


# --------------------------------------------------------------------------- hidden
HIDDEN_VOCAB = 4096
HIDDEN_POOL = 65536


def build_hidden(url: str, positions: int, dim: int, seed: int = 0) -> dict[str, Any]:
    """Write the ``hidden`` mode's cache (see the module docstring); counts and timings."""
    import numcodecs.blosc
    from logitcache.cache_format import CacheWriter, HiddenRecord, Manifest, TeacherHead

    numcodecs.blosc.set_nthreads(1)
    rng = np.random.default_rng(seed)
    head = TeacherHead(rng.standard_normal((HIDDEN_VOCAB, dim), dtype=np.float32))
    manifest = Manifest(
        teacher_model="synthetic-hidden",
        tokenizer_fingerprint="synthetic-hidden",
        vocab_size=HIDDEN_VOCAB,
        k=1,
        targets="hidden",
        hidden=head.spec("bfloat16"),
        dataset=f"synthetic hidden states (benchmarks/loader.py, seed {seed})",
    )
    pool = rng.standard_normal((HIDDEN_POOL, dim), dtype=np.float32)
    tokens = rng.integers(0, HIDDEN_VOCAB, size=HIDDEN_POOL, dtype=np.int32)
    t0 = time.perf_counter()
    rows = seqs = 0
    batch: list[HiddenRecord] = []
    with CacheWriter.open(url, manifest, head=head, fsync=False) as w:
        while rows < positions:
            n = min(int(np.clip(rng.lognormal(np.log(490), 0.9), 16, 8192)), HIDDEN_POOL)
            o = int(rng.integers(0, HIDDEN_POOL - n + 1))
            batch.append(HiddenRecord(f"s{seqs}", tokens[o : o + n], pool[o : o + n - 1]))
            rows, seqs = rows + n - 1, seqs + 1
            if sum(r.num_rows for r in batch) >= 65536 or rows >= positions:
                w.append(batch)
                batch = []
    nbytes = store_bytes(url)
    return {
        "sequences": seqs,
        "positions": rows,
        "dim": dim,
        "build_s": time.perf_counter() - t0,
        "store_bytes": nbytes,
        "bytes_per_position": nbytes / rows,
    }


def run_hidden(args: argparse.Namespace, root: Path, rec: Recorder, doc: dict[str, Any]) -> None:
    """The ``hidden`` mode: one process (sequential, full shuffle), then each worker count."""
    if args.quick:
        args.dim, args.positions, args.workers, args.seconds = 256, 2e5, [0, 1], 1.0
    dim, positions = args.dim, int(args.positions)
    url = str(root / f"hidden-d{dim}-{positions}")
    if not (Path(url) / "zarr.json").exists():
        doc["build"] = build_hidden(url, positions, dim)
        log("build", doc["build"])
    for name, shuffle in (("sequential", False), ("full_shuffle", True)):
        doc[name] = loader_rate(url, 0, args.seconds, pin=False, shuffle=shuffle, warm=2)
    doc["scaling"] = [
        loader_rate(url, w, args.seconds, pin=True, shuffle=True) for w in args.workers
    ]
    cfg = {"positions": positions, "dim": dim, "vocab": HIDDEN_VOCAB, **LOADER}
    bpp = store_bytes(url) / positions
    rec.add(f"hidden d={dim} store", "bytes_per_position", "B", bpp, config=cfg)
    cases = [(f"1 process {n}", doc[n], cfg) for n in ("sequential", "full_shuffle")]
    cases += [
        (f"{r['workers']} workers", r, cfg | SHUFFLE | {"workers": r["workers"]})
        for r in doc["scaling"]
    ]
    for case, r, c in cases:
        rec.add(f"hidden d={dim} {case}", "pos_per_s", "pos/s", r["pos_per_s"], config=c)
        mbs = r["pos_per_s"] * 2 * dim / 1e6
        rec.add(f"hidden d={dim} {case}", "hidden_MB_per_s", "MB/s", mbs, config=c)


if __name__ == "__main__":
    main()

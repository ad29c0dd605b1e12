"""The loader's fetch path (issue #14): merged range reads (``LocalSource`` default) against one
point read per fetch (``LocalSource(point_reads=True)`` / ``CacheDataset(point_reads=True)``),
side by side in one run, alternated round by round.

Usage (from the repository root)::

    python benchmarks/loader_point_reads.py --root /tmp/lpr --positions 2000000 \\
        --layouts default random_access --threads 1 2 --rounds 3 --json OUT.json

1. **build**: ``random_access_bench.py``'s sequences (log-normal lengths, median 490 tokens;
   k=100, vocab 128,256) written once per layout preset (kept under ``--root`` and reused).
2. per round, layout and ``--threads`` value ``t`` (``decode_threads=t``), the two paths in
   alternating order:

   * ``fetch random``: ``LocalSource.fetch`` of ``--batch`` uniformly random sequences per call
     (a full shuffle's fetch), ``--calls`` calls;
   * ``fetch block``: ``LocalSource.fetch`` of ``--batch`` consecutive sequences per call (a
     ``shuffle_block_size=64`` block);
   * ``loader``: ``CacheDataset`` with a uniform full shuffle (``shuffle_block_size=1``),
     ``tokens_per_item=2048``, ``batch_size=8``, ``read_threads=1``, in this process, for
     ``--batches`` batches after 2 untimed ones; positions = rows with a target
     (``loss_mask``);

   and once per round the sequential reader (``rows`` + ``tokens`` of 64-sequence ranges,
   ``client_scaling.reader_rate``) for the issue's ratio (full-shuffle loader / sequential).
   Every figure: positions per process CPU-second (all threads) and per wall second, with the
   1-minute load average read just before it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from logitcache.client import ReadOptions, StreamConfig

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))


def log(*a: Any) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def measure(fn: Any) -> dict[str, float]:
    """``fn()`` returns the positions it read; CPU (process) and wall rates."""
    load = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), time.process_time()
    pos = fn()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"positions": pos, "pos_per_cpu_s": pos / cpu, "pos_per_s": pos / wall, "load": load}


def fetches(url: str, calls: list[list[int]], threads: int, point: bool) -> dict[str, float]:
    from logitcache.client.sources import LocalSource

    src = LocalSource(url, decode_threads=threads, point_reads=point)
    src.fetch(calls[0])  # warm: the reader opened, kernels loaded

    def run() -> int:
        return sum(int(r.topk_ids.shape[0]) for c in calls for r in src.fetch(c).values())

    return measure(run)


def loader(url: str, batches: int, threads: int, point: bool, seed: int) -> dict[str, float]:
    from logitcache.client import CacheDataset

    ds = CacheDataset(
        url,
        StreamConfig(tokens_per_item=2048, batch_size=8, seed=seed),
        read=ReadOptions(read_threads=1, decode_threads=threads, point_reads=point),
    )
    it = iter(ds)
    for _ in range(2):  # warm: the reader opened, the first reads in flight
        next(it)

    def run() -> int:
        return sum(int(next(it)["loss_mask"].sum()) for _ in range(batches))

    out = measure(run)
    it.close()
    return out


def build_once(url: Path, records: list, layout: str) -> dict[str, Any]:
    import random_access_bench as rab

    if (url / "zarr.json").exists():
        return {"layout": layout, "reused": True}
    log(f"build {layout}")
    return rab.build(str(url), records, layout)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import client_scaling
    import random_access_bench as rab
    from logitcache.cache_format import CacheReader

    root = Path(args.root)
    records = None
    doc: dict[str, Any] = {
        "args": vars(args),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "build": {},
        "rounds": [],
    }
    for layout in args.layouts:
        url = root / layout
        if not (url / "zarr.json").exists() and records is None:
            records = rab.make_records(args.positions)
        doc["build"][layout] = build_once(url, records or [], layout)
    for rnd in range(args.rounds):
        rng = np.random.default_rng(100 + rnd)
        for layout in args.layouts:
            url = str(root / layout)
            n = CacheReader(url).num_sequences
            rand = [rng.choice(n, args.batch, replace=False).tolist() for _ in range(args.calls)]
            starts = rng.integers(0, max(1, n - args.batch), args.calls)
            block = [list(range(int(s), int(s) + args.batch)) for s in starts]
            seq = client_scaling.reader_rate(url, args.seconds)
            seq["load"] = os.getloadavg()[0]
            entry: dict[str, Any] = {"round": rnd, "layout": layout, "sequential": seq}
            log(f"round {rnd} {layout}: sequential {seq['pos_per_cpu_s']:,.0f} pos/CPU-s")
            for t in args.threads:
                order = (False, True) if (rnd + t) % 2 == 0 else (True, False)
                for point in order:
                    name = "point" if point else "range"
                    got = {
                        "fetch_random": fetches(url, rand, t, point),
                        "fetch_block": fetches(url, block, t, point),
                        "loader": loader(url, args.batches, t, point, seed=rnd),
                    }
                    entry[f"{name}_t{t}"] = got
                    log(
                        f"round {rnd} {layout} t={t} {name}: "
                        + ", ".join(
                            f"{k} {v['pos_per_cpu_s']:,.0f}/CPU-s {v['pos_per_s']:,.0f}/s "
                            f"(load {v['load']:.1f})"
                            for k, v in got.items()
                        )
                    )
            doc["rounds"].append(entry)
    return doc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--root", default="/tmp/loader-point-reads")
    p.add_argument("--positions", type=int, default=2_000_000)
    p.add_argument("--layouts", nargs="+", default=["default", "random_access"])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=64, help="sequences per fetch")
    p.add_argument("--calls", type=int, default=20, help="fetch calls per measurement")
    p.add_argument("--batches", type=int, default=20, help="loader batches per measurement")
    p.add_argument("--seconds", type=float, default=3.0, help="sequential reader time")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    doc = run(args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1))
        log(f"wrote {args.json}")


if __name__ == "__main__":
    main()

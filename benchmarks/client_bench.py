"""Client loader benchmark: CacheDataset throughput from a local store and over HTTP.

Usage (from the repository root)::

    .venv/bin/python benchmarks/client_bench.py [--sequences 1500] [--k 20] [--budget 2048]
        [--batch 8] [--workers 0 2 4] [--no-http] [--json benchmarks/results/client.json]

One run, one cache:

1. A cache of ``--sequences`` sequences (lengths uniform in [64, 1024], Zipf-distributed token and
   top-k ids over a 32,000 vocabulary, sorted logprobs, float16 logprob storage: the format's
   defaults) is written through ``CacheWriter`` into the store root of a teacher service.
2. **baseline** (in process): ``CacheReader.rows`` + ``CacheReader.tokens`` over the whole cache
   in storage order, 64 sequences per read, no collation: the format library's best case.
3. **local**: ``CacheDataset(store path, tokens_per_item=--budget, mode="pack",
   batch_size=--batch, shuffle_block_size=b)`` through ``CacheDataLoader(num_workers=w)``, one
   epoch, for each ``b`` in ``--blocks`` (1 = full shuffle) and ``w`` in ``--workers``.
   Then once more (2 workers, the last block size) with a consumer that sleeps ``--step-s`` per
   batch, a stand-in for a GPU training step: the time it waits in ``next()`` is reported.
4. **http**: the same with ``HttpSource`` against the real service (``python -m
   logitcache.server`` on the tiny teacher, serving the same store root).

Throughput = supervised positions (``loss_mask`` true) per second of wall time, from the first
``next()`` to the end of the epoch (start-up of workers included). Each figure is also given as
a ratio to the baseline of the same run. The data values do not matter to the loader; random ids
compress worse than a real teacher's, so the store is, if anything, slower to read than a real one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from logitcache.client import ReadOptions, StreamConfig

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

VOCAB = 32_000


def build_store(url: str, n: int, k: int, seed: int = 0) -> dict[str, int]:
    """Write the benchmark cache; return its counts."""
    from logitcache.cache_format import CacheWriter, Manifest, SequenceRecord

    rng = np.random.default_rng(seed)
    manifest = Manifest(
        teacher_model="client-bench-synthetic",
        tokenizer_fingerprint="client-bench",
        vocab_size=VOCAB,
        k=k,
        dataset="synthetic (benchmarks/client_bench.py)",
    )
    rows = 0
    with CacheWriter.open(url, manifest) as writer:
        batch = []
        for i in range(n):
            length = int(rng.integers(64, 1025))
            ids = (rng.zipf(1.3, size=length) % VOCAB).astype(np.int32)
            base = rng.integers(0, VOCAB, size=(length - 1, 1))
            topk = ((base + 1237 * np.arange(k)) % VOCAB).astype(np.int32)  # distinct per row
            logits = np.sort(rng.normal(0, 2, size=(length - 1, k)), axis=1)[:, ::-1]
            lp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True)) + np.log(0.9)
            batch.append(SequenceRecord(f"s{i}", ids, topk, lp.astype(np.float32)))
            rows += length - 1
            if len(batch) == 100:
                writer.append(batch)
                batch = []
        if batch:
            writer.append(batch)
    return {"sequences": n, "rows": rows}


def time_baseline(url: str) -> dict[str, float]:
    """Raw reader throughput: row and token ranges of 64 sequences, in storage order."""
    from logitcache.cache_format import CacheReader

    reader = CacheReader(url)
    starts = np.concatenate([[0], np.cumsum(reader.lengths.astype(np.int64))])
    n = reader.num_sequences
    t0 = time.perf_counter()
    rows = 0
    for a in range(0, n, 64):
        b = min(a + 64, n)
        block = reader.rows(int(starts[a]) - a, int(starts[b]) - b)
        reader.tokens(int(starts[a]), int(starts[b]))
        rows += block.stop - block.start
    dt = time.perf_counter() - t0
    return {"positions": rows, "seconds": dt, "positions_per_s": rows / dt}


def time_loader(
    source: Any, args: argparse.Namespace, workers: int, block: int, step_s: float = 0.0
) -> dict[str, float]:
    """One epoch of CacheDataset through CacheDataLoader; positions/s from the first next().

    With ``step_s > 0`` the consumer sleeps ``step_s`` per batch (a training step that leaves
    the CPU free, like a GPU step) and the time spent waiting in ``next()`` after the first
    batch is reported: 0 means the trainer never waited.
    """
    from logitcache.client import CacheDataLoader, CacheDataset

    ds = CacheDataset(
        source,
        StreamConfig(
            tokens_per_item=args.budget,
            mode="pack",
            batch_size=args.batch,
            seed=args.seed,
            shuffle_block_size=block,
        ),
        read=ReadOptions(prefetch=4),
    )
    loader = CacheDataLoader(ds, num_workers=workers, prefetch_factor=4 if workers else None)
    t0 = time.perf_counter()
    positions = units = 0
    waited = 0.0
    it = iter(loader)
    while True:
        t_wait = time.perf_counter()
        batch = next(it, None)
        if units:
            waited += time.perf_counter() - t_wait
        if batch is None:
            break
        positions += int(batch["loss_mask"].sum())
        units += 1
        if step_s:
            time.sleep(step_s)
    dt = time.perf_counter() - t0
    out = {
        "workers": workers,
        "shuffle_block_size": block,
        "positions": positions,
        "batches": units,
        "seconds": dt,
        "positions_per_s": positions / dt,
    }
    if step_s:
        out |= {"step_s": step_s, "wait_s_after_first": waited, "wait_fraction": waited / dt}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sequences", type=int, default=1500)
    p.add_argument("--k", type=int, default=20)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2, 4])
    p.add_argument("--blocks", type=int, nargs="+", default=[1, 64])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-http", action="store_true")
    p.add_argument(
        "--step-s",
        type=float,
        default=0.264,
        help="simulated training step per batch for the wait measurement (default: the 0.95B "
        "student step on an H200 from benchmarks/results/client_trainstep.json)",
    )
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="client-bench-"))
    root = work / "caches"
    url = str(root / "bench")
    t0 = time.perf_counter()
    counts = build_store(url, args.sequences, args.k)
    print(f"built {counts} in {time.perf_counter() - t0:.1f} s at {url}", flush=True)

    result: dict[str, Any] = {
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs (shared)",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "cache": {**counts, "k": args.k, "vocab": VOCAB, "logprob_dtype": "float16"},
        "budget": args.budget,
        "batch": args.batch,
        "load_avg_start": os.getloadavg(),
    }
    result["baseline"] = time_baseline(url)
    print("baseline", result["baseline"], flush=True)

    def sweep(kind: str, make_source: Any) -> list[dict[str, Any]]:
        out = []
        for block in args.blocks:
            for w in args.workers:
                r = time_loader(make_source(), args, w, block)
                r["ratio_to_baseline"] = (
                    r["positions_per_s"] / result["baseline"]["positions_per_s"]
                )
                out.append(r)
                print(kind, r, flush=True)
        return out

    result["local"] = sweep("local", lambda: url)
    if args.step_s:
        r = time_loader(url, args, 2, args.blocks[-1], step_s=args.step_s)
        result["local_with_step"] = r
        print("local with a simulated step", r, flush=True)

    if not args.no_http:
        from logitcache.client.sources import HttpSource
        from logitcache.fixtures.tiny import build_tiny_models
        from server_support import ServerProcess

        tiny = build_tiny_models()
        server = ServerProcess(
            work / "server", model=str(tiny.teacher_dir), k=8, dtype="float32", max_seq_len=256
        )
        server.settings["store_root"] = str(root)
        with server:
            result["http"] = sweep("http", lambda: HttpSource(server.url, "bench"))
    result["load_avg_end"] = os.getloadavg()
    result["git"] = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
    ).stdout.strip()
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()

"""Where a local append's CPU goes outside encode and compression (issue #19, the job path's
``write`` stage).

Two measurements on a fsynced local store (``CacheWriter.open``'s defaults, as the service
writes), records of ``--length`` tokens at top-``--k`` from ``writer_steady_bench.records_pool``:

* ``reopen``: the store holds ``--prefill`` sequences; then ``--writers`` times a fresh
  ``CacheWriter`` is opened (the service opens one per job), appends one record twice and is
  closed. Reported: process CPU (``getrusage``) of the open, the first and the second append,
  medians. A fresh writer's first append used to open every array through zarr and read its
  partly filled last shard back.
* ``steady``: after the prefill one writer appends ``--appends`` groups of ``--seqs`` sequences.
  Reported per append: process CPU (user, system), each thread's CPU (``/proc/self/task``:
  ``zarr_io`` is zarr's event loop, where shards are assembled and compressed; ``asyncio_*`` the
  store's object writes), and thread CPU (``time.thread_time``) inside ``encode_batch``,
  ``encode_chunk`` (compression), the store's object writes (``DurableLocalStore._put_durable``:
  name, write, fsync, rename), ``sync_dirs`` (the directory fsync barriers) and the commit.

``LOGITCACHE_DIRECT_IO=0`` writes through the page cache (the store's opt-out).

Usage::

    .venv/bin/python benchmarks/writer_append_costs.py --k 100 --seqs 256 --appends 12
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from writer_steady_bench import VOCAB, records_pool  # noqa: E402


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _threads() -> dict[str, float]:
    """CPU seconds of every live thread, by name (tid when unnamed)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            ns = int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0])
        except OSError:
            continue
        out[names.get(int(tid), tid)] = ns / 1e9
    return out


class Timers:
    """Thread CPU inside wrapped functions, by label."""

    def __init__(self) -> None:
        self.s: dict[str, float] = defaultdict(float)
        self.saved: list[tuple[Any, str, Any]] = []

    def wrap(self, obj: Any, name: str, label: str) -> None:
        fn = getattr(obj, name)
        s = self.s

        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                s[label] += time.thread_time() - t0

        self.saved.append((obj, name, fn))
        setattr(obj, name, timed)

    def restore(self) -> None:
        for obj, name, fn in reversed(self.saved):
            setattr(obj, name, fn)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--prefill", type=int, default=800, help="sequences in the store first")
    p.add_argument("--writers", type=int, default=20, help="fresh writers (reopen)")
    p.add_argument("--seqs", type=int, default=256, help="sequences per steady append")
    p.add_argument("--appends", type=int, default=12, help="steady appends")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    from logitcache.cache_format import CacheWriter, Manifest, SequenceRecord, store
    from logitcache.cache_format import _shardwrite as shardwrite
    from logitcache.cache_format import _writer as writer_mod

    pool = records_pool(16, a.length, a.k)
    manifest = Manifest(
        teacher_model="bench",
        teacher_revision="bench",
        tokenizer_fingerprint="bench",
        vocab_size=VOCAB,
        k=a.k,
        temperature=1.0,
        logprob_mode="raw_logprobs",
        logprob_dtype="float16",
    )
    count = [0]

    def batch(n: int) -> list[Any]:
        out = []
        for _ in range(n):
            r = pool[count[0] % len(pool)]
            key = f"k{count[0]}"
            out.append(SequenceRecord(key, r.input_ids, r.topk_ids, r.topk_logprobs))
            count[0] += 1
        return out

    result: dict[str, Any] = {
        "command": " ".join(["python", "benchmarks/writer_append_costs.py", *sys.argv[1:]]),
        "machine": f"{os.cpu_count()} CPU cores (shared), no GPU",
        "direct_io": getattr(store, "direct_io_default", lambda: False)(),  # older trees: none
        "load_avg_1min_before": os.getloadavg()[0],
    }
    work = Path(tempfile.mkdtemp(prefix="writer-append-costs-"))
    try:
        url = str(work / "c")
        with CacheWriter.open(url, manifest) as w:
            for _ in range(0, a.prefill, 400):
                w.append(batch(400))
        phases: dict[str, list[float]] = {"open": [], "first": [], "second": []}
        for _ in range(a.writers):
            c0 = _cpu()
            w = CacheWriter.open(url, manifest)
            c1 = _cpu()
            w.append(batch(1))
            c2 = _cpu()
            w.append(batch(1))
            c3 = _cpu()
            w.close()
            for name, x, y in (("open", c0, c1), ("first", c1, c2), ("second", c2, c3)):
                phases[name].append((y - x) * 1e3)
        result["reopen_ms"] = {n: statistics.median(v) for n, v in phases.items()}
        print(
            "fresh writer, 1-record appends (median ms of CPU): "
            + ", ".join(f"{n} {v:.2f}" for n, v in result["reopen_ms"].items()),
            flush=True,
        )
        t = Timers()
        t.wrap(writer_mod, "encode_batch", "encode")
        t.wrap(shardwrite, "encode_chunk", "compress")
        t.wrap(store.DurableLocalStore, "_put_durable", "object writes")
        t.wrap(store.DurableLocalStore, "sync_dirs", "directory fsyncs")
        t.wrap(writer_mod, "write_root_attrs", "commit")
        try:
            with CacheWriter.open(url, manifest) as w:
                w.append(batch(a.seqs))  # the writer's first append: not timed
                th0, c0, rows = _threads(), resource.getrusage(resource.RUSAGE_SELF), 0
                t.s.clear()
                for _ in range(a.appends):
                    b = batch(a.seqs)
                    rows += sum(r.num_rows for r in b)
                    w.append(b)
                c1, th1 = resource.getrusage(resource.RUSAGE_SELF), _threads()
        finally:
            t.restore()
        n = a.appends
        user, system = (c1.ru_utime - c0.ru_utime) / n, (c1.ru_stime - c0.ru_stime) / n
        threads = {k: (v - th0.get(k, 0.0)) / n * 1e3 for k, v in th1.items()}
        workers = sum(v for k, v in threads.items() if k.startswith("asyncio_"))
        result["steady"] = {
            "seqs_per_append": a.seqs,
            "rows_per_append": rows / n,
            "user_ms": user * 1e3,
            "sys_ms": system * 1e3,
            "us_per_position": (user + system) / (rows / n) * 1e6,
            "thread_ms": {
                "main": threads.get("MainThread", 0.0),
                "zarr_io": threads.get("zarr_io", 0.0),
                "store workers": workers,
            },
            "timer_ms": {k: v / n * 1e3 for k, v in sorted(t.s.items())},
        }
        s = result["steady"]
        print(
            f"steady, {s['rows_per_append']:.0f} rows/append: user {s['user_ms']:.1f} ms, sys "
            f"{s['sys_ms']:.1f} ms per append ({s['us_per_position']:.2f} CPU-us/position); "
            "threads "
            + ", ".join(f"{k} {v:.1f}" for k, v in s["thread_ms"].items())
            + "; inside "
            + ", ".join(f"{k} {v:.1f}" for k, v in s["timer_ms"].items())
            + f" ms; load {os.getloadavg()[0]:.1f}",
            flush=True,
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

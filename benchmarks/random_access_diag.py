"""Where the time of a threaded point read goes on one machine (issue #14): hand-off latency,
scaling of the GIL-free chunk decode over threads, and page faults per sequence.

Usage (after ``random_access_bench.py`` built its stores under ROOT)::

    python benchmarks/random_access_diag.py --root ROOT --label NAME --json OUT.jsonl

Measures, in this process (run it again under other environment variables, e.g.
``LOGITCACHE_NOGIL=0`` or ``GLIBC_TUNABLES=...``, to compare):

1. ``handoff_us``: median round trip of ``ThreadPoolExecutor.submit(int).result()``.
2. ``decode_scaling``: the same ``random_access`` id chunks decoded (:func:`shardread.check_decode`)
   by 1, 2, 4, 8 threads, each thread its own chunks (no hand-off inside): speed-up over one.
3. For ``decode_threads`` in ``--threads``: ``sequence(i)`` and ``sequences(32)`` on the
   ``random_access`` store: seq/s (wall), process CPU-us and minor page faults per sequence,
   and the ``.npy`` copy's seq/s measured just before (each result dropped after its call).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--root", required=True)
    p.add_argument("--label", default="")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--reads", type=int, default=640)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    from logitcache.cache_format import CacheReader
    from logitcache.cache_format import _shardread as shardread

    root = Path(args.root)
    doc: dict = {"label": args.label, "load": os.getloadavg()}
    try:
        from logitcache.cache_format import _cdecode as cdecode

        doc["cdecode"] = cdecode.AVAILABLE
    except ImportError:
        doc["cdecode"] = None
    doc["env"] = {k: v for k, v in os.environ.items() if k.startswith(("LOGITCACHE", "GLIBC"))}
    try:
        from logitcache.cache_format import _fastdecode as fastdecode

        doc["fastdecode"] = fastdecode.ready()
        import llvmlite.binding as ll

        feats = ll.get_host_cpu_features()
        doc["llvm_cpu"] = ll.get_host_cpu_name()
        doc["llvm_features"] = {f: feats.get(f) for f in ("avx2", "f16c", "avx512f", "sse4.2")}
    except ImportError:
        doc["fastdecode"] = None

    pool = ThreadPoolExecutor(1)
    pool.submit(int).result()
    lat = []
    for _ in range(2000):
        t = time.perf_counter()
        pool.submit(int).result()
        lat.append(time.perf_counter() - t)
    doc["handoff_us"] = statistics.median(lat) * 1e6

    r = CacheReader(root / "random_access")
    lay = r._direct["topk_ids"]
    chunks = list(range(min(256, lay.length // lay.chunk_rows)))
    frames = shardread.chunk_frames([(lay, chunks)])[0]
    frames = [f.copy() for f in frames if f is not None]  # own copies: valid in every thread

    check = getattr(shardread, "check_decode", None)  # (older trees: the wrappers)
    if check is None:
        import numcodecs.blosc

        def check(f: np.ndarray, d: np.ndarray) -> str | None:
            numcodecs.blosc.decompress(f[:-4], d)
            return shardread._frame_error(f, d.nbytes)

    def work(n: int) -> None:
        dest = lay.empty(lay.chunk_rows)
        for i in range(n):
            assert check(frames[i % len(frames)], dest) is None

    scaling = {}
    base = None
    for t in (1, 2, 4, 8):
        tp = ThreadPoolExecutor(t)
        list(tp.map(work, [8] * t))
        w = time.perf_counter()
        list(tp.map(work, [2048 // t] * t))
        w = time.perf_counter() - w
        base = base or w
        scaling[t] = round(base / w, 2)
        tp.shutdown()
    doc["decode_scaling"] = scaling

    npy = {
        n: np.load(root / "npy" / f"{n}.npy", mmap_mode="r") for n in ("ids", "lp", "tail", "tok")
    }
    lengths = r.lengths.astype(np.int64)
    rs = np.concatenate([[0], np.cumsum(lengths - 1)])
    ts = np.concatenate([[0], np.cumsum(lengths)])
    rng = np.random.default_rng(1)
    picks = rng.integers(0, len(lengths), args.reads).tolist()
    batches = [b.tolist() for b in rng.integers(0, len(lengths), (args.reads // 32, 32))]

    def npy_pass() -> float:
        for _ in range(2):
            t = time.perf_counter()
            for i in picks:
                a, b = int(rs[i]), int(rs[i + 1])
                np.array(npy["ids"][a:b]), np.array(npy["lp"][a:b]), np.array(npy["tail"][a:b])
                np.array(npy["tok"][int(ts[i]) : int(ts[i + 1])])
        return len(picks) / (time.perf_counter() - t)

    for t in args.threads:
        rd = CacheReader(root / "random_access", decode_threads=t)
        for tag, fn, n in (
            ("sequence", lambda rd=rd: [rd.sequence(i) and None for i in picks], len(picks)),
            (
                "sequences32",
                lambda rd=rd: [rd.sequences(b) and None for b in batches],
                32 * len(batches),
            ),
        ):
            base_npy = npy_pass()
            fn()
            f0, c0, w0 = faults(), time.process_time(), time.perf_counter()
            fn()
            w, c, f = time.perf_counter() - w0, time.process_time() - c0, faults() - f0
            doc[f"{tag}_t{t}"] = {
                "seq_per_s": n / w,
                "x_npy": n / w / base_npy,
                "cpu_us_per_seq": c / n * 1e6,
                "minflt_per_seq": f / n,
                "npy_seq_per_s": base_npy,
            }
            print(args.label, tag, t, {k: round(v, 3) for k, v in doc[f"{tag}_t{t}"].items()})
    keys = ("label", "cdecode", "fastdecode", "llvm_cpu", "llvm_features", "handoff_us")
    print(json.dumps({k: doc.get(k) for k in (*keys, "decode_scaling")}))
    if args.json:  # one line per run, appended
        with args.json.open("a") as f:
            f.write(json.dumps(doc) + "\n")


if __name__ == "__main__":
    main()

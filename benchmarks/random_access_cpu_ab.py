"""CPU time of ``sequence(i)`` / ``sequences(32)`` on one store, for A/B runs on a loaded box.

Usage (from the repository root)::

    python benchmarks/random_access_cpu_ab.py STORE [--threads 1] [--reps 9]

Prints the calling thread's CPU time per sequence (``time.thread_time``), best and median of
``--reps`` passes over the same 60 random sequences and of one ``sequences`` call of 32: the
best of several passes is the least disturbed by other processes. For before/after, run it
alternately with ``PYTHONPATH`` pointing at two copies of the package (see
benchmarks/results/client.md, random access). With ``--threads`` > 1 the other threads' CPU is
not counted (use random_access_bench.py for wall-clock figures).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("store")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    from logitcache.cache_format import CacheReader

    r = CacheReader(args.store, decode_threads=args.threads)
    rng = np.random.default_rng(args.seed)
    picks = rng.integers(0, r.num_sequences, 60).tolist()
    batch = rng.integers(0, r.num_sequences, 32).tolist()
    rows = float(np.mean([r.lengths[i] - 1 for i in picks]))

    def best(fn, n: int) -> tuple[float, float]:
        out = []
        for _ in range(args.reps):
            c = time.thread_time()
            fn()
            out.append((time.thread_time() - c) / n * 1e6)
        return min(out), float(np.median(out))

    one = best(lambda: [r.sequence(i) for i in picks], len(picks))
    many = best(lambda: r.sequences(batch), len(batch))
    print(
        f"{args.store} t{args.threads}: sequence best {one[0]:.0f} CPU-us/seq (median "
        f"{one[1]:.0f}); sequences(32) best {many[0]:.0f} (median {many[1]:.0f}); mean rows "
        f"{rows:.0f}; load {os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    main()

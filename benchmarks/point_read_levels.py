"""Thread CPU of one ``sequence(i)`` by layer of the compiled point read (issue #14).

Usage (a store built by ``random_access_bench.py``, e.g. ``/tmp/rab/random_access_raw``)::

    python benchmarks/point_read_levels.py STORE [--reads 400] [--passes 3] [--seed 0]

The same ``--reads`` random sequences are read ``--passes`` times after a warm-up; every layer
is wrapped with a ``time.thread_time_ns`` timer (CPU of this thread: robust on a loaded box),
cumulative, in microseconds per sequence: ``kernel`` (the compiled ``read_items`` call),
``_run``, ``read_arrays``, ``_fetch_fast``, ``read_spans``, ``_sequences`` and ``sequence`` (the
whole call). The wrappers add ~1 us per layer. Compare trees with ``benchmarks/run_with_tree.py``,
alternating them on the same store.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np


def _timed(fn: Callable[..., Any], label: str, acc: dict[str, int]) -> Callable[..., Any]:
    def wrapped(*a: Any, **kw: Any) -> Any:
        t = time.thread_time_ns()
        try:
            return fn(*a, **kw)
        finally:
            acc[label] = acc.get(label, 0) + time.thread_time_ns() - t

    return wrapped


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("store")
    p.add_argument("--reads", type=int, default=400)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    from logitcache.cache_format import CacheReader
    from logitcache.cache_format import _fastdecode as fastdecode

    r = CacheReader(args.store)
    if not fastdecode.ready():
        raise SystemExit("the compiled point read is not available here (numba)")
    idx = np.random.default_rng(args.seed).integers(0, len(r), args.reads).tolist()
    for i in idx[: max(1, args.reads // 8)]:
        r.sequence(i)
    acc: dict[str, int] = {}
    kernels = fastdecode._kernels
    assert kernels is not None
    kernels["read_items"] = _timed(kernels["read_items"], "kernel", acc)
    from logitcache.cache_format import _decode

    for obj, name in ((fastdecode, "_run"), (fastdecode, "read_arrays"), (_decode, "_fetch_fast")):
        setattr(obj, name, _timed(getattr(obj, name), name, acc))
    for name in ("read_spans", "_sequences"):
        setattr(r, name, _timed(getattr(r, name), name, acc))
    for _ in range(args.passes):
        acc.clear()
        t = time.thread_time_ns()
        for i in idx:
            r.sequence(i)
        acc["sequence"] = time.thread_time_ns() - t
        print({k: round(v / len(idx) / 1e3, 1) for k, v in acc.items()})


if __name__ == "__main__":
    main()

"""One process, one loader epoch slice: user and system CPU and peak RSS of a ``CacheDataset``
with the trainer's shuffle (``TRAINER_SHUFFLE``: 64-sequence blocks, windows of 4, 24 lanes) and
``point_reads`` as given (issue #14, session 8: system time from transparent huge pages).

Usage (a store built by ``client_scaling.py``, e.g. ``--root /tmp/lcs8 --positions 2000000``)::

    python benchmarks/loader_sys_time.py /tmp/lcs8/bench auto 1    # point_reads: auto|true|false
    NOHP=1 python benchmarks/loader_sys_time.py /tmp/lcs8/bench true 1   # numpy's THP request off

Arguments: store, point_reads, read_threads; prints one line (``--batches``, default 300, or the
epoch if shorter). Run the settings alternately: the VM's system time varies run to run.
"""

from __future__ import annotations

import argparse
import os
import resource

import numpy as np
from logitcache.client import CacheDataset, ReadOptions, StreamConfig
from logitcache.client.config import TRAINER_SHUFFLE


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("store")
    p.add_argument("point_reads", choices=["auto", "true", "false"])
    p.add_argument("read_threads", type=int)
    p.add_argument("--batches", type=int, default=300)
    a = p.parse_args()
    if os.environ.get("NOHP"):
        np._core.multiarray._set_madvise_hugepage(False)
    pr = None if a.point_reads == "auto" else a.point_reads == "true"
    ds = CacheDataset(
        a.store,
        StreamConfig(tokens_per_item=2048, batch_size=8, **TRAINER_SHUFFLE),
        ReadOptions(point_reads=pr, read_threads=a.read_threads),
    )
    n = 0
    for _ in ds:
        n += 1
        if n >= a.batches:
            break
    ru = resource.getrusage(resource.RUSAGE_SELF)
    print(
        f"point_reads={a.point_reads} batches {n} maxrss MB {ru.ru_maxrss // 1024} "
        f"user {ru.ru_utime:.1f} sys {ru.ru_stime:.1f}"
    )


if __name__ == "__main__":
    main()

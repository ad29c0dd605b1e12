"""Do blosc decompression, CRC32C and the torch row kernels run in parallel in Python threads?

Usage: ``python benchmarks/random_access_threads.py`` (prints JSON). For each of 1, 2, 4, 8
threads, the same total work split across a thread pool: wall time ratio vs one thread (ideal:
the thread count). Blosc with numcodecs' default ``use_threads`` (None) and with ``False``.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import google_crc32c
import numcodecs.blosc as blosc
import numpy as np


def scaling(fn, total: int, threads=(1, 2, 4, 8)) -> dict[int, float]:
    out = {}
    base = None
    for t in threads:
        pool = ThreadPoolExecutor(t)
        list(pool.map(fn, [max(1, total // t)] * t))  # warm
        w = time.perf_counter()
        list(pool.map(fn, [total // t] * t))
        w = time.perf_counter() - w
        base = base or w
        out[t] = round(base / w, 2)
        pool.shutdown()
    return out


def main() -> None:
    rng = np.random.default_rng(0)
    data = (rng.zipf(1.3, size=(2048, 100)) % 128256).astype(np.int32)
    res: dict = {"cpus": os.cpu_count(), "load": os.getloadavg()}
    for cname, chunk in ((b"lz4", 256), (b"lz4", 2048), (b"zstd", 2048)):
        part = np.ascontiguousarray(data[:chunk])
        fr = blosc.compress(
            part, cname, 1 if cname == b"zstd" else 5, blosc.BITSHUFFLE, blocksize=part.nbytes
        )

        def work(n, fr=fr, part=part):
            d = np.empty_like(part)
            for _ in range(n):
                blosc.decompress(fr, d)

        for ut in (None, False):
            blosc.use_threads = ut
            key = f"blosc_{cname.decode()}_{chunk}_use_threads_{ut}"
            res[key] = scaling(work, 400 * 256 // chunk)
    blosc.use_threads = None
    buf = np.frombuffer(blosc.compress(data, b"lz4", 5, blosc.SHUFFLE), np.uint8)
    res["crc32c"] = scaling(lambda n: [google_crc32c.value(buf) for _ in range(n)], 400)
    import torch

    d = rng.integers(0, 60000, size=(320, 100)).astype(np.uint16).view(np.int16)
    t = torch.from_numpy(d)
    res["torch_cumsum_32k"] = scaling(lambda n: [torch.cumsum(t, 1) for _ in range(n)], 800)
    res["numpy_copy_1MB"] = scaling(lambda n: [data.copy() for _ in range(n)], 800)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

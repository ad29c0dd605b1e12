"""The writer alone at steady state: CPU per position of appends of a given size (issue #19).

Every append replaces each partly filled shard object whole (FORMAT.md W3), so what an append costs
depends on how full the shards it lands in already are, not only on its own rows: the per-row
``[n]`` arrays' shards hold 524,288 rows and ``input_ids``' 65,536 tokens (1,048,576 in stores
created before 2026-12-04), so a long run of small appends rewrites them dozens of times; and every
append pays ~20 ms of CPU whatever its size (an object and a metadata write per array, each array's
partly filled last chunk encoded again, fsyncs, the commit). This bench appends equal groups of
sequences (``--seqs`` sequences of ``--length`` tokens, top-``k`` rows of a peaked random
distribution) to a local store (fsynced, as the service writes) until it holds ``--total`` rows, and
reports the process CPU (user and system, ``os.times``) per position and the bytes written per
position over the appends after the first ``--skip`` rows. Sizes alternate within each round.

Usage::

    .venv/bin/python benchmarks/writer_steady_bench.py --seqs 32 64 128 256 --rounds 2 \\
        --json benchmarks/results/writer_steady.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

VOCAB = 4096


def records_pool(n: int, length: int, k: int, seed: int = 0) -> list[Any]:
    """``n`` records (keys set later) with k distinct ids per row and peaked logprobs."""
    from logitcache.cache_format import SequenceRecord

    rng = np.random.default_rng(seed)
    m = length - 1
    out = []
    for _ in range(n):
        start = rng.integers(0, VOCAB, (m, 1))
        stride = 2 * rng.integers(0, VOCAB // 2, (m, 1)) + 1
        ids = ((start + stride * np.arange(k)[None, :]) % VOCAB).astype(np.int32)
        g = rng.gamma(0.3, size=(m, k + 64))
        lp = np.log(-np.sort(-(g / g.sum(1, keepdims=True)), axis=1)[:, :k]).astype(np.float32)
        toks = rng.integers(0, VOCAB, length).astype(np.int32)
        out.append(SequenceRecord(key="x", input_ids=toks, topk_ids=ids, topk_logprobs=lp))
    return out


def one(seqs: int, pool: list[Any], k: int, total: int, skip: int) -> dict[str, Any]:
    from logitcache.cache_format import CacheWriter, Manifest, SequenceRecord
    from logitcache.cache_format import store as store_mod

    written = [0]
    put = store_mod.DurableLocalStore._put_durable

    def counted(self: Any, path: Path, value: Any, exclusive: bool) -> None:
        written[0] += len(value.as_buffer_like())
        put(self, path, value, exclusive)

    store_mod.DurableLocalStore._put_durable = counted  # type: ignore[method-assign]
    manifest = Manifest(
        teacher_model="bench",
        teacher_revision="bench",
        tokenizer_fingerprint="bench",
        vocab_size=VOCAB,
        k=k,
        temperature=1.0,
        logprob_mode="raw_logprobs",
        logprob_dtype="float16",
    )
    work = tempfile.mkdtemp(prefix="writer-steady-")
    try:
        w = CacheWriter.open(str(Path(work) / "c"), manifest)
        rows = i = pos = 0
        user = system = 0.0
        b0 = None
        while rows < total:
            batch = []
            for _ in range(seqs):
                r = pool[i % len(pool)]
                batch.append(
                    SequenceRecord(
                        key=f"k{i}",
                        input_ids=r.input_ids,
                        topk_ids=r.topk_ids,
                        topk_logprobs=r.topk_logprobs,
                    )
                )
                i += 1
            n = sum(r.num_rows for r in batch)
            if rows >= skip and b0 is None:
                b0 = written[0]
            t0 = os.times()
            w.append(batch)
            t1 = os.times()
            if rows >= skip:
                user += t1.user - t0.user
                system += t1.system - t0.system
                pos += n
            rows += n
        w.close()
    finally:
        store_mod.DurableLocalStore._put_durable = put  # type: ignore[method-assign]
        shutil.rmtree(work, ignore_errors=True)
    return {
        "seqs_per_append": seqs,
        "rows_per_append": seqs * (len(pool[0].input_ids) - 1),
        "positions_timed": pos,
        "user_us_per_position": user / pos * 1e6,
        "sys_us_per_position": system / pos * 1e6,
        "us_per_position": (user + system) / pos * 1e6,
        "bytes_written_per_position": (written[0] - (b0 or 0)) / pos,
        "load_avg_1min": os.getloadavg()[0],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[32, 64, 128, 256])
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--total", type=int, default=600_000, help="rows the store grows to")
    p.add_argument("--skip", type=int, default=200_000, help="rows appended before timing")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    if a.total <= a.skip or a.length < 2 or a.rounds < 1 or min(a.seqs) < 1:
        p.error("--total > --skip, --length >= 2, --rounds >= 1 and --seqs >= 1 are needed")
    pool = records_pool(256, a.length, a.k)
    one(4, pool, a.k, 4 * a.length, 0)  # warm-up: imports, first calls
    runs = []
    for rnd in range(a.rounds):
        for s in a.seqs:
            r = one(s, pool, a.k, a.total, a.skip)
            r["round"] = rnd
            runs.append(r)
            print(
                f"{r['rows_per_append']:>6} rows/append: {r['us_per_position']:.2f} CPU-us/position"
                f" (user {r['user_us_per_position']:.2f}, sys {r['sys_us_per_position']:.2f}), "
                f"{r['bytes_written_per_position']:.0f} B written/position, "
                f"load {r['load_avg_1min']:.1f}",
                flush=True,
            )
    summary = {
        str(s): statistics.median(r["us_per_position"] for r in runs if r["seqs_per_append"] == s)
        for s in a.seqs
    }
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(
            json.dumps(
                {
                    "command": " ".join(
                        ["python", "benchmarks/writer_steady_bench.py", *sys.argv[1:]]
                    ),
                    "machine": f"{os.cpu_count()} CPU cores (shared), no GPU",
                    "k": a.k,
                    "length": a.length,
                    "total_rows": a.total,
                    "skip_rows": a.skip,
                    "median_us_per_position_by_seqs": summary,
                    "runs": runs,
                },
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()

"""The ``index`` mode of :mod:`benchmarks.format`: what opening a cache of many sequences costs.

    python -m benchmarks.format index --sequences 1000 100000 1000000 --store-dir /tmp/lc-index

Builds (once per ``--store-dir``; reused by later runs, e.g. a baseline under another tree via
``python -m benchmarks.harness with-tree``) one synthetic cache per ``--sequences`` value:
sequences of 2 tokens (1 row each), k=4, vocab 1000, keys ``doc-<10 digits>``, written by
``CacheWriter`` in appends of 50,000 sequences without fsync. Then, each in a fresh Python
process (imports done before the clock starts), ``--repeats`` times:

* reader: ``CacheReader(url, decoder="numpy")`` wall seconds and RSS growth after it, then
  the first ``index_of(key)`` (seconds, and RSS growth after it, counted from before the
  open), then the first ``sequence(i)`` (seconds; the peak RSS includes what it imports);
* writer: ``CacheWriter.open(url, manifest)`` wall seconds and RSS growth, then the first
  ``contains(key)`` (seconds, RSS growth after it). The probes append nothing;
* validate (caches of at most ``--validate-max`` sequences): ``validate(url)`` wall seconds, the
  first call (kernels loaded or compiled) and a second.

The median of the repeats is reported. The probes import ``logitcache`` from the tree this
process imports it from (so ``with-tree`` measures that tree's code).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import ROOT, Recorder, log, machine_line, md_table, scratch

K, VOCAB, BATCH = 4, 1000, 50_000


def _key(i: int) -> str:
    return f"doc-{i:010d}"


def build(url: Path, n: int, seed: int = 0) -> None:
    """A cache of ``n`` 2-token sequences at ``url`` and its manifest as ``url.json``."""
    from logitcache.cache_format import CacheWriter, Manifest, SequenceRecord

    m = Manifest(
        teacher_model="synthetic-index",
        tokenizer_fingerprint="synthetic-index",
        vocab_size=VOCAB,
        k=K,
        dataset="synthetic (benchmarks/format_index.py)",
    )
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((BATCH, VOCAB)), axis=1)[:, :K].astype(np.int32)
    lp = np.sort(-rng.random((BATCH, K)).astype(np.float32) * 5 - 0.01, axis=1)[:, ::-1]
    toks = rng.integers(0, VOCAB, size=(BATCH, 2)).astype(np.int32)
    t0 = time.perf_counter()
    with CacheWriter.open(url, m, fsync=False) as w:
        for a in range(0, n, BATCH):
            b = min(n, a + BATCH)
            w.append(
                SequenceRecord(
                    _key(i), toks[j], ids[j : j + 1], np.ascontiguousarray(lp[j : j + 1])
                )
                for j, i in enumerate(range(a, b))
            )
    Path(f"{url}.json").write_text(m.model_dump_json())
    log(f"built {n:,} sequences in {time.perf_counter() - t0:.1f} s")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def probe(role: str, url: str, n: int, tree: str) -> None:
    """Run in a fresh process: print one JSON line of timings and RSS growths (bytes)."""
    import gc

    from benchmarks.harness import PeakRSS, use_tree

    if tree:
        use_tree(tree)
    from logitcache.cache_format import CacheReader, CacheWriter, Manifest

    manifest = Manifest.model_validate_json(Path(f"{url}.json").read_text())
    key = _key(n // 3)
    gc.collect()
    out: dict[str, float] = {}
    with PeakRSS() as peak:
        t0 = time.perf_counter()
        if role == "validate":
            from logitcache.cache_format import validate

            validate(url)  # the first call loads (or compiles) its kernels
            t1 = time.perf_counter()
            validate(url)
            out["first_s"], out["second_s"] = t1 - t0, time.perf_counter() - t1
        elif role == "reader":
            r = CacheReader(url, decoder="numpy")  # no compiled-kernel load in the timings
            t1 = time.perf_counter()
            out["open_s"], out["rss_open"] = t1 - t0, _rss() - peak.start
            assert r.index_of(key) == n // 3
            t2 = time.perf_counter()
            out["first_index_of_s"], out["rss_after_key"] = t2 - t1, _rss() - peak.start
            r.sequence(n // 2)  # the first read imports and sets up the decoder: its RSS
            out["first_sequence_s"] = time.perf_counter() - t2  # is not counted
        else:
            w = CacheWriter.open(url, manifest, fsync=False)
            t1 = time.perf_counter()
            out["open_s"], out["rss_open"] = t1 - t0, _rss() - peak.start
            assert w.contains(key) and not w.contains("absent")
            out["first_contains_s"] = time.perf_counter() - t1
            out["rss_after_key"] = _rss() - peak.start
            w.close()
    out["rss_peak"] = peak.growth  # reader: including the first read's
    print(json.dumps(out))


def _probe_in_child(role: str, url: Path, n: int) -> dict[str, float]:
    import logitcache.cache_format as cf

    tree = str(Path(cf.__path__[0]))
    code = (
        f"from benchmarks.format_index import probe; probe({role!r}, {str(url)!r}, {n}, {tree!r})"
    )
    got = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False
    )
    if got.returncode:
        raise RuntimeError(f"probe {role} {url} failed:\n{got.stderr[-3000:]}")
    return dict(json.loads(got.stdout.strip().splitlines()[-1]))


def run_index(args: argparse.Namespace) -> None:
    rec = Recorder("format", "index", csv_path=args.csv)
    label = os.environ.get("BENCH_TREE") or args.label
    table = []
    with scratch("lc-format-index-") as tmp:
        root = Path(args.store_dir) if args.store_dir else tmp
        root.mkdir(parents=True, exist_ok=True)
        for n in args.sequences:
            url = root / f"n{n}"
            if not Path(f"{url}.json").exists():
                build(url, n, args.seed)
            got: dict[str, dict[str, list[float]]] = {"reader": {}, "writer": {}}
            roles = ["reader", "writer"]
            if n <= args.validate_max:
                roles.append("validate")
                got["validate"] = {}
            for _ in range(args.repeats):
                for role in roles:
                    for m, v in _probe_in_child(role, url, n).items():
                        got[role].setdefault(m, []).append(v)
            med = {
                role: {m: statistics.median(v) for m, v in ms.items()} for role, ms in got.items()
            }
            log(f"{label} n={n:,}: {json.dumps(med)}")
            for role, ms in med.items():
                for m, v in ms.items():
                    unit = "s" if m.endswith("_s") else "bytes"
                    cfg = {"sequences": n, "k": K, "tokens_per_sequence": 2, "tree": label}
                    rec.add(
                        f"{label} n={n}", f"{role}_{m}", unit, v, samples=args.repeats, config=cfg
                    )
            rd, wr = med["reader"], med["writer"]
            va = med.get("validate")
            val = f"{va['first_s']:.2f} / {va['second_s']:.2f}" if va else "-"
            table.append(
                [
                    label,
                    f"{n:,}",
                    f"{rd['open_s']:.3f}",
                    f"{rd['rss_open'] / 2**20:.1f}",
                    f"{rd['rss_peak'] / 2**20:.1f}",
                    f"{rd['first_sequence_s']:.3f}",
                    f"{rd['first_index_of_s']:.3f}",
                    f"{rd['rss_after_key'] / 2**20:.1f}",
                    f"{wr['open_s']:.3f}",
                    f"{wr['rss_open'] / 2**20:.1f}",
                    f"{wr['first_contains_s']:.3f}",
                    f"{wr['rss_after_key'] / 2**20:.1f}",
                    val,
                ]
            )
    rec.save()
    print(f"\n{args.repeats} repeats (median); {machine_line(rec.machine)}\n")
    header = [
        "tree",
        "sequences",
        "reader open s",
        "RSS +MB",
        "peak +MB",
        "1st sequence s",
        "1st index_of s",
        "RSS +MB after",
        "writer open s",
        "RSS +MB",
        "1st contains s",
        "RSS +MB after",
        "validate 1st / 2nd s",
    ]
    print(md_table(header, table))


def add_options(s: argparse.ArgumentParser) -> None:
    s.add_argument("--sequences", type=int, nargs="+", default=[1000, 100_000, 1_000_000])
    s.add_argument("--store-dir", default="", help="keep (and reuse) the built caches here")
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--label", default="this tree")
    s.add_argument(
        "--validate-max", type=int, default=100_000, help="validate caches up to this size"
    )

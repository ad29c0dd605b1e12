"""Random access (issue #14): ``sequence(i)`` and ``sequences(idx)`` vs an uncompressed ``.npy``
copy, for each layout preset, side by side in one run.

Usage (from the repository root)::

    python benchmarks/random_access_bench.py --root /tmp/ra-bench --positions 2000000 \\
        --layouts default random_access --threads 1 8 --json OUT/client_random.json

1. **build**: one set of sequences (log-normal lengths, median 490 tokens, clipped to [16, 8192];
   rows are slices of a pool of realistic rows from ``format_bench.py``'s generators: Zipf ids in
   a BPE-like id order, sorted float16 logprobs with a tail; k=100, vocab 128,256, the same
   recipe as ``client_scaling.py``) written once per layout preset (``spec.LAYOUTS``) through
   ``CacheWriter``; bytes/position = store size / positions. The same sequences are saved as
   uncompressed ``.npy`` files (int32 ids, float16 logprobs, float32 tail, int32 tokens).
2. **npy**: the baseline: for each random ``i``, its slices of the ``np.load(mmap_mode="r")``
   arrays copied out (page cache warm), the same indices as the reader's.
3. per layout and per ``--threads`` value (``CacheReader(decode_threads=t)``):
   ``sequence(i)`` one at a time (float32 logprobs, the default) and ``sequences(idx)`` with
   ``--batch`` random indices per call; also the range path (``point_reads=False``, the reader
   before point reads) with one thread, and the sequential reader (``rows`` + ``tokens`` of
   64-sequence ranges) in positions/s, so the preset's cost on the loader's path is visible.
   Every figure: wall-clock and process CPU time (all threads), each as a ratio to the ``.npy``
   baseline's wall / CPU figure measured just before it.
4. **check**: the point path returns bit-identical values to the range path, and ``validate``
   accepts every store (``--validate``).

Indices are uniform over all sequences; each measurement runs once untimed (warm) then timed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

K = 100
VOCAB = 128_256


def log(*a: Any) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def make_records(positions: int, seed: int = 0, pool_rows: int = 65536) -> list:
    """The benchmark's sequences (see the module docstring), as views of one row pool."""
    import format_bench as fb
    from logitcache.cache_format import SequenceRecord

    rng = np.random.default_rng(seed)
    fb.VOCAB, fb.K = VOCAB, K
    cdf = fb.zipf_cdf(VOCAB, 1.05)
    rmap = fb.id_map(VOCAB, "bpe", rng)
    ids = fb.topk_ids(pool_rows, rng, cdf, rmap)
    lp, tail = fb.logprobs(pool_rows, rng)
    lp = lp.astype(np.float16).astype(np.float32)  # the stored values, so the .npy copy matches
    tok_pool = rmap[np.minimum(np.searchsorted(cdf, rng.random(pool_rows)), VOCAB - 1)]
    out, rows = [], 0
    while rows < positions:
        length = min(int(np.clip(rng.lognormal(np.log(490), 0.9), 16, 8192)), pool_rows)
        o = int(rng.integers(0, pool_rows - length + 1))
        t = int(rng.integers(0, pool_rows - length + 1))
        out.append(
            SequenceRecord(
                f"s{len(out)}",
                tok_pool[t : t + length].astype(np.int32),
                ids[o : o + length - 1],
                lp[o : o + length - 1],
                tail[o : o + length - 1],
            )
        )
        rows += length - 1
    return out


def layout_of(label: str) -> Any:
    """``preset`` or ``preset:field=value,...`` (an experiment: the preset with those fields;
    integers for sizes, codec names as in ``cache_format/codecs.py``)."""
    from dataclasses import replace

    from logitcache.cache_format import spec

    name, _, over = label.partition(":")
    pairs = [kv.split("=") for kv in over.split(",") if kv]
    fields = {k: int(v) if v.isdigit() else v for k, v in pairs}
    layout = spec.layout_named(name)
    return replace(layout, **fields, name=label) if fields else layout


def build(url: str, records: list, layout_name: str) -> dict[str, Any]:
    import numcodecs.blosc
    from logitcache.cache_format import CacheWriter, Manifest

    numcodecs.blosc.set_nthreads(1)
    manifest = Manifest(
        teacher_model="random-access-synthetic",
        tokenizer_fingerprint="random-access",
        vocab_size=VOCAB,
        k=K,
        dataset="synthetic (benchmarks/random_access_bench.py)",
    )
    t0, c0 = time.perf_counter(), time.process_time()
    layout = layout_of(layout_name)
    with CacheWriter.open(url, manifest, layout=layout, fsync=False) as w:
        batch, n = [], 0
        for rec in records:
            batch.append(rec)
            n += rec.topk_ids.shape[0]
            if n >= 500_000:
                w.append(batch)
                batch, n = [], 0
        if batch:
            w.append(batch)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    positions = sum(r.topk_ids.shape[0] for r in records)
    nbytes = sum(p.stat().st_size for p in Path(url).rglob("*") if p.is_file())
    return {
        "layout": layout_name,
        "positions": positions,
        "sequences": len(records),
        "store_bytes": nbytes,
        "bytes_per_position": nbytes / positions,
        "write_s": wall,
        "write_cpu_s": cpu,
        "write_pos_per_cpu_s": positions / cpu,
    }


def save_npy(d: Path, records: list) -> None:
    d.mkdir(parents=True, exist_ok=True)
    np.save(d / "ids.npy", np.concatenate([r.topk_ids for r in records]))
    np.save(d / "lp.npy", np.concatenate([r.topk_logprobs for r in records]).astype(np.float16))
    np.save(d / "tail.npy", np.concatenate([r.tail_mass for r in records]))
    np.save(d / "tok.npy", np.concatenate([r.input_ids for r in records]))


def timed(fn) -> tuple[float, float]:
    fn()  # warm
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def profile(reader: Any, picks: list[int], top: int = 14) -> list[str]:
    """cProfile of ``sequence(i)`` over ``picks`` (one thread): the top functions by own time."""
    import cProfile
    import io
    import pstats

    for i in picks[:20]:
        reader.sequence(i)
    pr = cProfile.Profile()
    pr.enable()
    for i in picks:
        reader.sequence(i)
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(top)
    return [line for line in buf.getvalue().splitlines() if line.strip()][-top - 2 :]


def _proc_cpu(pids: list[int]) -> float:
    """CPU seconds (user + system) used so far by the processes ``pids`` (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / tick


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def processes(url, ref, n_proc, picks, batches, npy, entry, batch) -> dict[str, Any]:
    """``CacheReader(read_processes=n_proc)`` (the caller + ``n_proc`` processes): start-up,
    checks against the range path, then ``sequence(i)`` and ``sequences(batch)``; CPU figures
    count the reader processes too.
    Empty if the code measured has no reader processes (an older tree)."""
    from logitcache.cache_format import CacheReader

    try:
        r = CacheReader(url, read_processes=n_proc)
    except TypeError:
        return {}
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    first = batches[0].tolist()
    for a, b in zip(r.sequences(first), ref.sequences(first), strict=True):
        assert a.equals(b), "read_processes: batched read differs from the range path"
    out[f"proc{n_proc}_start_s"] = time.perf_counter() - t0
    for i in picks[:20]:
        assert r.sequence(i).equals(ref.sequence(i)), f"read_processes: sequence {i} differs"
    pids = [p.pid for p in r._procs.procs] if r._procs is not None else []
    out[f"proc{n_proc}_worker_rss_mib"] = [_rss_mib(p) for p in pids]
    out[f"proc{n_proc}_parent_rss_mib"] = _rss_mib(os.getpid())
    n_batched = batches.size
    for tag, fn, n in (
        ("sequence", lambda: each(r.sequence, picks), len(picks)),
        (f"sequences{batch}", lambda: each(r.sequences, [b.tolist() for b in batches]), n_batched),
    ):
        base = npy()
        fn()  # warm
        k0, t0, c0 = _proc_cpu(pids), time.perf_counter(), time.process_time()
        fn()
        w, c = time.perf_counter() - t0, time.process_time() - c0
        workers = _proc_cpu(pids) - k0
        e = entry(w, c + workers, n, base)
        e["workers_cpu_s"] = workers
        e["parent_cpu_s"] = c
        out[f"{tag}_p{n_proc}"] = e
        log(url, f"{tag}_p{n_proc}", e)
    r.close()
    return out


KEEP = True
"""``--drop`` sets it False: each result is dropped right after its call (as a loader does after
collating), instead of all results of a pass being kept until its end."""


def each(fn, items) -> list:
    """``fn(x)`` for every ``x``: all results kept (a list) or each dropped at once (``--drop``)."""
    if KEEP:
        return [fn(x) for x in items]
    for x in items:
        fn(x)
    return []


def run(args: argparse.Namespace) -> dict[str, Any]:
    from logitcache.cache_format import CacheReader, validate
    from logitcache.cache_format import _pointread as pointread

    root = Path(args.root)
    # --reuse with every store and the .npy copy there: the sequence lengths are all a run needs
    # from the records (generating them costs ~10 s of a device call per run)
    saved = root / "npy" / f"lengths_{args.positions}_{args.seed}.npy"
    built = all((root / name / "zarr.json").exists() for name in args.layouts)
    records: list | None = None
    if args.reuse and built and saved.exists() and (root / "npy" / "tok.npy").exists():
        lengths = np.load(saved)
        log("reusing", root, "and its sequence lengths")
    else:
        log("generating records")
        records = make_records(args.positions, args.seed)
        lengths = np.array([r.length for r in records], dtype=np.int64)
        if not (args.reuse and (root / "npy" / "tok.npy").exists()):
            save_npy(root / "npy", records)
        np.save(saved, lengths)
    rs = np.concatenate([[0], np.cumsum(lengths - 1)])
    ts = np.concatenate([[0], np.cumsum(lengths)])
    doc: dict[str, Any] = {"builds": {}, "layouts": {}}
    for name in args.layouts:
        if args.reuse and (root / name / "zarr.json").exists():
            nbytes = sum(p.stat().st_size for p in (root / name).rglob("*") if p.is_file())
            positions = int(lengths.sum() - len(lengths))
            doc["builds"][name] = {"layout": name, "reused": True, "store_bytes": nbytes}
            doc["builds"][name]["bytes_per_position"] = nbytes / positions
            continue
        log("build", name)
        assert records is not None  # (generated above whenever a store is missing)
        doc["builds"][name] = build(str(root / name), records, name)
        log(doc["builds"][name])
    del records
    mi, ml, mt, mk = (
        np.load(root / "npy" / f"{n}.npy", mmap_mode="r") for n in ("ids", "lp", "tail", "tok")
    )
    n_seq = len(lengths)
    rng = np.random.default_rng(args.seed + 1)
    picks = rng.integers(0, n_seq, size=args.reads).tolist()
    batches = rng.integers(0, n_seq, size=(max(1, args.reads // args.batch), args.batch))
    n_batched = batches.size
    doc["mean_length"] = float(lengths[picks].mean())

    def npy_one(i: int) -> tuple:
        a, b = int(rs[i]), int(rs[i + 1])
        return (
            np.array(mi[a:b]),
            np.array(ml[a:b]),
            np.array(mt[a:b]),
            np.array(mk[int(ts[i]) : int(ts[i + 1])]),
        )

    def npy() -> tuple[float, float]:
        return timed(lambda: each(npy_one, picks))

    def entry(w: float, c: float, n: int, base: tuple[float, float]) -> dict[str, float]:
        per_w, per_c = n / w, n / c
        return {
            "seq_per_s": per_w,
            "seq_per_cpu_s": per_c,
            "x_npy_wall": per_w / (len(picks) / base[0]),
            "x_npy_cpu": per_c / (len(picks) / base[1]),
            "npy_seq_per_s": len(picks) / base[0],
            "npy_seq_per_cpu_s": len(picks) / base[1],
        }

    base = npy()
    doc["npy"] = {"seq_per_s": len(picks) / base[0], "seq_per_cpu_s": len(picks) / base[1]}
    log("npy", doc["npy"])
    for name in args.layouts:
        url = str(root / name)
        res: dict[str, Any] = {}
        ref = CacheReader(url)
        ref.point_reads = False
        res["layout_name"] = ref.layout_name
        # correctness: point path == range path, bit for bit
        check = CacheReader(url, decode_threads=max(args.threads))
        for i in picks[:20]:
            a, b = check.sequence(i), ref.sequence(i)
            assert a.equals(b), f"point read of sequence {i} differs ({name})"
        first = batches[0].tolist()
        for a, b in zip(check.sequences(first), ref.sequences(first), strict=True):
            assert a.equals(b), f"batched point read differs ({name})"
        res["point_equals_range_path"] = True
        if not args.skip_range_path:
            base = npy()
            w, c = timed(lambda ref=ref: [ref.sequence(i) for i in picks])
            res["range_path_sequence"] = entry(w, c, len(picks), base)
            w, c = timed(lambda ref=ref: [ref.sequences(b.tolist()) for b in batches])
            res["range_path_sequences"] = entry(w, c, n_batched, base)
        default_min = pointread.PARALLEL_MIN_BYTES
        for t in args.threads:
            r = CacheReader(url, decode_threads=t)
            for mb in args.min_bytes if t > 1 and args.min_bytes else [None]:
                pointread.PARALLEL_MIN_BYTES = default_min if mb is None else mb
                tag = f"t{t}" if mb is None else f"t{t}_mb{mb // 1024}k"
                base = npy()
                w, c = timed(lambda r=r: each(r.sequence, picks))
                res[f"sequence_{tag}"] = entry(w, c, len(picks), base)
                w, c = timed(lambda r=r: each(r.sequences, [b.tolist() for b in batches]))
                res[f"sequences{args.batch}_{tag}"] = entry(w, c, n_batched, base)
                log(name, tag, res[f"sequence_{tag}"], res[f"sequences{args.batch}_{tag}"])
            pointread.PARALLEL_MIN_BYTES = default_min

        for n_proc in args.processes:
            res.update(processes(url, ref, n_proc, picks, batches, npy, entry, args.batch))

        def sequential(r: Any = ref) -> None:
            for a in range(0, min(n_seq, args.seq_sequences), 64):
                b = min(a + 64, n_seq)
                r.rows(int(rs[a]), int(rs[b]))
                r.tokens(int(ts[a]), int(ts[b]))

        w, c = timed(sequential)
        pos = int(rs[min(n_seq, args.seq_sequences)])
        res["sequential_rows_pos_per_s"] = pos / w
        res["sequential_rows_pos_per_cpu_s"] = pos / c
        if args.profile:
            res["profile_point_t1"] = profile(CacheReader(url), picks)
            res["profile_range_path"] = profile(ref, picks)
        if args.validate:
            t0 = time.perf_counter()
            rep = validate(url)
            res["validate_ok"] = rep.ok
            res["validate_s"] = time.perf_counter() - t0
            assert rep.ok, str(rep)
        doc["layouts"][name] = res
        log(name, {k: v for k, v in res.items() if not isinstance(v, dict)})
    return doc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--root", default="/tmp/ra-bench")
    p.add_argument("--positions", type=int, default=2_000_000)
    p.add_argument("--layouts", nargs="+", default=["default", "random_access"])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--reads", type=int, default=320)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq-sequences", type=int, default=1024, help="sequences read sequentially")
    p.add_argument("--validate", action="store_true")
    p.add_argument("--profile", action="store_true", help="cProfile of sequence(i), one thread")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--min-bytes",
        type=int,
        nargs="*",
        default=[],
        help="with threads > 1: each value of pointread.PARALLEL_MIN_BYTES to measure",
    )
    p.add_argument(
        "--processes",
        type=int,
        nargs="*",
        default=[],
        help="each value of CacheReader(read_processes=n) to measure (trees that have it)",
    )
    p.add_argument(
        "--drop",
        action="store_true",
        help="drop each result right after its call (the .npy copy's too); default: keep a pass's",
    )
    p.add_argument(
        "--reuse",
        action="store_true",
        help="read the stores already under --root (and, when every one is there, the sequence "
        "lengths saved beside the .npy copy instead of generating the records again)",
    )
    p.add_argument("--label", default="", help="a name for this run (e.g. the code measured)")
    p.add_argument("--skip-range-path", action="store_true", help="no range-path figures")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    global KEEP
    KEEP = not args.drop
    doc: dict[str, Any] = {
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs",
        "command": " ".join(["python", *sys.argv]),
        "label": args.label,
        "results_kept": not args.drop,
        "load_avg_start": os.getloadavg(),
        "git": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
        ).stdout.strip(),
    }
    from logitcache.cache_format import _kernels as kernels

    doc["kernels"] = kernels.backend()
    try:
        from logitcache.cache_format import _fastdecode as fastdecode
    except ImportError:  # a tree without it (RA_OLD)
        doc["fastdecode"] = None
    else:
        t0 = time.perf_counter()
        doc["fastdecode"] = fastdecode.ready()
        doc["fastdecode_ready_s"] = time.perf_counter() - t0
    doc |= run(args)
    doc["load_avg_end"] = os.getloadavg()
    text = json.dumps(doc, indent=2)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()

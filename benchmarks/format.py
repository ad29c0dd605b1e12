"""The cache format: bytes/position, write and read rates per layout, random access per preset.

Modes (``python -m benchmarks.format <mode> --help``)::

    python -m benchmarks.format configs --positions 262144 --cores 1     # the page's main table
    python -m benchmarks.format random --positions 2000000 --layouts default random_access
    python -m benchmarks.format codecs --positions 262144
    python -m benchmarks.format index --sequences 1000 100000 1000000 --store-dir /tmp/lc-index

* ``configs``: each :data:`CONFIGS` entry (a layout preset with some fields changed) writes the
  same ``Teacher.fixed`` rows (1024-token sequences, k=100, vocab 131072; appends of 64
  sequences, fsync), reads them back with ``rows()`` (one shard per call; float32 and float16
  logprobs), ``sequence(i)`` and ``sequences`` of 32, beside uncompressed ``.npy`` files of the
  same arrays; rates per wall second and per CPU-second of the process.
* ``random``: ``Teacher.pooled`` sequences written once per layout preset; ``sequence(i)`` and
  ``sequences(32)`` per ``--threads`` (``decode_threads``) against an ``.npy`` copy read right
  before (the values read are checked against it), and the sequential reader.
* ``codecs``: bytes/position and encode/decode rate of each transform x blosc codec on raw
  chunks of 2048 rows (numcodecs, one thread; ``--blocks``: blosc block bytes).
* ``index``: what opening a cache of many 2-token sequences (k=4, vocab 1000) costs, each probe in
  a fresh process, median of ``--repeats``: ``CacheReader`` open, first ``index_of`` and
  ``sequence``; ``CacheWriter.open``, first ``contains``; ``validate`` (first and second call);
  seconds and RSS growth. The caches are built once per ``--store-dir`` (the build's rate is
  logged; ``--appends batch``: ``SequenceBatch`` appends); the probes import ``logitcache`` from
  the tree this process does (``harness with-tree`` measures another tree's code).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import (
    ROOT,
    PeakRSS,
    Recorder,
    add_csv_option,
    log,
    machine_line,
    measure,
    options,
    pin_cores,
    rss_bytes,
    scratch,
    suite_parser,
)
from benchmarks.synthetic import Data, Teacher, store_bytes, write_cache


@dataclass(frozen=True)
class Config:
    """A layout preset (``spec.LAYOUTS``) with these fields, and how it is written."""

    name: str
    id_codec: str = "blosc-zstd1-bitshuffle"
    logprob_codec: str = "blosc-zstd1-shuffle"
    logprob_dtype: str = "float16"
    row_chunk: int = 2048
    row_shard: int = 65536
    id_remap: bool = False
    append_seqs: int = 64
    blosc_blocks: str = "chunk"
    fsync: bool = True
    layout: str = "default"


LZ4 = ("blosc-lz4-bitshuffle", "blosc-lz4-shuffle")
CONFIGS = {
    c.name: c
    for c in [
        Config("default"),
        Config("id-remap", id_remap=True),
        Config("zstd5", id_codec="blosc-zstd5-bitshuffle", logprob_codec="blosc-zstd5-shuffle"),
        Config("lz4", *LZ4),
        Config("zstd3-noshuffle", id_codec="zstd3", logprob_codec="zstd3"),
        Config("chunk512", row_chunk=512),
        Config("chunk8192", row_chunk=8192),
        Config("shard16k", row_shard=16384),
        Config("uint8-lossy", logprob_dtype="uint8"),
        Config("uint16-lossy", logprob_dtype="uint16"),
        Config("float32", logprob_dtype="float32"),
        Config("appends-of-4", append_seqs=4),
        Config("appends-of-4-shard16k", append_seqs=4, row_shard=16384),
        Config("blocks-auto", blosc_blocks="auto"),
        Config("no-fsync", fsync=False),
        Config("random-access", *LZ4, row_chunk=256, layout="random_access"),
        Config("random-access-raw", "none", "none", row_chunk=256, layout="random_access_raw"),
    ]
}


# --------------------------------------------------------------------------- configs
def bench_config(
    cfg: Config, data: Data, teacher: Teacher, root: Path, picks: np.ndarray, repeats: int
) -> dict[str, float]:
    from logitcache.cache_format import CacheReader, CacheWriter, spec
    from logitcache.cache_format.stats import store_stats

    url = root / cfg.name
    manifest = teacher.manifest("format", logprob_dtype=cfg.logprob_dtype, id_remap=cfg.id_remap)
    fields = ("id_codec", "logprob_codec", "row_chunk", "row_shard", "blosc_blocks")
    layout = replace(spec.layout_named(cfg.layout), **{f: getattr(cfg, f) for f in fields})
    batches = list(data.batches(sequences=cfg.append_seqs))

    def write() -> None:
        with CacheWriter.open(url, manifest, layout=layout, fsync=cfg.fsync) as w:
            for b in batches:
                w.append(b)

    m_write = measure(write, 1)
    rows = data.positions
    reader = CacheReader(url)
    st = store_stats(reader.store, reader.manifest)

    def seq_read(dtype: str = "float32") -> None:
        for s in range(0, rows, cfg.row_shard):
            reader.rows(s, min(s + cfg.row_shard, rows), logprob_dtype=dtype)

    m_seq = measure(seq_read, repeats, warmup=1)
    m_seq16 = measure(lambda: seq_read("float16"), repeats)
    m_rand = measure(lambda: [reader.sequence(int(i)) for i in picks], repeats)
    groups = [[int(i) for i in picks[j : j + 32]] for j in range(0, len(picks), 32)]
    m_batch = measure(lambda: [reader.sequences(g) for g in groups], repeats)
    rb = reader.rows(0, min(rows, 8192))
    if not np.array_equal(rb.topk_ids, data.ids[: rb.topk_ids.shape[0]]):
        raise AssertionError(f"{cfg.name}: ids read back differ")
    lp_bytes = sum(
        st.bytes_by_array.get(a, 0) for a in ("topk_logprobs", "logprob_max", "logprob_step")
    )
    shutil.rmtree(url, ignore_errors=True)
    return {
        "bytes_per_position": st.bytes_per_position,
        "id_bytes_per_position": st.bytes_by_array["topk_ids"] / rows,
        "logprob_bytes_per_position": lp_bytes / rows,
        "write_pos_per_cpu_s": m_write.rate(rows, cpu=True, best=True),
        "write_pos_per_s": m_write.rate(rows, best=True),
        "seq_read_pos_per_cpu_s": m_seq.rate(rows, cpu=True, best=True),
        "seq_read_pos_per_s": m_seq.rate(rows, best=True),
        "seq_read_f16_pos_per_cpu_s": m_seq16.rate(rows, cpu=True, best=True),
        "random_read_seq_per_cpu_s": m_rand.rate(len(picks), cpu=True, best=True),
        "random_batch32_seq_per_cpu_s": m_batch.rate(len(picks), cpu=True, best=True),
        "max_abs_logprob_error": float(
            np.abs(rb.topk_logprobs - data.logprobs[: rb.topk_ids.shape[0]]).max()
        ),
    }


def bench_npy(data: Data, root: Path, picks: np.ndarray, repeats: int) -> dict[str, float]:
    """The baseline: uncompressed .npy files, written with fsync, read through ``mmap`` with a
    copy (so the bytes are really read)."""
    d = root / "npy"
    d.mkdir()
    rows = data.positions
    lp16 = data.logprobs.astype(np.float16)
    arrays = {"ids": data.ids, "lp": lp16, "tail": data.tail, "tokens": data.tokens}

    def write() -> None:
        for name, a in arrays.items():
            np.save(d / f"{name}.npy", a)
            with open(d / f"{name}.npy", "rb+") as f:
                os.fsync(f.fileno())

    m_write = measure(write, 1)
    mi, ml, mt = (np.load(d / f"{n}.npy", mmap_mode="r") for n in ("ids", "lp", "tail"))

    def seq_read(widen: bool = True) -> None:
        for s in range(0, rows, 65536):
            lp = np.array(ml[s : s + 65536])
            np.array(mi[s : s + 65536]), lp.astype(np.float32) if widen else lp
            np.array(mt[s : s + 65536])

    def rand_read() -> None:
        for i in picks:
            r0, _, n = data.bounds[int(i)]
            np.array(mi[r0 : r0 + n - 1]), np.array(ml[r0 : r0 + n - 1]).astype(np.float32)

    m_seq = measure(seq_read, repeats)
    m_seq16 = measure(lambda: seq_read(False), repeats)
    m_rand = measure(rand_read, repeats)
    return {
        "bytes_per_position": sum(a.nbytes for k, a in arrays.items() if k != "tokens") / rows,
        "write_pos_per_cpu_s": m_write.rate(rows, cpu=True, best=True),
        "write_pos_per_s": m_write.rate(rows, best=True),
        "seq_read_pos_per_cpu_s": m_seq.rate(rows, cpu=True, best=True),
        "seq_read_pos_per_s": m_seq.rate(rows, best=True),
        "seq_read_f16_pos_per_cpu_s": m_seq16.rate(rows, cpu=True, best=True),
        "random_read_seq_per_cpu_s": m_rand.rate(len(picks), cpu=True, best=True),
    }


UNITS = {
    "bytes_per_position": "B/pos",
    "id_bytes_per_position": "B/pos",
    "logprob_bytes_per_position": "B/pos",
    "max_abs_logprob_error": "logprob",
}


def run_configs(args: argparse.Namespace) -> None:
    teacher = Teacher(id_map=args.id_map, seed=args.seed)
    data = teacher.fixed(args.positions)
    picks = np.random.default_rng(args.seed).integers(0, data.sequences, size=args.random_reads)
    rec = Recorder("format", "configs", csv_path=args.csv)
    results: dict[str, dict[str, float]] = {}
    with scratch("lc-format-") as root:
        results["baseline (npy)"] = bench_npy(data, root, picks, args.repeats)
        for name in args.configs.split(","):
            results[name] = bench_config(CONFIGS[name], data, teacher, root, picks, args.repeats)
            log(name, {k: round(v, 1) for k, v in results[name].items()})
    for case, r in results.items():
        cfg = asdict(CONFIGS[case]) if case in CONFIGS else {"name": case}
        cfg |= {"positions": data.positions, "cores": args.cores}
        for metric, value in r.items():
            unit = UNITS.get(metric, "pos/s" if "pos" in metric else "seq/s")
            rec.add(case, metric, unit, value, config=cfg)
    rec.save()
    print(f"\n{data.positions} positions; {machine_line(rec.machine)}\n\n{rec.table()}")


# --------------------------------------------------------------------------- random
def run_random(args: argparse.Namespace) -> None:
    from logitcache.cache_format import CacheReader, spec

    teacher = Teacher(vocab=128_256, seed=args.seed)
    data = teacher.pooled(args.positions, round_f16=True)
    n_seq = data.sequences
    rng = np.random.default_rng(args.seed + 1)
    picks = rng.integers(0, n_seq, size=args.reads).tolist()
    groups = rng.integers(0, n_seq, size=(max(1, args.reads // 32), 32)).tolist()
    rec = Recorder("format", "random", csv_path=args.csv)
    with scratch("lc-format-random-") as root:
        recs = data.records()
        cols = {"ids": "topk_ids", "lp": "topk_logprobs", "tail": "tail_mass", "tok": "input_ids"}
        for name, attr in cols.items():
            a = np.concatenate([getattr(r, attr) for r in recs])
            np.save(root / f"{name}.npy", a.astype(np.float16) if name == "lp" else a)
        lengths = np.array([n for _, _, n in data.bounds])
        rs = np.concatenate([[0], np.cumsum(lengths - 1)])
        ts = np.concatenate([[0], np.cumsum(lengths)])
        mi, ml, mt, mk = (np.load(root / f"{n}.npy", mmap_mode="r") for n in cols)

        def npy_one(i: int) -> tuple[np.ndarray, ...]:
            a, b, c, d = int(rs[i]), int(rs[i + 1]), int(ts[i]), int(ts[i + 1])
            return np.array(mi[a:b]), np.array(ml[a:b]), np.array(mt[a:b]), np.array(mk[c:d])

        for name in args.layouts:
            url = root / name
            t0 = time.process_time()
            write_cache(url, data, teacher.manifest("random"), layout=spec.layout_named(name))
            write_cpu = time.process_time() - t0
            bpp = store_bytes(url) / data.positions
            ref = CacheReader(url)
            check = CacheReader(url, decode_threads=max(args.threads))
            for i in picks[:20]:  # the values read equal the uncompressed copy's
                got, (ids, lp, _, _) = check.sequence(i), npy_one(i)
                if not np.array_equal(got.topk_ids, ids) or not np.array_equal(
                    got.topk_logprobs, lp.astype(np.float32)
                ):
                    raise AssertionError(f"{name}: sequence {i} differs from the .npy copy")
            cfg = {"layout": name, "positions": data.positions, "reads": len(picks)}
            rec.add(name, "bytes_per_position", "B/pos", bpp, config=cfg)
            write = data.positions / write_cpu
            rec.add(name, "write_pos_per_cpu_s", "pos/cpu-s", write, config=cfg)
            for t in args.threads:
                r = CacheReader(url, decode_threads=t)
                for what, fn, n in (
                    ("sequence", lambda r=r: [r.sequence(i) for i in picks], len(picks)),
                    ("sequences32", lambda r=r: [r.sequences(g) for g in groups], 32 * len(groups)),
                ):
                    base = measure(lambda: [npy_one(i) for i in picks], 1, warmup=1)
                    m = measure(fn, 1, warmup=1)
                    per_cpu = m.rate(n, cpu=True)
                    x_npy = per_cpu / base.rate(len(picks), cpu=True)
                    c = cfg | {"decode_threads": t}
                    rec.add(name, f"{what}_seq_per_cpu_s", "seq/cpu-s", per_cpu, config=c)
                    rec.add(name, f"{what}_seq_per_s", "seq/s", m.rate(n), config=c)
                    rec.add(name, f"{what}_x_npy_cpu", "ratio", x_npy, config=c)

            def sequential(r: Any = ref) -> None:
                for a in range(0, min(n_seq, 1024), 64):
                    b = min(a + 64, n_seq)
                    r.rows(int(rs[a]), int(rs[b]))
                    r.tokens(int(ts[a]), int(ts[b]))

            m = measure(sequential, 1, warmup=1)
            pos = int(rs[min(n_seq, 1024)])
            per_cpu = m.rate(pos, cpu=True)
            rec.add(name, "sequential_pos_per_cpu_s", "pos/cpu-s", per_cpu, config=cfg)
            log(name, f"sequential {per_cpu:,.0f} positions/CPU-s")
    rec.save()
    print(f"\n{data.positions} positions, {n_seq} sequences (mean {lengths.mean():.0f} tokens); "
          f"{machine_line(rec.machine)}\n\n{rec.table()}")  # fmt: skip


# --------------------------------------------------------------------------- codecs
def _each(fn: Any, items: list[Any]) -> list[Any]:
    return [fn(x) for x in items]


def run_codecs(args: argparse.Namespace) -> None:
    import numcodecs.blosc
    from logitcache.cache_format._idmap import build_id_order, inverse
    from logitcache.cache_format.quant import row_delta
    from numcodecs import Blosc

    if args.rows == "random":  # a random-weights teacher's rows, as the GPU job scores them
        from benchmarks.service.replay import RandomTeacherRows

        src = RandomTeacherRows(seed=args.seed, sigma=args.sigma)
        ids64, lp64 = src.take(args.positions, 100)
        ids, lps, vocab = ids64.astype(np.int32), lp64.astype(np.float32), src.vocab
    else:
        teacher = Teacher(seed=args.seed)
        data = teacher.fixed(args.positions)
        ids, lps, vocab = data.ids, data.logprobs, teacher.vocab
    lp16 = np.maximum(np.minimum(lps, 0), -65504).astype(np.float16).view(np.uint16)
    rank = inverse(build_id_order(ids[:8192], vocab))
    inputs = {"ids": ids, "ids remapped": rank[ids], "logprobs float16": lp16}
    inputs["logprobs float16 row-delta"] = row_delta(lp16)
    numcodecs.blosc.use_threads = False
    rec = Recorder("format", "codecs", csv_path=args.csv)
    chunk = 2048
    for name, arr in inputs.items():
        chunks = [np.ascontiguousarray(arr[i : i + chunk]) for i in range(0, len(arr), chunk)]
        codecs = [("zstd", 1, 1), ("zstd", 1, 2), ("zstd", 5, 1), ("zstd", 5, 2), ("lz4", 1, 2)]
        codecs.append(("lz4", 5, 2))
        for (cname, level, shuffle), block in itertools.product(codecs, args.blocks):
            whole = chunk * arr[:1].nbytes
            codec = Blosc(cname, level, shuffle, blocksize=whole if block < 0 else block)
            enc = [codec.encode(c) for c in chunks]
            m_enc = measure(functools.partial(_each, codec.encode, chunks))
            m_dec = measure(functools.partial(_each, codec.decode, enc))
            label = f"blosc-{cname}{level}-{'byte' if shuffle == 1 else 'bit'}shuffle"
            label += "" if block < 0 else f" block {block or 'auto'}"
            bpp = sum(map(len, enc)) / len(arr)
            cfg = {"input": name, "codec": label, "chunk": chunk, "rows": args.rows}
            rec.add(f"{name} / {label}", "bytes_per_position", "B/pos", bpp, config=cfg)
            enc, dec = m_enc.rate(len(arr), cpu=True), m_dec.rate(len(arr), cpu=True)
            rec.add(f"{name} / {label}", "encode_pos_per_cpu_s", "pos/cpu-s", enc, config=cfg)
            rec.add(f"{name} / {label}", "decode_pos_per_cpu_s", "pos/cpu-s", dec, config=cfg)
    rec.save()
    print(rec.table())


# --------------------------------------------------------------------------- index
INDEX_K, INDEX_VOCAB, INDEX_BATCH = 4, 1000, 50_000


def _key(i: int) -> str:
    return f"doc-{i:010d}"


def build_index_cache(url: Path, n: int, seed: int = 0, appends: str = "records") -> None:
    """A cache of ``n`` 2-token sequences at ``url`` and its manifest as ``url.json``, appended
    as ``SequenceRecord`` lists (``appends="records"``) or ``SequenceBatch`` es (``"batch"``)."""
    from logitcache.cache_format import CacheWriter, Manifest, SequenceRecord

    m = Manifest(
        teacher_model="synthetic-index",
        tokenizer_fingerprint="synthetic-index",
        vocab_size=INDEX_VOCAB,
        k=INDEX_K,
        dataset="synthetic (benchmarks/format.py index)",
    )
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((INDEX_BATCH, INDEX_VOCAB)), axis=1)[:, :INDEX_K].astype(np.int32)
    lp = np.sort(-rng.random((INDEX_BATCH, INDEX_K)).astype(np.float32) * 5 - 0.01, axis=1)
    lp = np.ascontiguousarray(lp[:, ::-1])
    toks = rng.integers(0, INDEX_VOCAB, size=(INDEX_BATCH, 2)).astype(np.int32)
    t0, c0 = time.perf_counter(), time.process_time()
    with CacheWriter.open(url, m, fsync=False) as w:
        for a in range(0, n, INDEX_BATCH):
            part = range(a, min(n, a + INDEX_BATCH))
            if appends == "batch":
                from logitcache.cache_format import SequenceBatch

                c = len(part)
                offsets = np.arange(0, 2 * c + 1, 2)
                keys = [_key(i) for i in part]
                w.append(SequenceBatch(toks[:c].reshape(-1), offsets, ids[:c], lp[:c], keys))
                continue
            w.append(
                SequenceRecord(_key(i), toks[j], ids[j : j + 1], lp[j : j + 1])
                for j, i in enumerate(part)
            )
    Path(f"{url}.json").write_text(m.model_dump_json())
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    log(f"built {n:,} sequences ({appends}) in {wall:.1f} s, {cpu:.1f} CPU-s: {n / wall:,.0f}/s")


def index_probe(role: str, url: str, n: int, tree: str) -> None:
    """Run in a fresh process: print one JSON line of timings and RSS growths (bytes)."""
    import gc

    from benchmarks.harness import use_tree

    if tree:
        use_tree(tree)
    from logitcache.cache_format import CacheReader, CacheWriter, Manifest, validate

    manifest = Manifest.model_validate_json(Path(f"{url}.json").read_text())
    key = _key(n // 3)
    gc.collect()
    out: dict[str, float] = {}
    with PeakRSS() as peak:
        t0 = time.perf_counter()
        if role == "validate":
            validate(url)  # the first call loads (or compiles) its kernels
            t1 = time.perf_counter()
            validate(url)
            out["first_s"], out["second_s"] = t1 - t0, time.perf_counter() - t1
        elif role == "reader":
            r = CacheReader(url, decoder="numpy")  # no compiled-kernel load in the timings
            t1 = time.perf_counter()
            out["open_s"], out["rss_open"] = t1 - t0, rss_bytes() - peak.start
            assert r.index_of(key) == n // 3
            t2 = time.perf_counter()
            out["first_index_of_s"], out["rss_after_key"] = t2 - t1, rss_bytes() - peak.start
            r.sequence(n // 2)  # the first read imports and sets up the decoder: its RSS
            out["first_sequence_s"] = time.perf_counter() - t2  # is not counted
        else:
            w = CacheWriter.open(url, manifest, fsync=False)
            t1 = time.perf_counter()
            out["open_s"], out["rss_open"] = t1 - t0, rss_bytes() - peak.start
            assert w.contains(key) and not w.contains("absent")
            out["first_contains_s"] = time.perf_counter() - t1
            out["rss_after_key"] = rss_bytes() - peak.start
            w.close()
    out["rss_peak"] = peak.growth  # reader: including the first read's
    print(json.dumps(out))


def _probe_in_child(role: str, url: Path, n: int) -> dict[str, float]:
    import logitcache.cache_format as cf

    tree = str(Path(cf.__path__[0]))
    call = f"index_probe({role!r}, {str(url)!r}, {n}, {tree!r})"
    code = f"from benchmarks.format import index_probe; {call}"
    got = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False
    )
    if got.returncode:
        raise RuntimeError(f"probe {role} {url} failed:\n{got.stderr[-3000:]}")
    return dict(json.loads(got.stdout.strip().splitlines()[-1]))


def run_index(args: argparse.Namespace) -> None:
    rec = Recorder("format", "index", csv_path=args.csv)
    label = os.environ.get("BENCH_TREE") or args.label
    with scratch("lc-format-index-") as tmp:
        root = Path(args.store_dir) if args.store_dir else tmp
        root.mkdir(parents=True, exist_ok=True)
        for n in args.sequences:
            url = root / f"n{n}"
            if not Path(f"{url}.json").exists():
                build_index_cache(url, n, args.seed, args.appends)
            roles = ["reader", "writer"] + (["validate"] if n <= args.validate_max else [])
            got: dict[str, dict[str, list[float]]] = {role: {} for role in roles}
            for _ in range(args.repeats):
                for role in roles:
                    for m, v in _probe_in_child(role, url, n).items():
                        got[role].setdefault(m, []).append(v)
            med = {r: {m: statistics.median(v) for m, v in ms.items()} for r, ms in got.items()}
            log(f"{label} n={n:,}: {json.dumps(med)}")
            cfg = {"sequences": n, "k": INDEX_K, "tokens_per_sequence": 2, "tree": label}
            for role, ms in med.items():
                for m, v in ms.items():
                    unit = "s" if m.endswith("_s") else "bytes"
                    rec.add(
                        f"{label} n={n}", f"{role}_{m}", unit, v, samples=args.repeats, config=cfg
                    )
    rec.save()
    print(f"\n{args.repeats} repeats (median); {machine_line(rec.machine)}\n\n{rec.table()}")


#: mode -> (its function, its options beside ``--positions``, ``--cores``, ``--seed``, ``--csv``)
MODES: dict[str, tuple[Any, dict[str, Any]]] = {
    "configs": (
        run_configs,
        dict(configs=",".join(CONFIGS), random_reads=200, repeats=3)
        | {"id_map": ("bpe", None, {"choices": ["bpe", "random", "identity"]})},
    ),
    "random": (run_random, dict(layouts=["default", "random_access"], threads=[1, 8], reads=320)),
    "codecs": (
        run_codecs,
        {
            "rows": ("zipf", "the synthetic teacher's rows, or a random-weights teacher's (the GPU "
                     "job's)", {"choices": ["zipf", "random"]}),
            "sigma": (0.9, "--rows random: logit spread"),
            "blocks": ([-1], "blosc block bytes: -1 one block per chunk (the format's), 0 blosc's "
                       "choice"),
        },
    ),
    "index": (
        run_index,
        dict(sequences=[1000, 100_000, 1_000_000], repeats=3, label="this tree")
        | {
            "store_dir": ("", "keep (and reuse) the built caches here"),
            "validate_max": (100_000, "validate up to this"),
            "appends": ("records", None, {"choices": ["records", "batch"]}),
        },
    ),
}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p, sub = suite_parser("format", __doc__)
    for name, (_, spec) in MODES.items():
        s = options(sub.add_parser(name), **spec, seed=0)
        positions = 2e6 if name == "random" else 262144
        options(s, positions=(positions, None, {"type": float}))
        options(s, cores=(1, "pin to this many cores (0: all)"))
        add_csv_option(s)
    args = p.parse_args(argv)
    args.positions = int(args.positions)
    if args.cores:
        pin_cores(args.cores)
    MODES[args.mode][0](args)


if __name__ == "__main__":
    main()

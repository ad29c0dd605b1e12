"""Cache-format benchmark: bytes/position and write / sequential / random read throughput.

Synthetic but realistic top-k data (k=100, vocab 131072 = 128K):

- ids: each row's k ids are successive draws without replacement from a Zipf(s=1.05) law over
  the vocabulary (the first-appearance order of i.i.d. Zipf draws), so rank 0 tends to be a
  frequent token. The map frequency-rank -> token id is "bpe-like": ids sorted by
  ``log(rank) + N(0, 1.5)``, i.e. frequent tokens have small ids on average but not exactly (BPE
  vocabularies assign early merges, which are frequent, small ids). ``--id-map random`` uses a
  uniform random permutation instead (worst case for compression).
- logprobs: ``lp_j = -s log(j+1) + noise`` sorted descending, per-row sharpness
  ``s ~ LogNormal(log 1.2, 0.35)``, normalised so that the top-k mass is ``1 - tail`` with
  ``tail ~ Beta(0.6, 6)``; stored as float16 unless the config says otherwise.
- sequences of 1024 tokens (1023 rows each).

Each config writes the same data through :class:`CacheWriter` (appends of 64 sequences, fsynced
unless the config says otherwise), then reads it back sequentially (``rows()`` in blocks of one
shard, float32 logprobs and, second column, ``logprob_dtype="float16"``) and randomly
(``sequence(i)`` for random i), through the reader's direct shard path unless the config says
``direct=False`` (zarr's array API). Baseline in the same run: the same arrays written/read as
uncompressed ``.npy`` files (raw int32 ids + float16 logprobs + float32 tail). Throughputs are
also given as ratios against it.

Run (one core pinned, default configs)::

    .venv/bin/python benchmarks/format_bench.py --rows 262144 --cores 1 \
        --out benchmarks/results/format.json --md benchmarks/results/format.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

K = 100
VOCAB = 131072
SEQ_LEN = 1024
RAW_BPP = K * 6  # int32 id + float16 logprob per entry: the 600 B/position reference


# --------------------------------------------------------------------------- synthetic data
def zipf_cdf(vocab: int, s: float) -> np.ndarray:
    w = 1.0 / np.arange(1, vocab + 1, dtype=np.float64) ** s
    return np.cumsum(w) / w.sum()


def id_map(vocab: int, kind: str, rng: np.random.Generator) -> np.ndarray:
    """frequency rank -> token id."""
    if kind == "random":
        return rng.permutation(vocab).astype(np.int32)
    if kind == "identity":
        return np.arange(vocab, dtype=np.int32)
    key = np.log1p(np.arange(vocab)) + rng.normal(0, 1.5, vocab)
    order = np.argsort(key, kind="stable")  # order[i] = rank placed at id i
    out = np.empty(vocab, dtype=np.int32)
    out[order] = np.arange(vocab, dtype=np.int32)
    return out


def topk_ids(rows: int, rng: np.random.Generator, cdf: np.ndarray, rmap: np.ndarray) -> np.ndarray:
    """Distinct ids per row in first-appearance order of i.i.d. Zipf draws."""
    out = np.empty((rows, K), dtype=np.int32)
    draws = 6 * K
    for b0 in range(0, rows, 4096):
        n = min(4096, rows - b0)
        d = np.searchsorted(cdf, rng.random((n, draws))).astype(np.int64)
        d = np.minimum(d, len(cdf) - 1)
        srt = np.sort(d, axis=1)
        order = np.argsort(d, axis=1, kind="stable")
        first = np.ones_like(srt, dtype=bool)
        first[:, 1:] = srt[:, 1:] != srt[:, :-1]
        keep = np.zeros_like(first)
        np.put_along_axis(keep, order, first, axis=1)  # True at first appearance of each value
        take = keep & (np.cumsum(keep, axis=1) <= K)
        full = take.sum(axis=1) == K
        block = np.zeros((n, K), dtype=np.int64)
        block[full] = d[full][take[full]].reshape(-1, K)  # row-major: first K uniques in order
        for i in np.flatnonzero(~full):  # rare: top up with unused ranks
            u = d[i][take[i]]
            extra = np.setdiff1d(np.arange(4 * K), u)[: K - u.size]
            block[i] = np.concatenate([u, extra])
        out[b0 : b0 + n] = rmap[block]
    return out


def logprobs(rows: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    s = np.exp(rng.normal(np.log(1.2), 0.35, size=(rows, 1)))
    base = -s * np.log(np.arange(1, K + 1))[None, :] + rng.normal(0, 0.3, size=(rows, K))
    base = -np.sort(-base, axis=1)
    tail = rng.beta(0.6, 6.0, size=rows).clip(1e-6, 0.999)
    lse = np.log(np.exp(base).sum(axis=1, keepdims=True))
    lp = base - lse + np.log1p(-tail)[:, None]
    return lp.astype(np.float32), tail.astype(np.float32)


def make_data(rows_target: int, id_kind: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    n_seq = max(1, rows_target // (SEQ_LEN - 1))
    rows = n_seq * (SEQ_LEN - 1)
    cdf = zipf_cdf(VOCAB, 1.05)
    rmap = id_map(VOCAB, id_kind, rng)
    ids = topk_ids(rows, rng, cdf, rmap)
    lp, tail = logprobs(rows, rng)
    tokens = rmap[np.minimum(np.searchsorted(cdf, rng.random(n_seq * SEQ_LEN)), VOCAB - 1)]
    return n_seq, tokens.astype(np.int32), ids, lp, tail


# --------------------------------------------------------------------------- configs
@dataclass(frozen=True)
class Config:
    name: str
    id_codec: str = "blosc-zstd1-bitshuffle"
    logprob_codec: str = "blosc-zstd1-shuffle"
    logprob_dtype: str = "float16"
    row_chunk: int = 2048
    row_shard: int = 65536
    id_remap: bool = False
    append_seqs: int = 64  # sequences per CacheWriter.append call
    blosc_blocks: str = "chunk"  # Layout.blosc_blocks: one blosc block per chunk, or "auto"
    fsync: bool = True  # CacheWriter.open(fsync=...)
    direct: bool = True  # CacheReader(direct=...): direct shard reads, or zarr's array API
    direct_writes: bool = True  # writer.DIRECT_WRITES: shardwrite.py, or zarr's setitem
    layout: str = "default"  # spec.LAYOUTS preset the fields above are applied to


CONFIGS = {
    c.name: c
    for c in [
        Config("default"),
        Config("id-remap", id_remap=True),
        Config("zstd5", id_codec="blosc-zstd5-bitshuffle", logprob_codec="blosc-zstd5-shuffle"),
        Config("lz4", id_codec="blosc-lz4-bitshuffle", logprob_codec="blosc-lz4-shuffle"),
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
        Config("zarr-read-path", direct=False),
        Config("blocks-auto-zarr-read-path", blosc_blocks="auto", direct=False),
        Config("no-fsync", fsync=False),
        Config("zarr-writes", direct_writes=False),
        Config("appends-of-4-zarr-writes", append_seqs=4, direct_writes=False),
        Config(
            "random-access",  # the spec.LAYOUTS["random_access"] preset (FORMAT.md 4.7)
            id_codec="blosc-lz4-bitshuffle",
            logprob_codec="blosc-lz4-shuffle",
            row_chunk=256,
            layout="random_access",
        ),
        Config(
            "random-access-raw",  # spec.LAYOUTS["random_access_raw"]: no compressor (4.7)
            id_codec="none",
            logprob_codec="none",
            row_chunk=256,
            layout="random_access_raw",
        ),
    ]
}


# --------------------------------------------------------------------------- measurements
def timed(fn, repeats: int = 1) -> tuple[float, float]:
    """Best (wall seconds, CPU seconds of the whole process, all threads) over ``repeats`` runs."""
    best_w = best_c = float("inf")
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        best_w = min(best_w, time.perf_counter() - w0)
        best_c = min(best_c, time.process_time() - c0)
    return best_w, best_c


def records(n_seq, tokens, ids, lp, tail, lo, hi):
    from logitcache.cache_format import SequenceRecord

    out = []
    for i in range(lo, hi):
        r0, t0 = i * (SEQ_LEN - 1), i * SEQ_LEN
        out.append(
            SequenceRecord(
                f"seq{i}",
                tokens[t0 : t0 + SEQ_LEN],
                ids[r0 : r0 + SEQ_LEN - 1],
                lp[r0 : r0 + SEQ_LEN - 1],
                tail[r0 : r0 + SEQ_LEN - 1],
            )
        )
    return out


def rates(rows, random_reads, t_write, c_write, t_seq, c_seq, t_rand, c_rand) -> dict:
    """Throughputs per wall second and per CPU second (= per core fully used)."""
    return {
        "write_pos_per_s": rows / t_write,
        "write_pos_per_cpu_s": rows / c_write,
        "seq_read_pos_per_s": rows / t_seq,
        "seq_read_pos_per_cpu_s": rows / c_seq,
        "seq_read_raw_mb_per_s": rows * RAW_BPP / t_seq / 1e6,
        "random_read_seq_per_s": random_reads / t_rand,
        "random_read_seq_per_cpu_s": random_reads / c_rand,
        "random_read_pos_per_cpu_s": random_reads * (SEQ_LEN - 1) / c_rand,
    }


def write_rounds(configs: list[str], data, root: Path, rounds: int) -> dict:
    """Write-only rate of each config, ``rounds`` times, the configs alternating within each
    round (the load drifts; adjacent runs are compared): CPU seconds of the process per write
    of all rows to a fresh store, and positions per CPU-second (median and max over rounds)."""
    import statistics

    out: dict[str, dict] = {n: {"pos_per_cpu_s": [], "load_avg_1min": []} for n in configs}
    rows = data[2].shape[0]
    for r in range(rounds):
        for name in configs:
            cfg = CONFIGS[name]
            write, url = writer_for(cfg, data, root / f"{name}-{r}")
            load = os.getloadavg()[0]
            _, cpu = timed(write)
            out[name]["pos_per_cpu_s"].append(rows / cpu)
            out[name]["load_avg_1min"].append(round(load, 2))
            shutil.rmtree(url, ignore_errors=True)
            print(f"round {r} {name}: {rows / cpu:,.0f} pos/cpu-s (load {load:.1f})", flush=True)
    for row in out.values():
        row["median_pos_per_cpu_s"] = statistics.median(row["pos_per_cpu_s"])
        row["max_pos_per_cpu_s"] = max(row["pos_per_cpu_s"])
    return out


def writer_for(cfg: Config, data, url: Path):
    """``(write, url)``: a function writing every row of ``data`` to a fresh store at ``url``
    with ``cfg`` (appends of ``cfg.append_seqs`` sequences)."""
    from logitcache.cache_format import CacheWriter, Manifest, spec
    from logitcache.cache_format import writer as writer_mod

    n_seq = data[0]
    m = Manifest(
        teacher_model="synthetic",
        tokenizer_fingerprint="sha256:0",
        vocab_size=VOCAB,
        k=K,
        logprob_dtype=cfg.logprob_dtype,
        id_remap=cfg.id_remap,
    )
    layout = replace(
        spec.layout_named(cfg.layout),
        id_codec=cfg.id_codec,
        logprob_codec=cfg.logprob_codec,
        row_chunk=cfg.row_chunk,
        row_shard=cfg.row_shard,
        blosc_blocks=cfg.blosc_blocks,
    )
    step = cfg.append_seqs
    batches = [records(*data, lo, min(lo + step, n_seq)) for lo in range(0, n_seq, step)]

    def write():
        writer_mod.DIRECT_WRITES = cfg.direct_writes
        try:
            with CacheWriter.open(url, m, layout=layout, fsync=cfg.fsync) as w:
                for b in batches:
                    w.append(b)
        finally:
            writer_mod.DIRECT_WRITES = True

    return write, url


def bench_config(
    cfg: Config, data, root: Path, random_reads: int, seed: int, repeats: int = 3
) -> dict:
    from logitcache.cache_format import CacheReader
    from logitcache.cache_format.layout import read_root_attrs  # noqa: F401 - warm import
    from logitcache.cache_format.stats import store_stats

    n_seq, tokens, ids, lp, tail = data
    write, url = writer_for(cfg, data, root / cfg.name)
    t_write, c_write = timed(write)
    rows = n_seq * (SEQ_LEN - 1)

    reader = CacheReader(url, direct=cfg.direct)
    st = store_stats(reader._store, reader.manifest)
    block = cfg.row_shard

    def seq_read(logprob_dtype: str = "float32"):
        for s in range(0, rows, block):
            reader.rows(s, min(s + block, rows), logprob_dtype=logprob_dtype)

    seq_read()  # warm-up: imports, first-call set-up
    t_seq, c_seq = timed(seq_read, repeats)
    t_seq16, c_seq16 = timed(lambda: seq_read("float16"), repeats)
    picks = np.random.default_rng(seed).integers(0, n_seq, size=random_reads)

    def rand_read():
        for i in picks:
            reader.sequence(int(i))

    t_rand, c_rand = timed(rand_read, repeats)
    batches_idx = [picks[i : i + 32] for i in range(0, len(picks), 32)]

    def batch_read():
        for b in batches_idx:
            reader.sequences([int(i) for i in b])

    t_batch, c_batch = timed(batch_read, repeats)

    # exactness / error of what we read back (one block)
    rb = reader.rows(0, min(rows, 8192))
    assert np.array_equal(rb.topk_ids, ids[: rb.topk_ids.shape[0]])
    err = float(np.abs(rb.topk_logprobs - lp[: rb.topk_ids.shape[0]]).max())
    return {
        "config": asdict(cfg),
        "rows": rows,
        "bytes_per_position": st.bytes_per_position,
        "bytes_by_array": st.bytes_by_array,
        "id_bytes_per_position": st.bytes_by_array["topk_ids"] / rows,
        "logprob_bytes_per_position": (
            st.bytes_by_array["topk_logprobs"]
            + st.bytes_by_array.get("logprob_max", 0)
            + st.bytes_by_array.get("logprob_step", 0)
        )
        / rows,
        "ratio_vs_raw": RAW_BPP / st.bytes_per_position,
        **rates(rows, random_reads, t_write, c_write, t_seq, c_seq, t_rand, c_rand),
        "seq_read_f16_pos_per_s": rows / t_seq16,
        "seq_read_f16_pos_per_cpu_s": rows / c_seq16,
        "random_batch32_seq_per_cpu_s": random_reads / c_batch,
        "random_batch32_seq_per_s": random_reads / t_batch,
        "max_abs_logprob_error_vs_float32_input": err,
    }


def bench_baseline(data, root: Path, random_reads: int, seed: int) -> dict:
    """Uncompressed .npy files: write with np.save, read sequential blocks and random sequences
    from np.load(mmap_mode='r') with a copy (so the bytes are really read)."""
    n_seq, tokens, ids, lp, tail = data
    rows = ids.shape[0]
    d = root / "npy"
    d.mkdir()
    lp16 = lp.astype(np.float16)

    def write():
        for name, a in (("ids", ids), ("lp", lp16), ("tail", tail), ("tokens", tokens)):
            np.save(d / f"{name}.npy", a)
            with open(d / f"{name}.npy", "rb+") as f:
                os.fsync(f.fileno())

    t_write, c_write = timed(write)
    mi, ml, mt = (np.load(d / f"{n}.npy", mmap_mode="r") for n in ("ids", "lp", "tail"))

    def seq_read(widen: bool = True):
        for s in range(0, rows, 65536):
            lp_block = np.array(ml[s : s + 65536])
            np.array(mi[s : s + 65536]), lp_block.astype(np.float32) if widen else lp_block
            np.array(mt[s : s + 65536])

    t_seq, c_seq = timed(seq_read, 3)
    t_seq16, c_seq16 = timed(lambda: seq_read(False), 3)
    picks = np.random.default_rng(seed).integers(0, n_seq, size=random_reads)

    def rand_read():
        for i in picks:
            r0 = int(i) * (SEQ_LEN - 1)
            np.array(mi[r0 : r0 + SEQ_LEN - 1])
            np.array(ml[r0 : r0 + SEQ_LEN - 1]).astype(np.float32)

    t_rand, c_rand = timed(rand_read, 3)
    return {
        "config": {"name": "baseline-npy-uncompressed"},
        "rows": rows,
        "bytes_per_position": (ids.nbytes + lp16.nbytes + tail.nbytes) / rows,
        **rates(rows, random_reads, t_write, c_write, t_seq, c_seq, t_rand, c_rand),
        "seq_read_f16_pos_per_s": rows / t_seq16,
        "seq_read_f16_pos_per_cpu_s": rows / c_seq16,
    }


# --------------------------------------------------------------------------- studies
def codec_study(data, chunk: int = 2048) -> list[dict]:
    """Bytes/position and encode/decode CPU of each transform x codec on raw chunks (numcodecs,
    no zarr): what the format's choices (row-delta logprobs, optional id remap, shuffle mode,
    zstd level) buy. Each chunk is one blosc block, as the layouts write them
    (``blosc_blocks="chunk"``), in one thread, as the writer's I/O threads run blosc."""
    import numcodecs.blosc

    threads, numcodecs.blosc.use_threads = numcodecs.blosc.use_threads, False
    try:
        return _codec_rows(data, chunk)
    finally:
        numcodecs.blosc.use_threads = threads


def _codec_rows(data, chunk: int) -> list[dict]:
    from logitcache.cache_format.idmap import build_id_order, inverse
    from logitcache.cache_format.quant import row_delta
    from numcodecs import Blosc

    _, _, ids, lp, _ = data
    lp16 = np.minimum(lp, 0).astype(np.float16).view(np.uint16)
    rank = inverse(build_id_order(ids[:8192], VOCAB))
    inputs = {
        "ids": ids,
        "ids remapped": rank[ids],
        "logprobs float16": lp16,
        "logprobs float16 row-delta": row_delta(lp16),
    }
    out = []
    for name, arr in inputs.items():
        for cname, level, shuffle in (
            ("zstd", 1, 1),
            ("zstd", 1, 2),
            ("zstd", 5, 1),
            ("zstd", 5, 2),
            ("lz4", 1, 2),
            ("lz4", 5, 1),
            ("lz4", 5, 2),
        ):
            codec = Blosc(cname, level, shuffle, blocksize=chunk * arr[:1].nbytes)
            chunks = [np.ascontiguousarray(arr[i : i + chunk]) for i in range(0, len(arr), chunk)]
            enc = [codec.encode(c) for c in chunks]
            _, c_enc = timed(lambda chunks=chunks, codec=codec: [codec.encode(c) for c in chunks])
            _, c_dec = timed(lambda enc=enc, codec=codec: [codec.decode(e) for e in enc])
            out.append(
                {
                    "input": name,
                    "codec": f"blosc-{cname}{level}-{'byte' if shuffle == 1 else 'bit'}shuffle",
                    "bytes_per_position": sum(map(len, enc)) / len(arr),
                    "encode_pos_per_cpu_s": len(arr) / c_enc,
                    "decode_pos_per_cpu_s": len(arr) / c_dec,
                }
            )
    return out


def read_profile(data, root: Path) -> dict:
    """CPU seconds per step of one ``rows()`` block read with the default layout: zarr's array
    API (``direct=False``) and the direct shard path, each step timed alone."""
    from logitcache.cache_format import CacheReader, CacheWriter, Manifest, kernels, shardread
    from logitcache.cache_format.quant import row_undelta
    from zarr.core.sync import sync

    n_seq = data[0]
    url = root / "profile"
    m = Manifest(teacher_model="s", tokenizer_fingerprint="x", vocab_size=VOCAB, k=K)
    with CacheWriter.open(url, m) as w:
        for lo in range(0, n_seq, 64):
            w.append(records(*data, lo, min(lo + 64, n_seq)))
    r = CacheReader(url)
    n = min(65536, r.num_rows)
    a, lays = r._arrays, r._direct
    stored = a["topk_logprobs"][0:n]
    summed = row_undelta(stored)
    row_arrays = ("topk_ids", "topk_logprobs", "tail_mass")  # (the per-sequence arrays are short)
    fetched = {name: sync(shardread.fetch(lays[name], 0, n)) for name in row_arrays}

    def direct_decode(name):
        shardread.decode(lays[name], fetched[name], 0, n, lays[name].empty(n))

    r.rows(0, n)  # warm-up (imports the kernels' backend)
    steps = {
        "zarr API: topk_ids read+decode": lambda: a["topk_ids"][0:n],
        "zarr API: topk_logprobs read+decode": lambda: a["topk_logprobs"][0:n],
        "zarr API: tail_mass read+decode": lambda: a["tail_mass"][0:n],
        "direct: topk_ids store get": lambda: sync(shardread.fetch(lays["topk_ids"], 0, n)),
        "direct: topk_ids CRC32C+decode": lambda: direct_decode("topk_ids"),
        "direct: topk_logprobs store get": lambda: sync(
            shardread.fetch(lays["topk_logprobs"], 0, n)
        ),
        "direct: topk_logprobs CRC32C+decode": lambda: direct_decode("topk_logprobs"),
        "direct: tail_mass get+decode": lambda: (
            sync(shardread.fetch(lays["tail_mass"], 0, n)),
            direct_decode("tail_mass"),
        ),
        f"row-delta cumsum ({kernels.backend()})": lambda: row_undelta(stored),
        f"float16 -> float32 ({kernels.backend()})": lambda: kernels.half_to_float(
            summed.view(np.float16)
        ),
        "rows() total, zarr API": lambda: CacheReader(url, direct=False).rows(0, n),
        "rows() total, direct": lambda: r.rows(0, n),
        "rows() total, direct, float16 out": lambda: r.rows(0, n, logprob_dtype="float16"),
    }
    return {name: timed(fn, 3)[1] for name, fn in steps.items()} | {"rows": n}


# --------------------------------------------------------------------------- report
def to_markdown(doc: dict) -> str:
    base = doc["baseline"]
    lines = [
        "# Cache format benchmark",
        "",
        f"Machine: {doc['machine']}. Cores used: {doc['cores']} (pinned with sched_setaffinity). "
        f"Load average at start: {doc['loadavg']}, at end: {doc.get('loadavg_end', '?')} "
        "(machine shared with other jobs: timings are noisy; ratios are against the baseline "
        "measured in the same run).",
        f"Command: `{doc['command']}`",
        f"Data: {doc['rows']} positions ({doc['rows'] // (SEQ_LEN - 1)} sequences x {SEQ_LEN} "
        f"tokens), k={K}, vocab={VOCAB}, id map `{doc['id_map']}`, Zipf s=1.05. Raw reference "
        f"{RAW_BPP} B/position (int32 ids + float16 logprobs).",
        "Baseline: uncompressed .npy files (np.save + fsync; reads from np.load(mmap) with copy).",
        f"Reader: direct shard path unless the config says zarr; logprob kernels: "
        f"{doc.get('kernels', '?')}.",
        "",
        "Throughputs: best of 3 runs; `/cpu-s` = per CPU-second of the process (all threads), "
        "i.e. per core fully used; wall figures suffer from the shared machine. Sequential reads: "
        "`rows()` in blocks of one shard with float32 logprobs (default), and with "
        "`logprob_dtype='float16'` (`f16`; baseline: no widening).",
        "",
        "Random reads: `sequence(i)` one at a time, and `sequences(32 indices)` batched; "
        "1 sequence = 1023 positions.",
        "",
        "| config | B/pos | ids | lp | vs raw 600 | write pos/cpu-s | write pos/s wall "
        "| seq read pos/cpu-s (x base) | seq read pos/s wall | f16 seq read pos/cpu-s (x base) "
        "| f16 seq read pos/s wall | random seq/cpu-s (x base) | batched random seq/cpu-s "
        "| max lp err |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["results"]:
        c = r["config"]
        lines.append(
            f"| {c['name']} | {r['bytes_per_position']:.1f} | {r['id_bytes_per_position']:.1f} | "
            f"{r['logprob_bytes_per_position']:.1f} | {r['ratio_vs_raw']:.2f}x | "
            f"{r['write_pos_per_cpu_s']:,.0f} | {r['write_pos_per_s']:,.0f} | "
            f"{r['seq_read_pos_per_cpu_s']:,.0f} "
            f"({r['seq_read_pos_per_cpu_s'] / base['seq_read_pos_per_cpu_s']:.2f}) | "
            f"{r['seq_read_pos_per_s']:,.0f} | {r['seq_read_f16_pos_per_cpu_s']:,.0f} "
            f"({r['seq_read_f16_pos_per_cpu_s'] / base['seq_read_f16_pos_per_cpu_s']:.2f}) | "
            f"{r['seq_read_f16_pos_per_s']:,.0f} | {r['random_read_seq_per_cpu_s']:,.1f} "
            f"({r['random_read_seq_per_cpu_s'] / base['random_read_seq_per_cpu_s']:.2f}) | "
            f"{r['random_batch32_seq_per_cpu_s']:,.1f} | "
            f"{r['max_abs_logprob_error_vs_float32_input']:.2e} |"
        )
    lines.append(
        f"| baseline (npy) | {base['bytes_per_position']:.1f} | 400.0 | 200.0 | - | "
        f"{base['write_pos_per_cpu_s']:,.0f} | {base['write_pos_per_s']:,.0f} | "
        f"{base['seq_read_pos_per_cpu_s']:,.0f} (1.00) | {base['seq_read_pos_per_s']:,.0f} | "
        f"{base['seq_read_f16_pos_per_cpu_s']:,.0f} (1.00) | {base['seq_read_f16_pos_per_s']:,.0f} "
        f"| {base['random_read_seq_per_cpu_s']:,.1f} (1.00) | - | - |"
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=262144)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--id-map", default="bpe", choices=["bpe", "random", "identity"])
    p.add_argument("--cores", type=int, default=1)
    p.add_argument("--random-reads", type=int, default=200)
    p.add_argument("--out", type=Path)
    p.add_argument("--md", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--study",
        action="store_true",
        help="codec/transform size study and a read-path CPU profile instead",
    )
    p.add_argument("--profile", action="store_true", help="only the read-path CPU profile")
    p.add_argument(
        "--write-rounds",
        type=int,
        default=0,
        help="only the write rate of --configs, this many alternating rounds (median, max)",
    )
    args = p.parse_args()
    if args.cores:
        os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[: args.cores]))
        import numcodecs.blosc
        import zarr

        numcodecs.blosc.set_nthreads(args.cores)
        zarr.config.set({"threading.max_workers": args.cores})
    loadavg = open("/proc/loadavg").read().split()[:3]
    t0 = time.perf_counter()
    data = make_data(args.rows, args.id_map, args.seed)
    print(f"data: {data[2].shape[0]} rows in {time.perf_counter() - t0:.1f} s", flush=True)
    root = Path(tempfile.mkdtemp(prefix="lc-format-bench-"))
    if args.write_rounds:
        try:
            doc = {
                "command": "python benchmarks/format_bench.py " + " ".join(sys.argv[1:]),
                "cores": args.cores,
                "loadavg_start": " ".join(loadavg),
                "rows": int(data[2].shape[0]),
                "write": write_rounds(args.configs.split(","), data, root, args.write_rounds),
            }
        finally:
            shutil.rmtree(root, ignore_errors=True)
        for name, row in doc["write"].items():
            print(
                f"{name}: write {row['median_pos_per_cpu_s']:,.0f} pos/cpu-s median "
                f"(best {row['max_pos_per_cpu_s']:,.0f}) over {args.write_rounds} rounds, "
                f"load {min(row['load_avg_1min'])}-{max(row['load_avg_1min'])}"
            )
        if args.out:
            args.out.write_text(json.dumps(doc, indent=2))
        return
    if args.study or args.profile:
        try:
            doc = {"codec_study": codec_study(data)} if args.study else {"codec_study": []}
            doc["read_profile_cpu_s"] = read_profile(data, root)
            doc["loadavg"] = [" ".join(loadavg), open("/proc/loadavg").read().split()[:3]]
        finally:
            shutil.rmtree(root, ignore_errors=True)
        for row in doc["codec_study"]:
            print(
                f"{row['input']:28s} {row['codec']:26s} {row['bytes_per_position']:7.1f} B/pos "
                f"encode {row['encode_pos_per_cpu_s']:,.0f} "
                f"decode {row['decode_pos_per_cpu_s']:,.0f} pos/cpu-s"
            )
        prof = doc["read_profile_cpu_s"]
        for name, sec in prof.items():
            if name != "rows":
                print(f"{name:34s} {sec * 1e3:8.1f} ms CPU for {prof['rows']} rows")
        if args.out:
            args.out.write_text(json.dumps(doc, indent=2))
        return
    try:
        baseline = bench_baseline(data, root, args.random_reads, args.seed)
        print(json.dumps(baseline), flush=True)
        results = []
        for name in args.configs.split(","):
            r = bench_config(CONFIGS[name], data, root, args.random_reads, args.seed)
            print(json.dumps({k: v for k, v in r.items() if k != "bytes_by_array"}), flush=True)
            results.append(r)
            shutil.rmtree(root / name)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    from logitcache.cache_format import kernels

    flags = [
        f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}")
        for k, v in vars(args).items()
        if v is not None and v is not False
    ]
    doc = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}",
        "cores": args.cores,
        "loadavg": " ".join(loadavg),
        "loadavg_end": " ".join(open("/proc/loadavg").read().split()[:3]),
        "kernels": kernels.backend(),
        "command": "python benchmarks/format_bench.py " + " ".join(flags),
        "rows": data[2].shape[0],
        "id_map": args.id_map,
        "baseline": baseline,
        "results": results,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=2))
    if args.md:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text(to_markdown(doc))
    print(to_markdown(doc))


if __name__ == "__main__":
    main()

"""Where the CPU of one ``sequence(i)`` goes, stage by stage, and the codec's floor (issue #14).

Usage (after ``random_access_bench.py`` built its stores under ROOT)::

    python benchmarks/random_access_stages.py --root ROOT [--layouts default random_access]
        [--reads 200] [--reps 7] [--json OUT.json]

For the same random sequences of each layout store, every stage is run on its own over all of
them and timed with ``time.thread_time`` (CPU of this thread: robust on a loaded box), best of
``--reps`` passes, in microseconds per sequence:

- ``sequence_total``: ``CacheReader.sequence(i)`` (the reader's path as configured: compiled
  decode where :mod:`.fastdecode` is on, else the per-chunk Python path); ``sequence_python``:
  the same with the compiled decode off (``LOGITCACHE_FASTDECODE=0``'s path).
- ``frames``: :func:`shardread.chunk_frames` of the sequence's chunks (shard index lookup from
  the cache + ``os.pread`` + Python); ``pread``: the same byte ranges read by bare ``os.pread``.
- ``crc_wrapper`` / ``crc_c``: CRC32C of every frame through ``google_crc32c.value`` / the C
  function through ctypes.
- ``blosc_wrapper`` / ``blosc_c``: decompression of every frame through
  ``numcodecs.blosc.decompress`` / ``blosc_decompress_ctx`` through ctypes (one internal
  thread): ``blosc_c`` is **the codec's floor** (plus ~0.3 us of ctypes per chunk), reported per
  array too.
- ``bitshuffle_share``: for the ``topk_ids`` frames (bitshuffle), the decompression of the same
  bytes stored without the shuffle (the bit-transposed bytes, lz4/zstd as stored, noshuffle):
  the difference to ``blosc_c`` of those frames is the bit-unshuffle.
- ``copy_c`` (layouts without a compressor, ``random_access_raw``, in place of the ``blosc``
  stages and ``--codecs``): ``memmove`` of every chunk's bytes into a chunk buffer.
- ``undelta``, ``widen``: :func:`pointread.undelta_block` / ``widen_block`` over the sequence's
  logprob rows in the reader's row blocks; ``record``: building the ``SequenceRecord``.
- ``npy``: the ``.npy`` copy of the same sequences (the benchmark's baseline), so every stage
  can be read as a share of the 0.3x budget (``budget_us = npy_us / 0.3``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np


def best_us(fn: Any, n: int, reps: int) -> float:
    fn()  # warm
    out = []
    for _ in range(reps):
        c = time.thread_time()
        fn()
        out.append((time.thread_time() - c) / n * 1e6)
    return round(min(out), 2)


def bitshuffle(raw: np.ndarray, typesize: int) -> np.ndarray:
    """blosc's bit transpose of one block (``raw`` uint8, a multiple of 8 elements)."""
    n = raw.size // typesize
    bits = np.unpackbits(raw.reshape(n, typesize), axis=1, bitorder="little")  # [n, 8*ts]
    return np.packbits(bits.T.reshape(8 * typesize, n), axis=1, bitorder="little").reshape(-1)


CANDIDATES = {
    "topk_ids": [
        "blosc-lz4-bitshuffle",
        "blosc-lz4-shuffle",
        "blosc-lz4-noshuffle",
        "blosc-lz4hc5-bitshuffle",
        "blosc-lz4hc5-shuffle",
        "blosc-blosclz5-shuffle",
        "blosc-zstd1-bitshuffle",
        "blosc-zstd1-shuffle",
    ],
    "topk_logprobs": [
        "blosc-lz4-shuffle",
        "blosc-lz4-noshuffle",
        "blosc-lz4hc5-shuffle",
        "blosc-blosclz5-shuffle",
        "blosc-zstd1-shuffle",
    ],
    "tail_mass": ["blosc-zstd5-shuffle", "blosc-lz4-shuffle", "blosc-lz4hc5-shuffle"],
    "input_ids": [
        "blosc-lz4-bitshuffle",
        "blosc-zstd1-bitshuffle",
        "blosc-zstd5-shuffle",
        "blosc-lz4-shuffle",
        "blosc-lz4hc5-shuffle",
    ],
}
"""Codecs re-measured per array by ``--codecs`` (names as in ``cache_format/codecs.py``)."""


def codec_study(own, names, lays, dests, n, mean_rows, args, dec) -> dict[str, Any]:
    """For each array and candidate codec: the sampled sequences' chunks re-encoded with it
    (one blosc block per chunk, as the presets write), their decompression through
    ``blosc_decompress_ctx`` (us per sequence, best of ``--reps``) and stored bytes per
    position (frame + CRC32C, per row of the sampled chunks; tokens per token)."""
    import re

    import numcodecs.blosc

    out: dict[str, Any] = {}
    shuffles = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}
    for j, a in enumerate(names):
        lay = lays[a]
        raws = []
        for per in own:
            for f in per[j]:
                raw = np.empty(dests[a].nbytes, np.uint8)
                numcodecs.blosc.decompress(f[:-4], raw)
                raws.append(raw)
        rows = len(raws) * lay.chunk_rows
        blosc = lay.metadata.codecs[0].codecs[1]  # the store's own codec for this array
        res: dict[str, Any] = {
            "stored": f"blosc-{blosc.cname.value}{blosc.clevel}-{blosc.shuffle.value}"
        }
        for name in CANDIDATES[a]:
            m = re.match(r"^blosc-(zstd|lz4hc|lz4|blosclz)(\d?)-(\w+)$", name)
            assert m is not None
            cname, level, shuf = m.group(1), int(m.group(2) or 5), shuffles[m.group(3)]
            frames = [
                np.frombuffer(
                    numcodecs.blosc.compress(
                        r.view(lay.dtype), cname.encode(), level, shuf, r.size
                    ),
                    np.uint8,
                ).copy()
                for r in raws
            ]
            tgt = dests[a]
            t_us = best_us(
                lambda frames=frames, tgt=tgt: [
                    dec(f.ctypes.data, tgt.ctypes.data, tgt.nbytes, 1) for f in frames
                ],
                n,
                args.reps,
            )
            res[name] = {
                "decode_us_per_seq": t_us,
                "bytes_per_row": round(sum(f.size + 4 for f in frames) / rows, 2),
            }
        out[a] = res
        print(a, json.dumps(res))
    return out


def measure(name, root, npy, args, crc, dec, fd_mod) -> dict[str, Any]:
    """The stages of ``sequence(i)`` on one layout store (see the module docstring)."""
    import google_crc32c
    import numcodecs.blosc
    from logitcache.cache_format import CacheReader, spec
    from logitcache.cache_format import _pointread as pointread
    from logitcache.cache_format import _shardread as shardread
    from logitcache.cache_format.records import SequenceRecord

    r = CacheReader(root / name)
    rng = np.random.default_rng(args.seed)
    picks = rng.integers(0, r.num_sequences, args.reads).tolist()
    n = len(picks)
    spans = [r._span(i) for i in picks]
    rs, ts = r.row_starts, r._tok_start
    names = [spec.TOPK_IDS, spec.TOPK_LOGPROBS, spec.TAIL_MASS, spec.INPUT_IDS]
    lays = {a: r._direct[a] for a in names}
    wanted = []  # per sequence: [(layout, chunks)] per array
    for rows, toks in spans:
        w = []
        for a in names:
            sel = toks if a == spec.INPUT_IDS else rows
            cr = lays[a].chunk_rows
            w.append((lays[a], list(range(sel.start // cr, (sel.stop - 1) // cr + 1))))
        wanted.append(w)
    frames = [shardread.chunk_frames(w) for w in wanted]
    own = [[[f.copy() for f in fr] for fr in per] for per in frames]  # type: ignore[union-attr]
    dests = {a: lays[a].empty(lays[a].chunk_rows) for a in names}
    res: dict[str, Any] = {"mean_rows": float(np.mean([s[0].stop - s[0].start for s in spans]))}
    res["chunks_per_seq"] = {
        a: float(np.mean([len(w[j][1]) for w in wanted])) for j, a in enumerate(names)
    }
    res["frame_bytes_per_seq"] = {
        a: float(np.mean([sum(f.size for f in per[j]) for per in own])) for j, a in enumerate(names)
    }

    def npy_pass() -> None:
        for i in picks:
            a, b = int(rs[i]), int(rs[i] + r._lengths[i] - 1)
            np.array(npy["ids"][a:b]), np.array(npy["lp"][a:b]), np.array(npy["tail"][a:b])
            np.array(npy["tok"][int(ts[i]) : int(ts[i] + r._lengths[i])])

    t: dict[str, float] = {}
    t["npy"] = best_us(npy_pass, n, args.reps)
    t["sequence_total"] = best_us(lambda r=r: [r.sequence(i) and None for i in picks], n, args.reps)
    saved = fd_mod.AVAILABLE
    fd_mod.AVAILABLE = False
    try:
        t["sequence_python"] = best_us(
            lambda r=r: [r.sequence(i) and None for i in picks], n, args.reps
        )
    finally:
        fd_mod.AVAILABLE = saved
    t["frames"] = best_us(lambda: [shardread.chunk_frames(w) for w in wanted], n, args.reps)
    ranges = []  # the byte ranges the reads above issue (one per run of chunks)
    for per in frames:
        for fr in per:
            ranges.append(sum(f.size for f in fr))  # type: ignore[union-attr]
    shard0 = next(p for p in (root / name / spec.TOPK_IDS / "c").rglob("*") if p.is_file())
    fdesc = os.open(shard0, os.O_RDONLY)
    t["pread"] = best_us(lambda: [os.pread(fdesc, b, 0) for b in ranges], n, args.reps)
    os.close(fdesc)
    flat = [(j, f) for per in own for j, fr in enumerate(per) for f in fr]
    t["crc_wrapper"] = best_us(lambda: [google_crc32c.value(f[:-4]) for _, f in flat], n, 5)
    ptrs = [(j, f.ctypes.data, f.size) for j, f in flat]
    t["crc_c"] = best_us(lambda: [crc(p, s - 4) for _, p, s in ptrs], n, args.reps)
    dptr = {j: (dests[a].ctypes.data, dests[a].nbytes) for j, a in enumerate(names)}
    raw = any(getattr(lay, "raw", False) for lay in lays.values())  # random_access_raw
    if raw:  # no compressor: the compiled path copies each checked chunk (memcpy)
        t["copy_c"] = best_us(
            lambda: [ctypes.memmove(dptr[j][0], p, s - 4) for j, p, s in ptrs], n, args.reps
        )
    else:
        t["blosc_wrapper"] = best_us(
            lambda: [numcodecs.blosc.decompress(f[:-4], dests[names[j]]) for j, f in flat],
            n,
            args.reps,
        )
        t["blosc_c"] = best_us(
            lambda: [dec(p, dptr[j][0], dptr[j][1], 1) for j, p, _ in ptrs], n, args.reps
        )
        for j, a in enumerate(names):
            mine = [(p, s) for jj, p, s in ptrs if jj == j]
            t[f"blosc_c_{a}"] = best_us(
                lambda mine=mine, j=j: [dec(p, dptr[j][0], dptr[j][1], 1) for p, _ in mine],
                n,
                args.reps,
            )
        # bit-unshuffle share of topk_ids: the same bit-transposed bytes, same compressor, noshuffle
        lay = lays[spec.TOPK_IDS]
        comp = lay.metadata.codecs[0].codecs[1]
        plain = []
        for _j, f in flat:
            if _j != 0:
                continue
            chunk = np.empty(dests[spec.TOPK_IDS].nbytes, np.uint8)
            numcodecs.blosc.decompress(f[:-4], chunk)
            tb = bitshuffle(chunk, 4)
            frame = numcodecs.blosc.compress(
                tb, comp.cname.value.encode(), comp.clevel, numcodecs.blosc.NOSHUFFLE, chunk.size
            )
            plain.append(np.frombuffer(frame, np.uint8).copy())
        tgt = dptr[0]
        t["ids_noshuffle_c"] = best_us(
            lambda: [dec(f.ctypes.data, tgt[0], tgt[1], 1) for f in plain], n, args.reps
        )
        res["ids_noshuffle_bytes_per_seq"] = sum(f.size for f in plain) / n
    # logprob kernels over each sequence's rows, in the reader's blocks
    lps = [np.ascontiguousarray(npy["lp"][s[0]]).view(np.uint16) for s in spans]
    work = [x.copy() for x in lps]
    outs = [np.empty(x.shape, np.float32) for x in lps]

    def undelta() -> None:
        for d in work:
            for a, b in pointread.row_blocks(d.shape[0], d.shape[1]):
                pointread.undelta_block(d[a:b])

    def widen() -> None:
        for d, o in zip(work, outs, strict=True):
            for a, b in pointread.row_blocks(d.shape[0], d.shape[1]):
                pointread.widen_block(d[a:b].view(np.float16), o[a:b])

    t["undelta"] = best_us(undelta, n, args.reps)
    t["widen"] = best_us(widen, n, args.reps)
    if fd_mod.AVAILABLE:
        t["fast_undelta_widen"] = best_us(
            lambda: [fd_mod.undelta_widen(d, o) for d, o in zip(work, outs, strict=True)],
            n,
            args.reps,
        )
    recs = [r.sequence(i) for i in picks[:50]]

    def record() -> None:
        for x in recs:
            SequenceRecord(x.key, x.input_ids, x.topk_ids, x.topk_logprobs, x.tail_mass)

    t["record"] = best_us(record, len(recs), args.reps)
    t["budget_us"] = round(t["npy"] / 0.3, 1)
    res["us_per_seq"] = t
    if args.codecs and not raw:
        res["codecs"] = codec_study(own, names, lays, dests, n, res["mean_rows"], args, dec)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--root", required=True)
    p.add_argument("--layouts", nargs="+", default=["default", "random_access"])
    p.add_argument("--reads", type=int, default=200)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", type=Path)
    p.add_argument(
        "--codecs", action="store_true", help="re-measure each array's chunks in other codecs"
    )
    args = p.parse_args()
    import numcodecs.blosc
    from google_crc32c import _crc32c

    try:
        from logitcache.cache_format import _fastdecode as fd_mod
    except ImportError:  # a tree without it

        class fd_mod:  # type: ignore[no-redef]
            AVAILABLE = False

    numcodecs.blosc.set_nthreads(1)
    crc = ctypes.CDLL(_crc32c.__file__).crc32c_value
    crc.restype, crc.argtypes = ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_size_t]
    dec = ctypes.CDLL(numcodecs.blosc.__file__).blosc_decompress_ctx
    dec.restype = ctypes.c_int
    dec.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    root = Path(args.root)
    doc: dict[str, Any] = {
        "machine": f"{platform.node()} {os.cpu_count()} CPUs",
        "load_start": os.getloadavg(),
        "fastdecode": fd_mod.AVAILABLE,
        "layouts": {},
    }
    npy = {
        n: np.load(root / "npy" / f"{n}.npy", mmap_mode="r") for n in ("ids", "lp", "tail", "tok")
    }
    for name in args.layouts:
        res = measure(name, root, npy, args, crc, dec, fd_mod)
        doc["layouts"][name] = res
        print(name, json.dumps(res))
    doc["load_end"] = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()

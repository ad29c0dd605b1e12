"""The data path at trainer scale: loader scaling, shuffle cost, HTTP, random access, data wait.

Usage (from the repository root; every figure of benchmarks/results/client.md comes from it)::

    python benchmarks/client_scaling.py --root /tmp/lc-bench --positions 20000000 \\
        --workers 1 2 4 8 12 --gpu --json OUT/client_scaling.json --plot OUT/client_scaling.png

One run, one cache, every figure side by side:

1. **build**: a cache of ``--positions`` supervised positions, k=100, vocab 128,256, float16
   logprobs (the format's defaults). Lengths are log-normal (median 490 tokens, clipped to
   [16, 8192]). Rows are contiguous slices, at random offsets, of a pool of realistic rows made
   by ``format_bench.py``'s generators (Zipf ids in a BPE-like id order, sorted logprobs with a
   tail), so each chunk compresses like the format bench's data (bytes/position is reported).
2. **reader**: ``CacheReader.rows`` + ``tokens`` in storage order, 64-sequence ranges, one
   process: the format library's sequential rate.
3. **shuffle** (one process, ``num_workers=0``): ``CacheDataset`` sequential (``shuffle=False``)
   vs the full shuffle users are told to copy (``SHUFFLE``: blocks of 64 sequences, windows of 4
   blocks, 24 lanes) and the same with one lane, each with the default ``read_threads`` and with
   ``read_threads=1``, over ``--shuffle-seconds`` after ``--shuffle-warm`` batches. Ratio =
   shuffled / sequential positions/s (and / the reader's rate of step 2).
4. **scaling**: ``CacheDataLoader(num_workers=w, pin_memory=True)`` with the same shuffle, for each
   ``w`` of ``--workers``: positions/s *delivered to the main process* (pinned batches).
5. **http**: a server process (uvicorn, the real ``/v1/caches/{name}/store`` route) serving the
   same store root on loopback, and ``HttpSource`` in the client: one client process
   (``num_workers=0``) with each ``--http-threads`` read threads, and ``--http-workers``
   workers. Server CPU seconds per position come from the server process's ``/proc`` counters.
6. **random**: ``CacheReader.sequence(i)`` for random ``i`` and ``sequences(idx)`` in batches of 32
   (also with ``decode_threads=8``) vs an uncompressed ``.npy`` copy of the same sequences (int32
   ids, float16 logprobs, float32 tail, int32 tokens; ``np.load(mmap_mode="r")`` slices copied
   out), same indices. **chunk_options**: the same stored values recompressed at smaller inner
   chunks: bytes/position and decode time per random sequence (:func:`chunk_options`).
7. **datawait** (``--gpu``): the ``client_trainstep.py`` "small" student shape (d=768, 12 layers;
   vocab 128,256 here, so more parameters than the 134M of vocab 32,000) trained by
   ``topk_distill_loss`` on batches from ``CacheDataLoader`` (``LOADER`` settings, 8 workers,
   pinned, ``non_blocking`` copies; ``--ddp``: inside ``DistributedDataParallel`` in a one-process
   NCCL group), from the local store and from the HTTP source: fraction of the step time spent
   in ``next()`` over ``--fed-steps`` steps after the workers' prefilled queues are drained; first
   the same step on one batch kept on the GPU (no loader) gives the pure step time.

Loader rates are steady-state: positions with ``loss_mask`` over ``--seconds`` of wall time after
the first ``2 * max(1, w)`` batches (start-up is reported apart). ``serve`` runs the server part.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

K = 100
VOCAB = 128_256
CACHE = "bench"
#: The full shuffle users are told to copy (order.py states its randomness).
SHUFFLE = {"shuffle_block_size": 64, "shuffle_window": 4, "lanes": 24}  # = dataset.TRAINER_SHUFFLE
#: Item/batch shape of the trainer (client_trainstep.py: 8 x 2,048 packed positions).
LOADER = {"tokens_per_item": 2048, "mode": "pack", "batch_size": 8}
#: Batches not timed at the start of a loader measurement (``--warm``; at least 2 per worker).
WARM_UNITS = 0


def log(*a: Any) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


# --------------------------------------------------------------------------- 1. build
def build(url: str, positions: int, seed: int = 0, pool_rows: int = 65536) -> dict[str, Any]:
    """Write the benchmark cache (see the module docstring); return counts and timings."""
    import format_bench as fb
    import numcodecs.blosc
    import zarr
    from logitcache.cache_format import CacheWriter, Manifest, SequenceRecord

    zarr.config.set({"threading.max_workers": os.cpu_count()})
    numcodecs.blosc.set_nthreads(1)
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    fb.VOCAB, fb.K = VOCAB, K
    cdf = fb.zipf_cdf(VOCAB, 1.05)
    rmap = fb.id_map(VOCAB, "bpe", rng)
    ids = fb.topk_ids(pool_rows, rng, cdf, rmap)
    lp, tail = fb.logprobs(pool_rows, rng)
    tok_pool = rmap[np.minimum(np.searchsorted(cdf, rng.random(pool_rows)), VOCAB - 1)]
    t_pool = time.perf_counter() - t0
    manifest = Manifest(
        teacher_model="client-scaling-synthetic",
        tokenizer_fingerprint="client-scaling",
        vocab_size=VOCAB,
        k=K,
        dataset="synthetic (benchmarks/client_scaling.py)",
    )
    rows = n = 0
    t1 = time.perf_counter()
    with CacheWriter.open(url, manifest, fsync=False) as writer:
        batch, batch_rows = [], 0
        while rows < positions:
            length = int(np.clip(rng.lognormal(np.log(490), 0.9), 16, 8192))
            length = min(length, pool_rows)
            o = int(rng.integers(0, pool_rows - length + 1))
            t = int(rng.integers(0, pool_rows - length + 1))
            batch.append(
                SequenceRecord(
                    f"s{n}",
                    tok_pool[t : t + length],
                    ids[o : o + length - 1],
                    lp[o : o + length - 1],
                    tail[o : o + length - 1],
                )
            )
            rows += length - 1
            batch_rows += length - 1
            n += 1
            if batch_rows >= 1_000_000:
                writer.append(batch)
                batch, batch_rows = [], 0
        if batch:
            writer.append(batch)
    t_write = time.perf_counter() - t1
    nbytes = sum(p.stat().st_size for p in Path(url).rglob("*") if p.is_file())
    return {
        "sequences": n,
        "positions": rows,
        "pool_s": t_pool,
        "write_s": t_write,
        "write_pos_per_s": rows / t_write,
        "store_bytes": nbytes,
        "bytes_per_position": nbytes / rows,
    }


# --------------------------------------------------------------------------- 2. reader
def reader_rate(url: str, seconds: float) -> dict[str, Any]:
    """Sequential ``rows`` + ``tokens`` over 64-sequence ranges for ``seconds``."""
    from logitcache.cache_format import CacheReader

    r = CacheReader(url)
    rs = np.append(r.row_starts, r.num_rows)
    r.rows(0, int(rs[min(64, r.num_sequences)]))  # warm: first-call set-up not timed
    pos, t0, c0 = 0, time.perf_counter(), time.process_time()
    for a in range(0, r.num_sequences, 64):
        b = min(a + 64, r.num_sequences)
        r.rows(int(rs[a]), int(rs[b]))
        r.tokens(int(rs[a]) + a, int(rs[b]) + b)
        pos += int(rs[b] - rs[a])
        if time.perf_counter() - t0 > seconds:
            break
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"positions": pos, "wall_s": wall, "pos_per_s": pos / wall, "pos_per_cpu_s": pos / cpu}


# --------------------------------------------------------------------------- 3-5. loaders
def loader_rate(
    source: Any,
    workers: int,
    seconds: float,
    *,
    pin: bool,
    shuffle: bool,
    warm: int | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Steady positions/s delivered by ``CacheDataLoader`` (see the module docstring)."""
    import torch
    from logitcache.client import CacheDataLoader, CacheDataset

    settings = {**LOADER, **(SHUFFLE if shuffle else {}), **extra}
    ds = CacheDataset(source, shuffle=shuffle, ids_dtype=torch.int32, seed=1, **settings)
    kwargs: dict[str, Any] = {"num_workers": workers, "pin_memory": pin}
    if workers:
        kwargs["prefetch_factor"] = 4
    loader = CacheDataLoader(ds, **kwargs)
    warm = max(WARM_UNITS if warm is None else warm, 2 * max(1, workers))
    t_start = time.perf_counter()
    pos = units = 0
    t0 = None
    pinned = True
    for unit in loader:
        units += 1
        if units == warm:
            t0, t_first = time.perf_counter(), time.perf_counter() - t_start
            continue
        if t0 is None:
            continue
        pos += int(unit["loss_mask"].sum())
        pinned = pinned and (not pin or unit["topk_ids"].is_pinned())
        if time.perf_counter() - t0 >= seconds:
            break
    if t0 is None:
        raise RuntimeError("epoch shorter than the warm-up; use a larger cache")
    wall = time.perf_counter() - t0
    from logitcache.client.readahead import default_read_threads

    threads = ds.read_threads or default_read_threads(workers, os.cpu_count())
    return {
        "workers": workers,
        "read_threads": threads,
        "pin_memory": pin,
        "pinned": pinned,
        "shuffle": shuffle,
        "settings": {k: v for k, v in settings.items()},
        "warm_units": warm,
        "startup_s": t_first,
        "positions": pos,
        "wall_s": wall,
        "pos_per_s": pos / wall,
    }


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (and its waited-for children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def serve(root: str, port: int) -> None:
    """The server part of the HTTP step: the real store route under uvicorn (no engine)."""
    from types import SimpleNamespace

    import uvicorn
    from fastapi import FastAPI
    from logitcache.server import routes_store
    from logitcache.server.caches import CacheRegistry
    from logitcache.server.errors import install_error_handlers

    app = FastAPI()
    app.include_router(routes_store.router)
    install_error_handlers(app)
    app.state.services = SimpleNamespace(caches=CacheRegistry(root))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


@contextlib.contextmanager
def http_server(root: str) -> Iterator[tuple[str, int]]:
    """A server process (``serve``) on a free loopback port; yields ``(url, pid)``."""
    import socket

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, __file__, "serve", "--root", root, "--port", str(port)],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            if proc.poll() is not None:
                raise RuntimeError(f"the server process exited with {proc.returncode}")
            try:
                if httpx.get(f"{url}/v1/caches/{CACHE}/store/zarr.json").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        yield url, proc.pid
    finally:
        proc.terminate()
        proc.wait(30)


def http_rates(
    root: str,
    workers: list[int],
    seconds: float,
    threads: list[int],
    worker_threads: tuple[int, ...] = (0,),
) -> list[dict[str, Any]]:
    """HttpSource (store transport) against a server process on loopback: one client process
    with each ``threads`` (``read_threads``), then each ``workers`` (> 0) count of workers."""
    from logitcache.client import HttpSource

    runs = [(0, t) for t in threads] if 0 in workers else []
    runs += [(w, t or None) for t in worker_threads for w in workers if w > 0]
    out = []
    with http_server(root) as (url, pid):
        for w, t in runs:
            c0 = proc_cpu_s(pid)
            r = loader_rate(
                HttpSource(url, CACHE), w, seconds, pin=w > 0, shuffle=True, read_threads=t
            )
            r["server_cpu_s"] = proc_cpu_s(pid) - c0
            # CPU over the whole run (start-up reads included) per steady position: an upper bound
            r["server_cpu_us_per_position_upper"] = 1e6 * r["server_cpu_s"] / r["positions"]
            out.append(r)
            log("http", json.dumps(r))
    return out


# --------------------------------------------------------------------------- 6. random access
def random_access(url: str, root: Path, n_single: int, n_batches: int) -> dict[str, Any]:
    """``sequence(i)`` / ``sequences(idx)`` vs an uncompressed .npy copy (same sequences)."""
    from logitcache.cache_format import CacheReader

    r = CacheReader(url)
    rs = np.append(r.row_starts, r.num_rows)
    # the .npy copy holds the first sequences, up to ~2M positions; indices are drawn from them
    s_max = max(1, min(int(np.searchsorted(rs, 2_000_000)), r.num_sequences))
    block = r.rows(0, int(rs[s_max]), logprob_dtype="float16")
    d = root / "npy"
    d.mkdir(parents=True, exist_ok=True)
    np.save(d / "ids.npy", block.topk_ids)
    np.save(d / "lp.npy", block.topk_logprobs.astype(np.float16))
    np.save(d / "tail.npy", block.tail_mass)
    np.save(d / "tok.npy", r.tokens(0, int(rs[s_max]) + s_max))
    del block
    mi, ml, mt, mk = (np.load(d / f"{n}.npy", mmap_mode="r") for n in ("ids", "lp", "tail", "tok"))
    rng = np.random.default_rng(0)
    picks = rng.integers(0, s_max, size=n_single)
    batches = rng.integers(0, s_max, size=(n_batches, 32))

    def npy_one(i: int) -> tuple:
        a, b = int(rs[i]), int(rs[i + 1])
        return (
            np.array(mi[a:b]),
            np.array(ml[a:b]),
            np.array(mt[a:b]),
            np.array(mk[a + i : b + i + 1]),
        )

    def timed(fn) -> tuple[float, float]:
        fn()  # warm
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        return time.perf_counter() - t0, time.process_time() - c0

    out: dict[str, Any] = {"sequences_drawn_from": s_max, "positions_drawn_from": int(rs[s_max])}
    w, c = timed(lambda: [r.sequence(int(i)) for i in picks])
    out["sequence_seq_per_s"], out["sequence_seq_per_cpu_s"] = n_single / w, n_single / c
    w, c = timed(lambda: [r.sequences(b.tolist()) for b in batches])
    n_b = batches.size
    out["sequences32_seq_per_s"], out["sequences32_seq_per_cpu_s"] = n_b / w, n_b / c
    threaded = CacheReader(url, decode_threads=8)
    w, c = timed(lambda: [threaded.sequences(b.tolist()) for b in batches])
    out["sequences32_8threads_seq_per_s"], out["sequences32_8threads_seq_per_cpu_s"] = (
        n_b / w,
        n_b / c,
    )
    w, c = timed(lambda: [npy_one(int(i)) for i in picks])
    out["npy_seq_per_s"], out["npy_seq_per_cpu_s"] = n_single / w, n_single / c
    out["sequence_x_npy"] = out["sequence_seq_per_s"] / out["npy_seq_per_s"]
    out["sequences32_x_npy"] = out["sequences32_seq_per_s"] / out["npy_seq_per_s"]
    out["sequences32_8threads_x_npy"] = out["sequences32_8threads_seq_per_s"] / out["npy_seq_per_s"]
    return out


def chunk_options(url: str, n_seq: int, rows: int = 262_144) -> dict[str, Any]:
    """The format question behind random access: what smaller inner chunks cost and give.

    The stored (encoded) values of the first ``rows`` rows of ``topk_ids`` and ``topk_logprobs``
    (row-delta bit patterns) and of the first ``rows`` tokens are recompressed with the format's
    own codecs (blosc zstd 1, bitshuffle for ids and tokens, shuffle for logprobs, one blosc block
    per chunk) at each inner-chunk size. Reported per size: bytes per position of those arrays
    (compressed chunks + 4-byte CRC32C + 16-byte shard-index entry each) and the one-thread CPU
    time to decode the chunks that ``n_seq`` random sequences touch (lengths drawn from the
    cache's, start rows uniform). A random ``sequence(i)`` decodes whole chunks, so this time is
    its floor before any I/O or Python.
    """
    import numcodecs.blosc
    from logitcache.cache_format import CacheReader, spec

    numcodecs.blosc.use_threads = False
    r = CacheReader(url)
    rows = min(rows, r.num_rows)
    arrays = {
        "ids": (np.asarray(r._arrays[spec.TOPK_IDS][:rows]), numcodecs.blosc.BITSHUFFLE),
        "lp": (np.asarray(r._arrays[spec.TOPK_LOGPROBS][:rows]), numcodecs.blosc.SHUFFLE),
        "tok": (np.asarray(r._arrays[spec.INPUT_IDS][:rows]), numcodecs.blosc.BITSHUFFLE),
    }
    rng = np.random.default_rng(1)
    lengths = rng.choice(np.asarray(r.lengths, dtype=np.int64), size=n_seq)
    lengths = np.minimum(lengths, rows // 2)
    starts = rng.integers(0, rows - lengths)
    out: dict[str, Any] = {"rows": rows, "sequences": n_seq, "mean_length": float(lengths.mean())}
    sizes = {"ids": [2048, 1024, 512, 256, 128], "lp": [2048, 1024, 512, 256, 128]}
    sizes["tok"] = [65536, 8192, 2048, 512]
    for name, (data, shuffle) in arrays.items():
        per = []
        for c in sizes[name]:
            frames = []
            for a in range(0, rows - rows % c, c):
                chunk = np.ascontiguousarray(data[a : a + c])
                frames.append(
                    numcodecs.blosc.compress(chunk, b"zstd", 1, shuffle, blocksize=chunk.nbytes)
                )
            nbytes = sum(len(f) + 4 + 16 for f in frames)
            dest = np.empty_like(data[:c])
            t0 = time.process_time()
            touched = 0
            for a, n in zip(starts.tolist(), lengths.tolist(), strict=True):
                for ci in range(a // c, min((a + n - 1) // c + 1, len(frames))):
                    numcodecs.blosc.decompress(frames[ci], dest)
                    touched += 1
            cpu = time.process_time() - t0
            per.append(
                {
                    "chunk": c,
                    "bytes_per_position": nbytes / (len(frames) * c),
                    "chunks_per_sequence": touched / n_seq,
                    "decode_ms_per_sequence": 1e3 * cpu / n_seq,
                }
            )
        out[name] = per
    return out


# --------------------------------------------------------------------------- 7. data wait
def data_wait(
    source: Any, workers: int, steps: int, warmup: int, ddp: bool = True, fed_steps: int = 120
) -> dict[str, Any]:
    """Student steps fed by the loader: fraction of step time spent waiting in ``next()``.

    ``ddp``: the model is wrapped in ``DistributedDataParallel`` in a one-process NCCL group (the
    gradient all-reduce path of a DDP trainer; ``CacheDataset`` takes its rank from the group).
    """
    import client_trainstep as ts
    import torch
    import torch.distributed as dist
    from logitcache.client import CacheDataLoader, CacheDataset
    from transformers import LlamaConfig, LlamaForCausalLM

    loss_fn = ts.load_loss()
    hidden, layers, heads, ffn = ts.SIZES["small"]
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        intermediate_size=ffn,
        max_position_embeddings=LOADER["tokens_per_item"],
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    torch.cuda.set_device(0)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)

    class Distill(torch.nn.Module):
        """Forward = student hidden states + top-k distillation loss (one DDP forward)."""

        def __init__(self, m: Any) -> None:
            super().__init__()
            self.m = m

        def forward(self, b: dict[str, torch.Tensor]) -> torch.Tensor:
            out = self.m.model(input_ids=b["input_ids"], position_ids=b["position_ids"])
            h = out.last_hidden_state.reshape(-1, hidden)
            return loss_fn(
                h,
                self.m.lm_head.weight,
                b["topk_ids"].reshape(h.shape[0], K).long(),
                b["topk_logprobs"].reshape(h.shape[0], K),
                b["tail_mass"].reshape(-1),
                mask=b["loss_mask"].reshape(-1),
            )

    net: torch.nn.Module = Distill(model)
    if ddp:
        import socket

        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            port = sk.getsockname()[1]
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        net = torch.nn.parallel.DistributedDataParallel(net, device_ids=[0])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(b: dict[str, torch.Tensor]) -> None:
        net(b).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    ds = CacheDataset(source, ids_dtype=torch.int32, seed=2, **LOADER, **SHUFFLE)
    loader = CacheDataLoader(ds, num_workers=workers, pin_memory=True, prefetch_factor=4)
    it = iter(loader)

    def to_gpu(u: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: v.to("cuda", non_blocking=True) for n, v in u.items()}

    first = to_gpu(next(it))
    for _ in range(warmup):  # pure step: one batch kept on the GPU
        step(first)
    torch.cuda.synchronize()
    pure = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step(first)
        torch.cuda.synchronize()
        pure.append(time.perf_counter() - t0)
    # the workers filled their queues (num_workers x prefetch_factor batches) during the pure
    # steps: the first fed steps are served from that buffer, so the steady figures leave them out
    skip = warmup + workers * 4
    waits, totals, pos = [], [], 0
    for i in range(skip + fed_steps):
        if i == skip:
            waits, totals, pos = [], [], 0
        t0 = time.perf_counter()
        u = next(it)
        t1 = time.perf_counter()
        pos += int(u["loss_mask"].sum())
        step(to_gpu(u))
        torch.cuda.synchronize()
        waits.append(t1 - t0)
        totals.append(time.perf_counter() - t0)
    params = sum(p.numel() for p in model.parameters())
    positions = LOADER["batch_size"] * LOADER["tokens_per_item"]
    del it, loader
    if ddp:
        dist.destroy_process_group()
    return {
        "source": repr(ds.source),
        "ddp_world_1_nccl": ddp,
        "loader": {**LOADER, **SHUFFLE, "num_workers": workers, "pin_memory": True},
        "gpu": torch.cuda.get_device_name(),
        "params": params,
        "workers": workers,
        "steps": steps,
        "fed_steps_timed": fed_steps,
        "fed_steps_skipped": skip,
        "wait_s_max": float(np.max(waits)),
        "pure_step_s_median": float(np.median(pure)),
        "pure_positions_per_s": positions / float(np.median(pure)),
        "fed_step_s_mean": float(np.mean(totals)),
        "wait_s_mean": float(np.mean(waits)),
        "wait_fraction": float(np.sum(waits) / np.sum(totals)),
        "supervised_positions_per_s_fed": pos / float(np.sum(totals)),
    }


# --------------------------------------------------------------------------- main
def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc.get("scaling", [])
    if not rows:
        return
    w = [r["workers"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(w, [r["pos_per_s"] / 1e6 for r in rows], "o-", label="local store, full shuffle")
    http = [r for r in doc.get("http", []) if r["workers"] > 0]
    if http:
        ax.plot(
            [r["workers"] for r in http],
            [r["pos_per_s"] / 1e6 for r in http],
            "s",
            label="HTTP (store transport)",
        )
    if "reader" in doc:
        ax.axhline(doc["reader"]["pos_per_s"] / 1e6, ls=":", c="gray", label="reader, 1 process")
    ax.axhline(1.0, ls="--", c="red", label="goal: 1M at 8 workers")
    ax.set_xlabel("DataLoader workers (pin_memory=True)")
    ax.set_ylabel("positions/s delivered to the trainer (millions)")
    ax.set_title(f"CacheDataLoader, k={K}, vocab {VOCAB:,}: {doc['machine']['cpus']} CPUs")
    ax.set_xticks(w)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("mode", nargs="?", default="bench", choices=["bench", "serve"])
    p.add_argument("--root", default="/tmp/lc-client-scaling")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--positions", type=int, default=20_000_000)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8, 12])
    p.add_argument("--http-workers", type=int, nargs="+", default=[0, 8])
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--random", type=int, default=300, help="single random reads (and /10 batches)")
    p.add_argument("--gpu", action="store_true", help="also the data-wait step on a CUDA GPU")
    p.add_argument("--gpu-workers", type=int, default=8)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--budget-s", type=float, default=540, help="skip steps once this is spent")
    p.add_argument(
        "--warm",
        type=int,
        default=0,
        help="untimed batches before a loader is timed (default 2 per worker; lanes x window "
        "blocks are read before the first batch of every lane, so one process needs more)",
    )
    p.add_argument("--shuffle-seconds", type=float, default=10.0, help="one-process window")
    p.add_argument("--shuffle-warm", type=int, default=30, help="one-process untimed batches")
    p.add_argument("--http-threads", type=int, nargs="+", default=[4, 8])
    p.add_argument(
        "--worker-threads",
        type=int,
        nargs="+",
        default=[0],
        help="read_threads per DataLoader worker in the scaling and HTTP-worker steps (0: default)",
    )
    p.add_argument("--ddp", action="store_true", help="data wait under a world-1 NCCL DDP")
    p.add_argument("--fed-steps", type=int, default=120, help="timed loader-fed steps")
    p.add_argument("--skip", nargs="*", default=[], help="steps to leave out")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)
    args = p.parse_args()
    if args.mode == "serve":
        serve(args.root, args.port)
        return
    global WARM_UNITS
    WARM_UNITS = args.warm
    start = time.perf_counter()
    root = Path(args.root)
    url = str(root / CACHE)
    doc: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]),
        "machine": {
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_before": os.getloadavg(),
        },
        "settings": {"loader": LOADER, "shuffle": SHUFFLE, "k": K, "vocab": VOCAB},
    }

    def save() -> None:
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(doc, indent=2) + "\n")

    def run(name: str, fn) -> None:
        if name in args.skip:
            return
        if time.perf_counter() - start > args.budget_s:
            doc.setdefault("skipped", []).append(name)
            log("skipped (budget)", name)
            return
        log("start", name)
        try:
            doc[name] = fn()
        except Exception as e:  # noqa: BLE001 - a failed step is recorded, the rest still runs
            import traceback

            traceback.print_exc()
            doc.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"
        log("done", name, json.dumps(doc.get(name))[:600])
        save()

    if not (root / CACHE / "zarr.json").exists():
        run("build", lambda: build(url, args.positions))
    secs = args.seconds
    run("reader", lambda: reader_rate(url, secs))

    def one_process() -> dict[str, Any]:
        """One process: sequential vs full shuffle, same timing window and warm-up (past the
        24-lane start-up: lanes x window blocks are read before every lane's first batch)."""
        ss, warm = args.shuffle_seconds, args.shuffle_warm
        out: dict[str, Any] = {}
        for threads in (None, 1):  # default read threads, then one read at a time
            tag = "" if threads is None else "_threads1"
            kw = {"pin": False, "warm": warm, "read_threads": threads}
            out["sequential" + tag] = loader_rate(url, 0, ss, shuffle=False, **kw)
            out["full_shuffle" + tag] = loader_rate(url, 0, ss, shuffle=True, **kw)
            # one process has no workers to spread lanes over: the same shuffle, one lane
            out["full_shuffle_lanes1" + tag] = loader_rate(url, 0, ss, shuffle=True, lanes=1, **kw)
            seq = out["sequential" + tag]["pos_per_s"]
            out["ratio" + tag] = out["full_shuffle" + tag]["pos_per_s"] / seq
            out["ratio_lanes1" + tag] = out["full_shuffle_lanes1" + tag]["pos_per_s"] / seq
        if "reader" in doc:  # vs the format library's one-thread sequential rows()+tokens()
            r = doc["reader"]["pos_per_s"]
            out["x_reader"] = out["full_shuffle"]["pos_per_s"] / r
            out["x_reader_lanes1"] = out["full_shuffle_lanes1"]["pos_per_s"] / r
        return out

    run("shuffle", one_process)
    run(
        "scaling",
        lambda: [
            loader_rate(url, w, secs, pin=True, shuffle=True, read_threads=t or None)
            for t in args.worker_threads
            for w in args.workers
        ],
    )
    run(
        "http",
        lambda: http_rates(
            str(root), args.http_workers, secs, args.http_threads, args.worker_threads
        ),
    )

    def datawait_http() -> dict[str, Any]:
        from logitcache.client import HttpSource

        with http_server(str(root)) as (http_url, pid):
            c0 = proc_cpu_s(pid)
            src = HttpSource(http_url, CACHE)
            out = data_wait(src, args.gpu_workers, args.steps, 5, args.ddp, args.fed_steps)
            out["server_cpu_s"] = proc_cpu_s(pid) - c0
        return out

    if args.gpu:
        local = lambda: data_wait(url, args.gpu_workers, args.steps, 5, args.ddp, args.fed_steps)  # noqa: E731
        run("datawait", local)
        run("datawait_http", datawait_http)
    run("random", lambda: random_access(url, root, args.random, max(1, args.random // 10)))
    run("chunk_options", lambda: chunk_options(url, args.random))
    doc["machine"]["load_after"] = os.getloadavg()
    doc["wall_s"] = time.perf_counter() - start
    save()
    if args.plot:
        plot(doc, args.plot)
    summary = {
        "reader": doc.get("reader", {}).get("pos_per_s"),
        "shuffle_ratio": doc.get("shuffle", {}).get("ratio"),
        "shuffle_ratio_lanes1": doc.get("shuffle", {}).get("ratio_lanes1"),
        "scaling": [
            (r["workers"], r["read_threads"], round(r["pos_per_s"])) for r in doc.get("scaling", [])
        ],
        "http": [
            (r["workers"], r["read_threads"], round(r["pos_per_s"])) for r in doc.get("http", [])
        ],
        "random": doc.get("random"),
        "chunk_options": doc.get("chunk_options"),
        "datawait": {
            k: {
                f: doc[k].get(f) for f in ("wait_fraction", "fed_step_s_mean", "pure_step_s_median")
            }
            for k in ("datawait", "datawait_http")
            if isinstance(doc.get(k), dict)
        },
        "errors": doc.get("errors"),
    }
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()

"""Micro-benches of the job path's non-write stages (issue #19, session 9): CPU-us per position
(``time.thread_time``, user + system of the calling thread) of

* ``tail``: the tail mass of one request's rows as the vLLM hook hands them (columns ``1..k`` of a
  ``[L-1, k+1]`` float32 buffer): numpy's formula (``records.tail_numpy``) against the compiled
  passes around numpy's ``exp`` (``fastencode.tail_rows``), over as many requests as one 65K-row
  append holds (cold-ish: the set is larger than the L2 cache);
* ``encode``: ``writer.encode_batch`` of those records into fresh output arrays, and into a kept
  ``fastencode.Outputs`` (the first call of each faults its pages in; the rest reuse them), with
  the calling thread's minor page faults, and of the same rows with a top-1 logprob of -1e-6 (a
  subnormal half: the kernel's exact path);
* ``submit``: reading and checking a JSONL input of 256-token sequences (``inputs.scan`` plus the
  digest, what a job's submission does) through ``json.loads`` and through
  ``server/inputs/jsonids.py``.

Usage::

    .venv/bin/python benchmarks/job_stages_micro.py --k 100 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

VOCAB = 4096


def _buffers(k: int, requests: int, length: int, seed: int = 0) -> list[tuple[np.ndarray, ...]]:
    """The hook's per-request buffers: int32 ids and float32 logprobs ``[L-1, k+1]``, column 0
    the actual token, then distinct ids by descending (peaked) logprob."""
    rng = np.random.default_rng(seed)
    out = []
    m, w = length - 1, k + 1
    for _ in range(requests):
        start = rng.integers(0, VOCAB, (m, 1))
        stride = 2 * rng.integers(0, VOCAB // 2, (m, 1)) + 1
        g = rng.gamma(0.3, size=(m, k + 64))
        lps = np.log(-np.sort(-(g / g.sum(axis=1, keepdims=True)), axis=1)[:, :k])
        tok = np.empty((m, w), np.int32)
        tok[:, 0], tok[:, 1:] = 1, (start + stride * np.arange(k)[None, :]) % VOCAB
        lp = np.empty((m, w), np.float32)
        lp[:, 0], lp[:, 1:] = -7.0, lps
        inp = rng.integers(0, VOCAB, length).astype(np.int32)
        out.append((inp, tok, lp))
    return out


def _us(seconds: float, positions: int) -> float:
    return seconds / positions * 1e6


def bench_tail(bufs: list, repeats: int) -> dict:
    from logitcache.cache_format import fastencode
    from logitcache.cache_format.records import tail_numpy

    assert fastencode.ready() and fastencode._tail is not None
    pos = sum(b[2].shape[0] for b in bufs)
    res: dict[str, list[float]] = {"numpy": [], "compiled": []}
    for _ in range(repeats):
        for name, fn in (("numpy", tail_numpy), ("compiled", fastencode.tail_rows)):
            t0 = time.thread_time()
            for _inp, _tok, lp in bufs:
                fn(lp[:, 1:])
            res[name].append(_us(time.thread_time() - t0, pos))
    return res


def bench_encode(bufs: list, k: int, repeats: int) -> dict:
    from logitcache.cache_format import _writer as writer
    from logitcache.cache_format import fastencode
    from logitcache.cache_format.records import SequenceRecord

    assert fastencode.ready()
    man = SimpleNamespace(
        k=k, loss_mask=False, logprob_dtype="float16", vocab_size=VOCAB, tail_mass_dtype="float32"
    )
    recs = [
        SequenceRecord(f"s{i}", inp, tok[:, 1:], lp[:, 1:], fastencode.tail_rows(lp[:, 1:]))
        for i, (inp, tok, lp) in enumerate(bufs)
    ]
    confident = []  # the same rows with a top-1 of -1e-6 (a subnormal half: the exact path)
    for i, (inp, tok, lp) in enumerate(bufs):
        lp2 = lp.copy()
        lp2[:, 1] = -1e-6
        confident.append(SequenceRecord(f"c{i}", inp, tok[:, 1:], lp2[:, 1:], recs[i].tail_mass))
    pos = sum(r.num_rows for r in recs)
    res: dict[str, list] = {"fresh": [], "kept": [], "fresh_faults": [], "kept_faults": []}
    res["kept_top1_near_0"] = []
    kept = fastencode.Outputs()
    for _ in range(repeats):
        t0 = time.thread_time()
        writer.encode_batch(confident, man, kept)
        res["kept_top1_near_0"].append(_us(time.thread_time() - t0, pos))
        for name, out in (("fresh", None), ("kept", kept)):
            f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            t0 = time.thread_time()
            got = writer.encode_batch(recs, man, out)
            res[name].append(_us(time.thread_time() - t0, pos))
            res[f"{name}_faults"].append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0)
            del got
    return res


def bench_submit(sequences: int, length: int, repeats: int) -> dict:
    from logitcache.protocol import InputFile
    from logitcache.server.inputs import jsonids
    from logitcache.server.inputs import records as inputs

    rng = np.random.default_rng(1)
    d = Path(tempfile.mkdtemp(prefix="stages-micro-"))
    (d / "in.jsonl").write_text(
        "\n".join(
            json.dumps({"id": f"s{i}", "input_ids": rng.integers(0, VOCAB, length).tolist()})
            for i in range(sequences)
        )
    )
    spec = InputFile(path="in.jsonl")
    limits = inputs.Limits(vocab_size=VOCAB, max_seq_len=4096)
    pos = sequences * (length - 1)
    ready = jsonids.ready()
    res: dict[str, list[float]] = {"json": [], "jsonids": []}
    for _ in range(repeats):
        for name, state in (("json", "off"), ("jsonids", "ready" if ready else "off")):
            jsonids._state = state
            t0 = time.thread_time()
            raws = inputs.raw_records(file=spec, records=None, data_dir=d)
            inputs.scan(raws, None, limits, keep=[], keep_tokens=1 << 30)
            inputs.input_digest(file=spec, records=None, data_dir=d)
            res[name].append(_us(time.thread_time() - t0, pos))
    jsonids._state = "ready" if ready else "off"
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--requests", type=int, default=256, help="requests (records) per pass")
    p.add_argument("--sequences", type=int, default=2048, help="lines of the submit bench")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    from logitcache.server.batch.jobs import numpy_hugepages_off

    numpy_hugepages_off()  # as the job runner's process
    load = os.getloadavg()[0]
    bufs = _buffers(args.k, args.requests, args.length)
    out = {
        "command": "python benchmarks/job_stages_micro.py "
        + " ".join(f"--{n.replace('_', '-')} {v}" for n, v in vars(args).items() if n != "json"),
        "machine": f"{os.cpu_count()} CPU cores (shared), no GPU",
        "load_avg_1min_before": load,
        "tail": bench_tail(bufs, args.repeats),
        "encode": bench_encode(bufs, args.k, args.repeats),
        "submit": bench_submit(args.sequences, args.length, args.repeats),
        "load_avg_1min_after": os.getloadavg()[0],
    }
    for stage in ("tail", "encode", "submit"):
        for name, xs in out[stage].items():
            fmt = "{:d}" if name.endswith("faults") else "{:.3f}"
            med = statistics.median(xs)
            print(
                f"{stage:7s} {name:14s} median {fmt.format(med) if fmt == '{:.3f}' else med}: "
                + " ".join(fmt.format(x) for x in xs)
            )
    print(f"load {load:.1f} -> {out['load_avg_1min_after']:.1f}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""Cost of sampled targets in the vLLM backend, against top-k scoring, in one run.

    VLLM_CPU_KVCACHE_SPACE=1 VLLM_HOST_IP=127.0.0.1 HF_HUB_OFFLINE=1 \\
    VLLM_ENABLE_V1_MULTIPROCESSING=0 python -m experiments.vllm_sampling

One in-process :class:`~logitcache.server.engine.vllm.VllmEngine` (the service's engine, on the
tiny teacher, float32, ``max_k = V`` so that the full-vocabulary baseline is allowed) scores the
same held-out sequences three ways, repeated and interleaved so that the shared machine's load
hits all alike:

* ``topk``: ``engine.score(prompts, k)`` (what a top-k job does; the baseline);
* ``sampled``: ``engine.score_sampled(prompts, keys, SampledTargets(draws))``: the draws are made
  inside vLLM's worker where the ``[n, V]`` block exists (``server/engine/vllm_sampling.py``),
  only ``draws + 1`` values per position leave the engine;
* ``full``: ``engine.score(prompts, V)`` (all ``V`` prompt logprobs per position, as arrays) and
  :func:`~logitcache.cache_format.sampling.sample_rows` on the service side: the mechanism
  measured before the hook existed (that measurement, with vLLM's Python lists, was 14.8x).

Reported: median wall per round and its ratio to ``topk``, and two checks: the hook's rows equal
the rows sampled from the full-vocabulary logprobs for the same seed and key (both from vLLM's
float32 log-softmax), and the share of rows equal to those of the transformers backend (a draw
within float rounding of a CDF step can differ).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import ROOT


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sequences", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--k", type=int, default=64)
    p.add_argument("--draws", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=ROOT / "experiments/results/distill_vllm.json")
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from logitcache.cache_format.sampling import sample_rows, uniforms
    from logitcache.fixtures.tiny import build_tiny_models
    from logitcache.server.engine import SampledTargets, build_engine

    tiny = build_tiny_models()
    vocab = tiny.vocab_size
    seqs = tiny.token_sequences("heldout", max_len=args.seq_len, min_len=16, limit=args.sequences)
    keys = [f"s{i}" for i in range(len(seqs))]
    tokens = sum(len(s) for s in seqs)
    targets = SampledTargets(draws=args.draws, seed=0)
    engine = build_engine(
        model=str(tiny.teacher_dir),
        backend="vllm",
        max_k=vocab,
        dtype="float32",
        options={"vllm_mode": "inproc"},
    )
    last: dict[str, Any] = {}

    async def topk_round() -> float:
        t0 = time.perf_counter()
        await engine.score(seqs, args.k)
        return time.perf_counter() - t0

    async def sampled_round() -> float:
        t0 = time.perf_counter()
        last["hook"] = await engine.score_sampled(seqs, keys, targets)
        return time.perf_counter() - t0

    async def full_round() -> float:
        t0 = time.perf_counter()
        outs = await engine.score(seqs, vocab)
        rows = []
        for s, key, out in zip(seqs, keys, outs, strict=True):
            dense = np.full((len(s) - 1, vocab), -np.inf, dtype=np.float32)
            np.put_along_axis(dense, out.topk_ids.astype(np.int64), out.topk_logprobs, axis=1)
            u = uniforms(targets.seed, key, len(s) - 1, args.draws)
            rows.append(sample_rows(torch.from_numpy(dense), u))
        last["full"] = rows
        return time.perf_counter() - t0

    async def run() -> dict[str, list[float]]:
        times: dict[str, list[float]] = {"topk": [], "sampled": [], "full": []}
        for fn in (topk_round, sampled_round, full_round):  # warm-up
            await fn()
        for _ in range(args.rounds):
            times["topk"].append(await topk_round())
            times["sampled"].append(await sampled_round())
            times["full"].append(await full_round())
        return times

    times = asyncio.run(run())
    hook_eq_full = sum(
        int((h.topk_ids == f[0]).all(axis=1).sum())
        for h, f in zip(last["hook"], last["full"], strict=True)
    )
    asyncio.run(engine.aclose())
    hf = build_engine(model=str(tiny.teacher_dir), backend="transformers", dtype="float32")
    ref = asyncio.run(hf.score_sampled(seqs, keys, targets))
    hook_eq_hf = sum(
        int((h.topk_ids == r.topk_ids).all(axis=1).sum())
        for h, r in zip(last["hook"], ref, strict=True)
    )
    rows = tokens - len(seqs)
    med = {m: statistics.median(t) for m, t in times.items()}
    result = {
        "command": "python -m experiments.vllm_sampling " + " ".join(argv or sys.argv[1:]),
        "machine": f"{platform.machine()} {os.cpu_count()} CPU cores (shared), vLLM CPU",
        "load_average": os.getloadavg(),
        "sequences": len(seqs),
        "tokens": tokens,
        "vocab": vocab,
        "k": args.k,
        "draws": args.draws,
        "rounds_s": times,
        "median_s": med,
        "tokens_per_s": {m: tokens / t for m, t in med.items()},
        "sampled_hook_vs_topk_time": med["sampled"] / med["topk"],
        "full_vocab_vs_topk_time": med["full"] / med["topk"],
        "hook_rows_equal_full_vocab_rows": hook_eq_full / rows,
        "hook_rows_equal_transformers_rows": hook_eq_hf / rows,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()

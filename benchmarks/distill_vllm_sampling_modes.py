"""Sampled targets through vLLM where the suite's engine does not go: chunked prefill and the
engine core in its own process. Both must give the transformers backend's rows.

    HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_HOST_IP=127.0.0.1 \\
    .venv/bin/python benchmarks/distill_vllm_sampling_modes.py --mode chunked   # or --mode async

* ``chunked``: in-process engine with ``max_num_batched_tokens=32`` and prompts of 100-200
  tokens, so every prompt's rows are drawn over several prefill chunks (the hook draws rows
  ``[start, start + n)`` of the sequence's uniforms per chunk);
* ``async``: ``AsyncLLM`` with vLLM's engine core in its own process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=1``): the hook reaches that process only through
  ``worker_extension_cls``.

Reported: the share of rows equal to the transformers backend's for the same seed and keys (a
draw within float rounding of a CDF step may differ); appended to
``benchmarks/results/distill_vllm_modes.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def main() -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("chunked", "async"), required=True)
    p.add_argument("--draws", type=int, default=32)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/distill_vllm_modes.json")
    args = p.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if args.mode == "async" else "0"
    from logitcache.fixtures.tiny import build_tiny_models
    from logitcache.server.engine import SampledTargets, build_engine

    tiny = build_tiny_models()
    seqs = tiny.token_sequences("heldout", max_len=200, min_len=100, limit=4)
    keys = [f"s{i}" for i in range(len(seqs))]
    targets = SampledTargets(draws=args.draws, seed=9)
    common: dict[str, Any] = dict(model=str(tiny.teacher_dir), max_k=20, dtype="float32")
    if args.mode == "chunked":
        extra: dict[str, Any] = dict(
            options={"vllm_mode": "inproc"}, max_num_batched_tokens=32, max_num_seqs=4
        )
    else:
        extra = dict(options={"vllm_mode": "async"})
    engine = build_engine(backend="vllm", **common, **extra)

    async def sampled() -> Any:
        try:
            return await engine.score_sampled(seqs, keys, targets)
        finally:
            await engine.aclose()

    got = asyncio.run(sampled())
    hf = build_engine(backend="transformers", **common)
    ref = asyncio.run(hf.score_sampled(seqs, keys, targets))
    same = sum(int((a.topk_ids == b.topk_ids).all(1).sum()) for a, b in zip(got, ref, strict=True))
    rows = sum(r.num_rows for r in ref)
    result = {
        "command": f"python benchmarks/distill_vllm_sampling_modes.py --mode {args.mode}",
        "machine": f"{platform.machine()} {os.cpu_count()} CPU cores (shared), vLLM CPU",
        "mode": args.mode,
        "prompt_lengths": [len(s) for s in seqs],
        "draws": args.draws,
        "rows": rows,
        "rows_equal_transformers": same,
        "share_equal": same / rows,
    }
    old = json.loads(args.out.read_text()) if args.out.exists() else {}
    old[args.mode] = result
    args.out.write_text(json.dumps(old, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()

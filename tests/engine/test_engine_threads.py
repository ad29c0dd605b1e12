"""Regression: an in-process vLLM engine built after the process changed torch's thread count.

vLLM's CPU attention checks that a step's kernels run with the OpenMP thread count its metadata
was built with. A trainer (or a test) that called ``torch.set_num_threads(1)`` before the engine
existed made the engine's driver thread build its first step's metadata at OpenMP's default (2
here) and run it at 1: ``Check failed: input->metadata->thread_num == thread_num (2 vs. 1)``, and
the engine died. The driver now pins its count before every step. Run in a subprocess so the
thread count of the suite's own process is left alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

SCRIPT = r"""
import asyncio, json, sys
import torch
from logitcache.server.engine import build_engine

def main():
    teacher, sequences = sys.argv[1], json.loads(sys.argv[2])
    torch.set_num_threads(1)  # what an in-process trainer rank does before the engine exists
    engine = build_engine(model=teacher, backend="vllm", max_k=8, dtype="float32",
                          options={"vllm_mode": "inproc"})
    try:
        scores = asyncio.run(engine.score(sequences, k=8))
        again = asyncio.run(engine.score(sequences, k=8))
    finally:
        asyncio.run(engine.aclose())
    rows = [s.topk_ids.shape[0] for s in scores]
    same = all((a.topk_ids == b.topk_ids).all() for a, b in zip(scores, again))
    print(json.dumps({"rows": rows, "same": bool(same)}))

if __name__ == "__main__":
    main()
"""


@pytest.mark.timeout(300)
def test_engine_survives_a_changed_torch_thread_count(
    tiny: Any, vllm_env: dict[str, str], heldout_sequences: list[list[int]]
) -> None:
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs two cores for the counts to differ")
    seqs = [s for s in heldout_sequences if len(s) >= 8][:3]
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny.teacher_dir), json.dumps(seqs)],
        env={**os.environ, **vllm_env},
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["rows"] == [len(s) - 1 for s in seqs]
    assert out["same"]

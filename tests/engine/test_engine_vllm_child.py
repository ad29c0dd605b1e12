"""A vLLM engine in a fresh child process, for what must not share the suite's own vLLM state or
torch settings (one ``import vllm``, ~14 CPU-s; vLLM's ``AsyncLLM`` driver, its engine core in a
process of its own, is checked on the service in ``test_engine_supervisor_vllm.py``).

Regression: an in-process vLLM engine built after the process changed torch's thread count.
vLLM's CPU attention checks that a step's kernels run with the OpenMP thread count its metadata
was built with. A trainer (or a test) that called ``torch.set_num_threads(1)`` before the engine
existed made the engine's driver thread build its first step's metadata at OpenMP's default (2
here) and run it at 1: ``Check failed: input->metadata->thread_num == thread_num (2 vs. 1)``, and
the engine died. The driver now pins its count before every step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

_CHILD = r"""
import asyncio, json, sys, traceback
import torch
from logitcache.server.engine import build_engine

def threads_part(model, sequences):
    torch.set_num_threads(1)  # what an in-process trainer rank does before the engine exists
    engine = build_engine(model=model, backend="vllm", max_k=8, dtype="float32",
                          options={"vllm_mode": "inproc"})
    try:
        scores = asyncio.run(engine.score(sequences, k=8))
        again = asyncio.run(engine.score(sequences, k=8))
    finally:
        asyncio.run(engine.aclose())
    rows = [s.topk_ids.shape[0] for s in scores]
    same = all((a.topk_ids == b.topk_ids).all() for a, b in zip(scores, again))
    return {"rows": rows, "same": bool(same)}

if __name__ == "__main__":
    try:
        result = {"ok": threads_part(sys.argv[1], json.loads(sys.argv[2]))}
    except BaseException:
        result = {"error": traceback.format_exc()[-3000:]}
    print(json.dumps(result), flush=True)
"""


@pytest.mark.timeout(600)
def test_engine_survives_a_changed_torch_thread_count(
    tiny: Any, vllm_env: dict[str, str], heldout_sequences: list[list[int]]
) -> None:
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs two cores for the counts to differ")
    seqs = [s for s in heldout_sequences if len(s) >= 8][:3]
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tiny.teacher_dir), json.dumps(seqs)],
        capture_output=True,
        text=True,
        env={**os.environ, **vllm_env},
        timeout=500,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    assert lines, f"the child reported nothing:\n{proc.stderr[-4000:]}"
    result = json.loads(lines[-1])
    assert "error" not in result, result["error"]
    assert result["ok"]["rows"] == [len(s) - 1 for s in seqs]
    assert result["ok"]["same"]

"""vLLM engines in a fresh child process, for what must not share the suite's own vLLM state or
torch settings. One child (one ``import vllm``, ~14 CPU-s) runs both parts, each reported apart:

* ``async``: vLLM's ``AsyncLLM`` driver (engine core in its own process) with a temperature of 2,
  compared with the transformers backend and a full forward at the same temperature.
* ``threads`` (regression): an in-process vLLM engine built after the process changed torch's
  thread count. vLLM's CPU attention checks that a step's kernels run with the OpenMP thread
  count its metadata was built with. A trainer (or a test) that called
  ``torch.set_num_threads(1)`` before the engine existed made the engine's driver thread build
  its first step's metadata at OpenMP's default (2 here) and run it at 1: ``Check failed:
  input->metadata->thread_num == thread_num (2 vs. 1)``, and the engine died. The driver now
  pins its count before every step. The async part runs first: its engine lives in another
  process, so this process's engine is the in-process one only.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from engine_support import assert_rows_close, full_forward_logprobs
from logitcache.server.engine import build_engine

K = 8
T = 2.0
ATOL = 2e-4

_CHILD = r"""
import asyncio, json, sys, traceback
import numpy as np
import torch
from logitcache.server.engine import build_engine

async def async_part(model, out, prompts):
    eng = build_engine(model=model, backend="vllm", max_k=8, dtype="float32", temperature=2.0,
                       options={"vllm_mode": "async"})
    assert type(eng._llm).__name__ == "AsyncLLM", type(eng._llm)
    scores = await eng.score(prompts, 8)
    info = eng.info
    await eng.aclose()
    np.savez(out, *[a for s in scores for a in (s.topk_ids, s.topk_logprobs, s.tail_mass)])
    return {"temperature": info.temperature, "mode": eng.mode}

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

def report(part, call):
    try:
        result = {"ok": call()}
    except BaseException:
        result = {"error": traceback.format_exc()[-3000:]}
    print(json.dumps({part: result}), flush=True)

if __name__ == "__main__":
    model, out = sys.argv[1], sys.argv[2]
    prompts, sequences = json.loads(sys.argv[3]), json.loads(sys.argv[4])
    report("async", lambda: asyncio.run(async_part(model, out, prompts)))
    report("threads", lambda: threads_part(model, sequences))
"""


@pytest.fixture(scope="module")
def child(
    tiny: Any,
    vllm_env: dict[str, str],
    heldout_sequences: list[list[int]],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    """Both parts' results (``{"ok": ...}`` or ``{"error": traceback}``), their inputs, the
    async part's scores file and the child's stderr."""
    prompts = tiny.token_sequences("heldout", max_len=120, min_len=40, limit=3)
    seqs = [s for s in heldout_sequences if len(s) >= 8][:3]
    out = tmp_path_factory.mktemp("vllm-child") / "scores.npz"
    # AsyncLLM's engine core in its own process; the in-process part sets its own mode
    env = {**os.environ, **vllm_env, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    argv = [sys.executable, "-c", _CHILD, str(tiny.teacher_dir), str(out)]
    proc = subprocess.run(
        [*argv, json.dumps(prompts), json.dumps(seqs)],
        capture_output=True,
        text=True,
        env=env,
        timeout=500,
    )
    results: dict[str, Any] = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            results.update(json.loads(line))
    return {**results, "prompts": prompts, "seqs": seqs, "out": out, "stderr": proc.stderr}


def _ok(child: dict[str, Any], part: str) -> Any:
    result = child.get(part)
    assert result is not None, f"the child did not report {part!r}:\n{child['stderr'][-4000:]}"
    assert "error" not in result, result["error"]
    return result["ok"]


@pytest.mark.timeout(600)
def test_async_driver_applies_the_temperature(child: dict[str, Any], tiny: Any) -> None:
    meta = _ok(child, "async")
    assert meta == {"temperature": T, "mode": "async"}
    prompts = child["prompts"]
    arrays = np.load(child["out"])
    got = [tuple(arrays[f"arr_{3 * i + j}"] for j in range(3)) for i in range(len(prompts))]

    hf = build_engine(model=str(tiny.teacher_dir), backend="hf", max_k=K, temperature=T)
    try:
        ref = asyncio.run(hf.score(prompts, K))
    finally:
        asyncio.run(hf.aclose())
    for (ids, lps, tail), r in zip(got, ref, strict=True):
        assert_rows_close((ids, lps), r, atol=ATOL)
        np.testing.assert_allclose(tail, r.tail_mass, atol=K * ATOL)
    # And it really is T=2: log_softmax(z / 2) of a plain forward, not log_softmax(z).
    full = full_forward_logprobs(str(tiny.teacher_dir), prompts[0], temperature=T)
    np.testing.assert_allclose(got[0][1][:, 0], full[:-1].max(axis=1), atol=ATOL)
    plain = full_forward_logprobs(str(tiny.teacher_dir), prompts[0])
    assert np.abs(got[0][1][:, 0] - plain[:-1].max(axis=1)).max() > 0.05


@pytest.mark.timeout(600)
def test_engine_survives_a_changed_torch_thread_count(child: dict[str, Any]) -> None:
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs two cores for the counts to differ")
    out = _ok(child, "threads")
    assert out["rows"] == [len(s) - 1 for s in child["seqs"]]
    assert out["same"]

"""vLLM's ``AsyncLLM`` driver (engine core in its own process) with a temperature of 2.

Runs in a subprocess (``AsyncLLM`` starts a second process and must not share this one's vLLM
state) and compares with the transformers backend and a full forward at the same temperature.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from engine_support import assert_rows_close, full_forward_logprobs
from logitcache.server.engine import build_engine

K = 8
T = 2.0
ATOL = 2e-4

_CHILD = """
import asyncio, json, sys
import numpy as np
from logitcache.server.engine import build_engine

async def main(model, out, prompts):
    eng = build_engine(model=model, backend="vllm", max_k=8, dtype="float32", temperature=2.0,
                       options={"vllm_mode": "async"})
    assert type(eng._llm).__name__ == "AsyncLLM", type(eng._llm)
    scores = await eng.score(prompts, 8)
    info = eng.info
    await eng.aclose()
    np.savez(out, *[a for s in scores for a in (s.topk_ids, s.topk_logprobs, s.tail_mass)])
    print(json.dumps({"temperature": info.temperature, "mode": eng.mode}))

if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3])))
"""


def test_async_driver_applies_the_temperature(tiny, vllm_env, tmp_path: Path) -> None:
    import json

    prompts = tiny.token_sequences("heldout", max_len=120, min_len=40, limit=3)
    out = tmp_path / "scores.npz"
    env = {**os.environ, **vllm_env, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tiny.teacher_dir), str(out), json.dumps(prompts)],
        capture_output=True,
        text=True,
        env=env,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    meta = json.loads(proc.stdout.strip().splitlines()[-1])
    assert meta == {"temperature": T, "mode": "async"}
    arrays = np.load(out)
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

"""Two in-process vLLM engines in one process: closing one leaves the other working.

vLLM's ``EngineCore.shutdown`` tears down the process-global distributed state (the world-1
model-parallel groups) that every in-process engine shares. Before the fix, closing a second engine
(a test's own, or a server app's) made the suite's shared engine fail its next step with "pipeline
model parallel group is not initialized" (seen in a full-suite run: a job failed mid-test).
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from conftest import ENGINE_MAX_K


@pytest.mark.timeout(300)
def test_closing_one_inproc_engine_leaves_the_other_scoring(
    tiny: Any, vllm_engine: Any, heldout_sequences: list[list[int]]
) -> None:
    from logitcache.server.engine import build_engine

    seqs = heldout_sequences[:3]
    before = asyncio.run(vllm_engine.score(seqs, k=8))
    other = build_engine(
        model=str(tiny.teacher_dir),
        backend="vllm",
        max_k=ENGINE_MAX_K,
        dtype="float32",
        options={"vllm_mode": "inproc"},
    )
    theirs = asyncio.run(other.score(seqs, k=8))
    asyncio.run(other.aclose())
    after = asyncio.run(vllm_engine.score(seqs, k=8))
    for a, b, c in zip(before, after, theirs, strict=True):
        assert np.array_equal(a.topk_ids, b.topk_ids) and np.array_equal(a.topk_ids, c.topk_ids)
        assert np.array_equal(a.topk_logprobs, b.topk_logprobs)

"""Each row's logprob of the prompt's actual next token (FORMAT.md 4.12) from both backends, in
the pass that scores the rows (the transformers backend's chunked lm-head pass; vLLM's own
column 0 at ``T = 1`` and the worker hook's otherwise, with entropy, and beside chosen ids),
against a plain transformers forward of the full ``[L, V]`` block on the tiny teacher."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from engine_support import full_forward_logprobs
from logitcache.server.engine import build_engine

K = 8


@pytest.fixture(scope="module")
def chunked_engine(tiny: Any) -> Iterator[Any]:
    engine = build_engine(
        model=str(tiny.teacher_dir),
        backend="transformers",
        max_k=16,
        dtype="float32",
        options={"chunk_rows": 7, "batch_tokens": 64},  # several chunks and batches
    )
    yield engine
    asyncio.run(engine.aclose())


def _want(tiny: Any, ids: list[int], temperature: float) -> np.ndarray:
    lp = full_forward_logprobs(str(tiny.teacher_dir), ids, temperature=temperature)[:-1]
    return lp[np.arange(len(ids) - 1), ids[1:]]


def _check(tiny: Any, prompts: list[list[int]], rows: list[Any], t: float, atol: float) -> None:
    outside = 0
    for ids, r in zip(prompts, rows, strict=True):
        assert r.actual_logprob.dtype == np.float32 and r.actual_logprob.shape == (len(ids) - 1,)
        np.testing.assert_allclose(r.actual_logprob, _want(tiny, ids, t), atol=atol)
        outside += int((r.topk_ids != np.asarray(ids[1:])[:, None]).all(axis=1).sum())
    assert outside > 0  # tokens outside the top-k (what the top-k rows cannot give)


@pytest.mark.parametrize("backend", ["chunked_engine", "vllm_engine"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_topk_rows_carry_the_actual_tokens_logprob(
    backend: str, tiny: Any, temperature: float, request: pytest.FixtureRequest
) -> None:
    engine = request.getfixturevalue(backend)
    prompts = tiny.token_sequences("heldout", max_len=60, min_len=20, limit=3)
    rows = asyncio.run(engine.score(prompts, K, temperature))
    _check(tiny, prompts, rows, temperature, 2e-4 if backend == "chunked_engine" else 2e-3)


@pytest.mark.parametrize("backend", ["hf_engine", "vllm_engine"])
def test_rows_scored_beside_chosen_ids_and_with_entropy_carry_it(
    backend: str, tiny: Any, request: pytest.FixtureRequest
) -> None:
    engine = request.getfixturevalue(backend)
    prompts = tiny.token_sequences("heldout", max_len=40, min_len=20, limit=2)
    rows, _ = asyncio.run(engine.score_with_ids(prompts, K, [[3, 7]] * len(prompts), 0.7))
    _check(tiny, prompts, rows, 0.7, 2e-3)
    old = engine.cfg
    engine.cfg = replace(old, entropy=True)  # the hook's entropy column beside it (vLLM)
    try:
        rows = asyncio.run(engine.score(prompts, K, 1.0))
    finally:
        engine.cfg = old
    assert all(r.entropy is not None for r in rows)
    _check(tiny, prompts, rows, 1.0, 2e-3)

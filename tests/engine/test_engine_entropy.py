"""Per-row teacher entropy (FORMAT.md 4.9) from both backends (the transformers backend's
chunked lm-head pass, vLLM's worker hook) against a plain transformers forward of the full
``[L, V]`` block on the tiny teacher, at ``T = 1`` and another temperature, for top-k and sampled
rows; a bad setting is a typed error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from engine_support import assert_rows_close, full_forward_logprobs
from logitcache.server.engine import EngineConfigError, SampledTargets, build_engine

K = 8


@pytest.fixture(scope="module")
def entropy_engine(tiny: Any) -> Iterator[Any]:
    engine = build_engine(
        model=str(tiny.teacher_dir),
        backend="transformers",
        max_k=16,
        dtype="float32",
        entropy=True,
        options={"chunk_rows": 7},  # several chunks per prompt
    )
    yield engine
    asyncio.run(engine.aclose())


@pytest.fixture
def vllm_entropy(vllm_engine: Any) -> Iterator[Any]:
    """The suite's vLLM engine asking its worker hook for entropy (the flag is read per call)."""
    old = vllm_engine.cfg
    vllm_engine.cfg = replace(old, entropy=True)
    yield vllm_engine
    vllm_engine.cfg = old


def _reference(tiny: Any, ids: list[int], temperature: float) -> np.ndarray:
    lp = full_forward_logprobs(str(tiny.teacher_dir), ids, temperature=temperature)[:-1]
    lp = lp.astype(np.float64)
    return -(np.exp(lp) * lp).sum(axis=1)


def _assert_f16_close(got: np.ndarray, want: np.ndarray) -> None:
    """Within float16 resolution (what the store keeps): relative 2^-10, absolute 2^-12."""
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=2.0**-10, atol=2.0**-12)
    stored = got.astype(np.float16).astype(np.float64)
    np.testing.assert_allclose(stored, want, rtol=2.0**-10, atol=2.0**-12)


@pytest.mark.parametrize("backend", ["entropy_engine", "vllm_entropy"])
@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_topk_rows_carry_the_full_distributions_entropy(
    backend: str, hf_engine: Any, tiny: Any, temperature: float, request: pytest.FixtureRequest
) -> None:
    engine = request.getfixturevalue(backend)
    prompts = tiny.token_sequences("heldout", max_len=60, min_len=20, limit=3)
    got = asyncio.run(engine.score(prompts, K, temperature))
    plain = asyncio.run(hf_engine.score(prompts, K, temperature))
    spread = []
    for ids, rows, other in zip(prompts, got, plain, strict=True):
        want = _reference(tiny, ids, temperature)
        _assert_f16_close(rows.entropy, want)
        spread.append(want)
        assert other.entropy is None  # an engine built without it computes none
        assert_rows_close(rows, other, atol=2e-4)  # the same top-k rows (near-ties may swap)
    allv = np.concatenate(spread)
    assert allv.std() > 0.1  # the rows differ: a constant would not pass by luck


@pytest.mark.parametrize("backend", ["entropy_engine", "vllm_entropy"])
def test_sampled_rows_carry_it_too(backend: str, tiny: Any, request: pytest.FixtureRequest) -> None:
    engine = request.getfixturevalue(backend)
    prompts = tiny.token_sequences("heldout", max_len=50, min_len=20, limit=2)
    targets = SampledTargets(draws=6, seed=3, head=2)
    got = asyncio.run(engine.score_sampled(prompts, ["a", "b"], targets, 0.8))
    for ids, rows in zip(prompts, got, strict=True):
        _assert_f16_close(rows.entropy, _reference(tiny, ids, 0.8))


def test_a_bad_entropy_setting_is_refused(tiny: Any) -> None:
    with pytest.raises(EngineConfigError, match="entropy"):
        build_engine(model=str(tiny.teacher_dir), backend="transformers", entropy="yes")


@pytest.mark.parametrize("backend", ["entropy_engine", "vllm_entropy"])
def test_rows_scored_beside_chosen_ids_carry_it(
    backend: str, tiny: Any, request: pytest.FixtureRequest
) -> None:
    engine = request.getfixturevalue(backend)
    prompts = tiny.token_sequences("heldout", max_len=40, min_len=20, limit=2)
    rows, at_ids = asyncio.run(engine.score_with_ids(prompts, K, [[3, 5], [7]], 1.3))
    for ids, r, a in zip(prompts, rows, at_ids, strict=True):
        _assert_f16_close(r.entropy, _reference(tiny, ids, 1.3))
        assert a.shape[0] == len(ids) - 1

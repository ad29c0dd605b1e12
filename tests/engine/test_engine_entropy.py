"""Per-row teacher entropy (FORMAT.md 4.9) from the transformers backend's chunked lm-head pass,
against a plain transformers forward of the full ``[L, V]`` block on the tiny teacher, at
``T = 1`` and another temperature, for top-k and sampled rows; a bad setting is a typed error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from engine_support import full_forward_logprobs
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


@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_topk_rows_carry_the_full_distributions_entropy(
    entropy_engine: Any, hf_engine: Any, tiny: Any, temperature: float
) -> None:
    prompts = tiny.token_sequences("heldout", max_len=60, min_len=20, limit=3)
    got = asyncio.run(entropy_engine.score(prompts, K, temperature))
    plain = asyncio.run(hf_engine.score(prompts, K, temperature))
    spread = []
    for ids, rows, other in zip(prompts, got, plain, strict=True):
        want = _reference(tiny, ids, temperature)
        _assert_f16_close(rows.entropy, want)
        spread.append(want)
        assert other.entropy is None  # an engine built without it computes none
        np.testing.assert_array_equal(rows.topk_ids, other.topk_ids)  # same top-k rows
        np.testing.assert_allclose(rows.topk_logprobs, other.topk_logprobs, atol=2e-5)  # chunking
    allv = np.concatenate(spread)
    assert allv.std() > 0.1  # the rows differ: a constant would not pass by luck


def test_sampled_rows_carry_it_too(entropy_engine: Any, tiny: Any) -> None:
    prompts = tiny.token_sequences("heldout", max_len=50, min_len=20, limit=2)
    targets = SampledTargets(draws=6, seed=3, head=2)
    got = asyncio.run(entropy_engine.score_sampled(prompts, ["a", "b"], targets, 0.8))
    for ids, rows in zip(prompts, got, strict=True):
        _assert_f16_close(rows.entropy, _reference(tiny, ids, 0.8))


def test_a_bad_entropy_setting_is_refused(tiny: Any) -> None:
    with pytest.raises(EngineConfigError, match="entropy"):
        build_engine(model=str(tiny.teacher_dir), backend="transformers", entropy="yes")

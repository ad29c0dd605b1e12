"""The optional per-row arrays from both backends, in the pass that scores the rows: the teacher
entropy (FORMAT.md 4.9) and the logprob of the prompt's actual next token (4.12). Both are
checked against a plain transformers forward of the full ``[L, V]`` block on the tiny teacher:
from the transformers backend's chunked lm-head pass, and from vLLM (its own column 0 at
``T = 1``, the worker hook otherwise and for entropy), for top-k rows at several temperatures,
sampled rows, and rows scored beside chosen ids; a bad entropy setting is a typed error.
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


def _transformers(tiny: Any, **kw: Any) -> Iterator[Any]:
    engine = build_engine(
        model=str(tiny.teacher_dir), backend="transformers", max_k=16, dtype="float32", **kw
    )
    yield engine
    asyncio.run(engine.aclose())


@pytest.fixture(scope="module")
def chunked_engine(tiny: Any) -> Iterator[Any]:
    """Several chunks per prompt and several batches per call."""
    yield from _transformers(tiny, options={"chunk_rows": 7, "batch_tokens": 64})


@pytest.fixture(scope="module")
def entropy_engine(tiny: Any) -> Iterator[Any]:
    yield from _transformers(tiny, entropy=True, options={"chunk_rows": 7})


@pytest.fixture
def vllm_entropy(vllm_engine: Any) -> Iterator[Any]:
    """The suite's vLLM engine asking its worker hook for entropy (the flag is read per call)."""
    old = vllm_engine.cfg
    vllm_engine.cfg = replace(old, entropy=True)
    yield vllm_engine
    vllm_engine.cfg = old


def _reference(tiny: Any, ids: list[int], temperature: float) -> tuple[np.ndarray, np.ndarray]:
    """``(entropy, actual logprob)`` of every row of a plain forward (float64)."""
    lp = full_forward_logprobs(str(tiny.teacher_dir), ids, temperature=temperature)[:-1]
    lp = lp.astype(np.float64)
    return -(np.exp(lp) * lp).sum(axis=1), lp[np.arange(len(ids) - 1), ids[1:]]


def _assert_f16_close(got: np.ndarray, want: np.ndarray) -> None:
    """Within float16 resolution (what the store keeps): relative 2^-10, absolute 2^-12."""
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=2.0**-10, atol=2.0**-12)
    stored = got.astype(np.float16).astype(np.float64)
    np.testing.assert_allclose(stored, want, rtol=2.0**-10, atol=2.0**-12)


def _check(tiny: Any, prompts: list[list[int]], rows: list[Any], t: float, atol: float) -> None:
    """Every row's actual-token logprob (float32, also for tokens outside the top-k) and, when
    the engine computed it, its entropy, against the reference."""
    outside = 0
    for ids, r in zip(prompts, rows, strict=True):
        entropy, actual = _reference(tiny, ids, t)
        assert r.actual_logprob.dtype == np.float32 and r.actual_logprob.shape == (len(ids) - 1,)
        np.testing.assert_allclose(r.actual_logprob, actual, atol=atol)
        outside += int((r.topk_ids != np.asarray(ids[1:])[:, None]).all(axis=1).sum())
        if r.entropy is not None:
            _assert_f16_close(r.entropy, entropy)
    assert outside > 0  # tokens outside the top-k (what the top-k rows cannot give)


@pytest.mark.parametrize("backend", ["chunked_engine", "vllm_engine"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_topk_rows_carry_the_actual_tokens_logprob(
    backend: str, tiny: Any, temperature: float, request: pytest.FixtureRequest
) -> None:
    engine = request.getfixturevalue(backend)
    prompts = tiny.token_sequences("heldout", max_len=60, min_len=20, limit=3)
    rows = asyncio.run(engine.score(prompts, K, temperature))
    assert all(r.entropy is None for r in rows)  # an engine built without it computes none
    _check(tiny, prompts, rows, temperature, 2e-4 if backend == "chunked_engine" else 2e-3)


@pytest.mark.parametrize("backend", ["entropy_engine", "vllm_entropy"])
@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_topk_rows_carry_the_full_distributions_entropy(
    backend: str, hf_engine: Any, tiny: Any, temperature: float, request: pytest.FixtureRequest
) -> None:
    engine = request.getfixturevalue(backend)
    prompts = tiny.token_sequences("heldout", max_len=60, min_len=20, limit=3)
    got = asyncio.run(engine.score(prompts, K, temperature))
    plain = asyncio.run(hf_engine.score(prompts, K, temperature))
    assert all(r.entropy is not None for r in got)
    _check(tiny, prompts, got, temperature, 2e-3)  # the actual token's logprob beside it
    for rows, other in zip(got, plain, strict=True):
        assert other.entropy is None
        assert_rows_close(rows, other, atol=2e-4)  # the same top-k rows (near-ties may swap)
    spread = np.concatenate([r.entropy for r in got])
    assert spread.std() > 0.1  # the rows differ: a constant would not pass by luck


@pytest.mark.parametrize("backend", ["entropy_engine", "vllm_entropy"])
def test_sampled_rows_carry_the_entropy_too(
    backend: str, tiny: Any, request: pytest.FixtureRequest
) -> None:
    engine = request.getfixturevalue(backend)
    prompts = tiny.token_sequences("heldout", max_len=50, min_len=20, limit=2)
    targets = SampledTargets(draws=6, seed=3, head=2)
    got = asyncio.run(engine.score_sampled(prompts, ["a", "b"], targets, 0.8))
    for ids, rows in zip(prompts, got, strict=True):
        _assert_f16_close(rows.entropy, _reference(tiny, ids, 0.8)[0])


@pytest.mark.parametrize("backend", ["hf_engine", "vllm_engine", "entropy_engine", "vllm_entropy"])
def test_rows_scored_beside_chosen_ids_carry_them(
    backend: str, tiny: Any, request: pytest.FixtureRequest
) -> None:
    engine = request.getfixturevalue(backend)
    prompts = tiny.token_sequences("heldout", max_len=40, min_len=20, limit=2)
    rows, at_ids = asyncio.run(engine.score_with_ids(prompts, K, [[3, 5], [7]], 1.3))
    assert all((r.entropy is not None) == bool(engine.cfg.entropy) for r in rows)
    _check(tiny, prompts, rows, 1.3, 2e-3)
    for ids, a in zip(prompts, at_ids, strict=True):
        assert a.shape[0] == len(ids) - 1


def test_a_bad_entropy_setting_is_refused(tiny: Any) -> None:
    with pytest.raises(EngineConfigError, match="entropy"):
        build_engine(model=str(tiny.teacher_dir), backend="transformers", entropy="yes")

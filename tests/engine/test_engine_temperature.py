"""A call's temperature is applied exactly, per call, by both backends on the tiny teacher.

The reference is a plain transformers forward: ``log_softmax(logits / T)`` of the full ``[L, V]``
block (``engine_support.full_forward_logprobs``). vLLM 0.32 itself ignores the temperature for
prompt logprobs (``GPUModelRunner._get_prompt_logprobs_dict`` of 0.32 applies no sampling
parameter to prompt positions); the engine's worker hook (``vllm_sampling.py``) divides the final
logits instead, so its rows must match the reference, not the ``T = 1`` rows.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from engine_support import assert_rows_close, full_forward_logprobs
from logitcache.server.engine import EngineInputError, SampledTargets

K = 8
ATOL = 2e-4


def _reference(tiny: Any, ids: list[int], temperature: float) -> tuple[np.ndarray, np.ndarray]:
    full = full_forward_logprobs(str(tiny.teacher_dir), ids, temperature=temperature)[:-1]
    top = np.argsort(-full, axis=1, kind="stable")[:, :K]
    return top, np.take_along_axis(full, top, axis=1)


@pytest.mark.parametrize("backend", ["hf_engine", "vllm_engine"])
@pytest.mark.parametrize("temperature", [0.7, 2.0])
def test_a_calls_temperature_is_applied_exactly(
    backend: str, temperature: float, request: pytest.FixtureRequest, tiny: Any
) -> None:
    engine = request.getfixturevalue(backend)
    assert engine.info.temperature == 1.0  # the engine's own default stays 1
    prompts = tiny.token_sequences("heldout", max_len=120, min_len=40, limit=3)

    async def both() -> tuple[list[Any], list[Any]]:
        hot = engine.score(prompts, K, temperature)
        plain = engine.score(prompts, K)  # in flight together: each request keeps its own T
        return tuple(await asyncio.gather(hot, plain))  # type: ignore[return-value]

    got, plain = asyncio.run(both())
    for ids, sc, pl in zip(prompts, got, plain, strict=True):
        ref_ids, ref_lp = _reference(tiny, ids, temperature)
        assert_rows_close(sc, (ref_ids, ref_lp), atol=ATOL)
        np.testing.assert_allclose(
            sc.tail_mass, 1.0 - np.exp(ref_lp.astype(np.float64)).sum(1), atol=K * ATOL
        )
        # and it is not the T = 1 distribution
        base_ids, base_lp = _reference(tiny, ids, 1.0)
        assert_rows_close(pl, (base_ids, base_lp), atol=ATOL)
        assert np.abs(sc.topk_logprobs[:, 0] - pl.topk_logprobs[:, 0]).max() > 0.05


@pytest.mark.parametrize("backend", ["hf_engine", "vllm_engine"])
def test_sampled_rows_are_drawn_at_the_calls_temperature(
    backend: str, request: pytest.FixtureRequest, tiny: Any
) -> None:
    """Sampled rows at ``T = 2`` are the format's estimator on the reference's
    ``log_softmax(z / 2)`` with the sequence's uniforms (ids equal but at near-ties of the
    uniforms, weights close), not on the ``T = 1`` distribution."""
    import torch
    from logitcache.cache_format.sampling import sample_rows, uniforms

    engine = request.getfixturevalue(backend)
    prompts = tiny.token_sequences("heldout", max_len=80, min_len=40, limit=2)
    targets = SampledTargets(draws=16, head=4, seed=3)
    got = asyncio.run(engine.score_sampled(prompts, ["a", "b"], targets, 2.0))
    for ids, key, sc in zip(prompts, ["a", "b"], got, strict=True):
        u = uniforms(3, key, len(ids) - 1, 16)

        def ref(t: float, ids: list[int] = ids, u: Any = u) -> tuple[np.ndarray, np.ndarray]:
            full = full_forward_logprobs(str(tiny.teacher_dir), ids, temperature=t)[:-1]
            return sample_rows(torch.from_numpy(full), u, 1.0, k=20, head=4)

        want_ids, want_lw = ref(2.0)
        same = (sc.topk_ids == want_ids).all(axis=1)
        assert same.mean() >= 0.9, same.mean()
        np.testing.assert_allclose(sc.topk_logprobs[same], want_lw[same], atol=1e-3)
        cold_ids, _ = ref(1.0)
        assert (sc.topk_ids == cold_ids).all(axis=1).mean() < 0.5


@pytest.mark.parametrize("bad", [0.0, -1.0, 1e-4, 5e3, float("nan"), float("inf"), True])
def test_a_temperature_out_of_range_is_refused_before_any_work(bad: Any, hf_engine: Any) -> None:
    calls = hf_engine.timings.calls
    with pytest.raises(EngineInputError, match="temperature"):
        asyncio.run(hf_engine.score([[1, 2, 3]], K, bad))
    assert hf_engine.timings.calls == calls


@pytest.mark.parametrize("backend", ["hf_engine", "vllm_engine"])
def test_logprobs_at_chosen_ids_are_exact(
    backend: str, request: pytest.FixtureRequest, tiny: Any
) -> None:
    """``score_ids``: the logprobs of caller-chosen ids (here mostly outside the teacher's top-k,
    in no particular order), ``log_softmax(z / T)`` of a plain forward at those ids; the same
    from ``score_with_ids`` with the top-k rows of that call."""
    engine = request.getfixturevalue(backend)
    prompts = tiny.token_sequences("heldout", max_len=90, min_len=30, limit=2)
    rng = np.random.default_rng(5)
    chosen = [rng.choice(tiny.vocab_size, size=m, replace=False).tolist() for m in (7, 33)]
    for t in (1.0, 0.7):
        got = asyncio.run(engine.score_ids(prompts, chosen, t))
        rows, both = asyncio.run(engine.score_with_ids(prompts, K, chosen, t))  # one call
        for ids, c, lp, lp2, sc in zip(prompts, chosen, got, both, rows, strict=True):
            full = full_forward_logprobs(str(tiny.teacher_dir), ids, temperature=t)[:-1]
            assert lp.shape == (len(ids) - 1, len(c)) and lp.dtype == np.float32
            np.testing.assert_allclose(lp, full[:, c], atol=ATOL)
            np.testing.assert_allclose(lp2, full[:, c], atol=ATOL)
            want = np.take_along_axis(full, sc.topk_ids.astype(np.int64), axis=1)
            np.testing.assert_allclose(sc.topk_logprobs, want, atol=ATOL)
            assert (np.argsort(-full, axis=1)[:, 0] == sc.topk_ids[:, 0]).mean() > 0.95
    for bad in ([[1, 1], [2]], [[tiny.vocab_size], [2]], [[], [2]], [[1]]):
        with pytest.raises(EngineInputError, match="token ids"):
            asyncio.run(engine.score_ids(prompts, bad))

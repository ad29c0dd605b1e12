"""The transformers backend computes each row's tail mass where the rows are made (on the
device, next to the top-k) with the format's formula, and hands it over with the rows: the
job's writer then has no tail to compute."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import torch
from logitcache.cache_format.records import tail_from_logprobs
from logitcache.server.engine import make_scores
from logitcache.server.engine.hf import _tail


def _sorted_rows(rng: np.random.Generator, n: int, k: int, spread: float) -> np.ndarray:
    z = rng.normal(0.0, spread, (n, 4096))
    lp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return -np.sort(-lp, axis=1)[:, :k].astype(np.float32)


@pytest.mark.fast
@pytest.mark.parametrize("k", [1, 8, 100])
def test_the_device_tail_is_the_formats_tail(k: int) -> None:
    rng = np.random.default_rng(k)
    for spread in (0.5, 4.0, 30.0):  # near-uniform to one-hot rows: tails ~1 down to ~0
        lp = _sorted_rows(rng, 64, k, spread)
        got = _tail(torch.from_numpy(lp)).numpy()
        assert got.dtype == np.float32 and got.shape == (64,)
        np.testing.assert_allclose(got, tail_from_logprobs(lp), atol=2e-6, rtol=0)
    lp = np.array([[-0.1, -5.0] + [-np.inf] * (k - 2)] if k > 2 else [[-0.1] * k], np.float32)
    np.testing.assert_allclose(_tail(torch.from_numpy(lp)).numpy(), tail_from_logprobs(lp))


@pytest.mark.fast
def test_given_tail_is_kept_and_a_wrong_shape_refused() -> None:
    lp = _sorted_rows(np.random.default_rng(0), 5, 4, 2.0)
    ids = np.tile(np.arange(4, dtype=np.int32), (5, 1))
    tail = np.full(5, 0.25, np.float32)
    s = make_scores(ids, lp, tail)
    assert s.known_tail() is not None and np.array_equal(s.tail_mass, tail)
    assert make_scores(ids, lp).known_tail() is None  # computed at its first use
    with pytest.raises(ValueError, match="tail_mass"):
        make_scores(ids, lp, tail[:4])


def test_the_engines_rows_carry_their_tail(hf_engine: Any, tiny: Any) -> None:
    seqs = tiny.token_sequences("train", max_len=40, min_len=8, limit=5)
    scores = asyncio.run(hf_engine.score(seqs, 8))
    for s, ids in zip(scores, seqs, strict=True):
        tail = s.known_tail()
        assert tail is not None and tail.shape == (len(ids) - 1,)
        np.testing.assert_allclose(tail, tail_from_logprobs(s.topk_logprobs), atol=2e-6)

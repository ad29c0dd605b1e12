"""The float32 tail mass (records.tail_from_logprobs) against the float64 sum it replaced."""

from __future__ import annotations

import numpy as np
import pytest
from logitcache.cache_format.records import _tail_float64, tail_from_logprobs

EPS32 = float(np.finfo(np.float32).eps)


def _rows(rng: np.random.Generator, k: int, tails: np.ndarray) -> np.ndarray:
    """Sorted float32 logprob rows of ``k`` entries whose top-k mass is ``1 - tails``; the
    top-1 holds ``1 - r`` of it, ``r`` from 1e-12 (near-certain) to 1 (spread)."""
    n = tails.size
    r = 10.0 ** -rng.uniform(0, 12, n) if k > 1 else np.zeros(n)
    g = rng.gamma(0.3, size=(n, max(k - 1, 1))) + 1e-12
    rest = -np.sort(-g, axis=1) / g.sum(axis=1, keepdims=True) * r[:, None]
    p = np.concatenate([(1.0 - r)[:, None], rest[:, : k - 1]], axis=1) * (1.0 - tails)[:, None]
    return np.log(-np.sort(-p, axis=1)).astype(np.float32)


@pytest.mark.parametrize("k", [1, 2, 20, 100])
def test_tail_matches_the_float64_sum_within_float32_ulps(k: int) -> None:
    rng = np.random.default_rng(k)
    tails = np.concatenate([10.0 ** -rng.uniform(0, 12, 3000), rng.uniform(0, 1, 1000)])
    lp = _rows(rng, k, tails)
    got = tail_from_logprobs(lp)
    ref = _tail_float64(lp)
    assert got.dtype == np.float32 and got.shape == (tails.size,)
    # error: a few ulps of what rounding the input to float32 already moves the tail by
    # (sum_j p_j |lp_j| ulps, dominated by the top-1's |m|) plus a few ulps of the tail itself
    # (+ the float64 reference's own error, ~1e-16 absolute)
    lp64 = lp.astype(np.float64)
    m = np.abs(lp64[:, 0])
    moved = (np.exp(lp64) * np.abs(lp64)).sum(axis=1)
    err = np.abs(got.astype(np.float64) - ref)
    assert np.all(err <= 4 * EPS32 * (m + moved + ref) + 1e-15)
    # a near-certain top-1 (|m| < 1e-6) keeps tiny tails to ~1e-12 absolute, where
    # 1 - sum(exp(lp)) summed in float32 is off by up to ~6e-8
    sure = (m < 1e-6) & (ref > 1e-9)
    assert sure.sum() > 50
    assert err[sure].max() < 2e-12


def test_tail_edge_rows() -> None:
    lp = np.array(
        [
            [0.0, -np.inf, -np.inf],  # all mass on one token
            [-np.inf, -np.inf, -np.inf],  # no mass: tail 1
            [1e-4, -20.0, -30.0],  # slightly above 0 (within the writer's tolerance): clipped
            [-0.5, -1.0, -0.2],  # unsorted: the float64 sum
        ],
        dtype=np.float32,
    )
    got = tail_from_logprobs(lp)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got[:3], np.array([0.0, 1.0, 0.0], np.float32))
    assert got[3] == _tail_float64(lp[3:])[0] == 0.0
    assert np.isnan(tail_from_logprobs(np.array([[np.nan, -1.0]], np.float32))).all()
    # other dtypes and shapes keep the float64 path and its result
    lp64 = np.log(np.array([[0.5, 0.25]]))
    np.testing.assert_array_equal(tail_from_logprobs(lp64), np.float32([0.25]))
    assert tail_from_logprobs(np.zeros((3, 0), np.float32)).tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("k", [1, 2, 7, 8, 9, 16, 17, 20, 64, 100, 128, 129, 130, 200])
def test_the_compiled_tail_is_numpys_bit_for_bit(k: int, monkeypatch) -> None:
    """fastencode.tail_rows (issue #19: compiled differences and row sums around numpy's exp)
    gives numpy's formula's bits, for C-ordered rows and rows of a wider buffer (the vLLM
    hook's views), and tail_from_logprobs takes it once the kernels are loaded."""
    from logitcache.cache_format import fastencode
    from logitcache.cache_format.records import tail_numpy

    if not fastencode.ready() or fastencode._tail is None:
        pytest.skip("numba not available")
    rng = np.random.default_rng(100 + k)
    tails = np.concatenate([10.0 ** -rng.uniform(0, 12, 600), rng.uniform(0, 1, 200)])
    lp = _rows(rng, k, tails)
    lp[:5, 0] = 0.0  # a zero top-1, tiny and -inf tails
    lp[5, :] = -1e-30
    lp[6, 1:] = -np.inf
    lp[7, :] = -80.0 - np.arange(k, dtype=np.float32)  # sums of subnormal terms
    wide = np.full((lp.shape[0], k + 3), np.nan, np.float32)
    wide[:, 2 : k + 2] = lp
    calls = []
    real = fastencode.tail_rows
    monkeypatch.setattr(fastencode, "tail_rows", lambda a: calls.append(a.shape) or real(a))
    for a in (lp, wide[:, 2 : k + 2], lp[:1]):
        want = tail_numpy(a)
        assert real(a) is not None
        assert tail_from_logprobs(a).tobytes() == want.tobytes()
    assert len(calls) == 3
    bad = lp.copy()
    bad[3, 0] = -50.0  # unsorted: the float64 sum, as numpy's form does
    if k > 1:
        assert real(bad) is None
    assert tail_from_logprobs(bad).tobytes() == tail_numpy(bad).tobytes()

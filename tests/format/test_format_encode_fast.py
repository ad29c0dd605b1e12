"""The writer's float16 encoding (kernels.float_to_half) gives quant.encode_logprobs's bits."""

from __future__ import annotations

import numpy as np
import pytest
from logitcache.cache_format import _kernels as kernels
from logitcache.cache_format._encode import _float16_row_delta
from logitcache.cache_format.quant import encode_logprobs
from logitcache.cache_format.spec import TOPK_LOGPROBS


def _edge_values(rng: np.random.Generator, n: int) -> np.ndarray:
    x = rng.standard_normal(n) * rng.choice([1e-9, 6e-8, 1e-5, 1.0, 30.0, 7e4], n)
    x[:12] = [0.0, -0.0, 1e-4, -1e-8, -6e-8, -3e-8, -65504.0, -65519.0, -65520.0, -7e4, 2.0, -1.0]
    return x.astype(np.float32)


@pytest.mark.parametrize("backend", ["torch", "numpy"])
def test_float_to_half_is_numpys_cast_bit_for_bit(backend: str, monkeypatch, request) -> None:
    """Both casts: torch's once imported or after TORCH_AFTER_VALUES values, numpy's before."""
    if backend == "torch" and not kernels.TORCH:
        pytest.skip("torch is not installed")
    monkeypatch.setattr(kernels, "TORCH", backend == "torch")
    kernels.torch_module.cache_clear()
    request.addfinalizer(kernels.torch_module.cache_clear)
    monkeypatch.setattr(kernels, "_numpy_halves", kernels.TORCH_AFTER_VALUES)
    x = _edge_values(np.random.default_rng(0), 3 * kernels.HALF_BLOCK + 17)  # several blocks
    x[12:16] = [np.inf, -np.inf, np.nan, 65520.0]
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    got = kernels.float_to_half(x)
    assert got.dtype == np.float16 and got.shape == x.shape
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    ro = x.reshape(-1)[:100].copy()
    ro.flags.writeable = False
    np.testing.assert_array_equal(
        kernels.float_to_half(ro).view(np.uint16), want[:100].view(np.uint16)
    )
    assert (kernels.torch_module() is not None) == (backend == "torch")


@pytest.mark.parametrize("k", [1, 20, 100, 400])
def test_writer_float16_encoding_matches_quant(k: int) -> None:
    rng = np.random.default_rng(k)
    lp = -np.sort(np.abs(_edge_values(rng, 300 * k)).reshape(300, k), axis=1)
    lp[0, 0] = 1e-4  # above 0: clipped to +0 (as np.minimum does), not -0
    lp[1, 0] = -0.0
    got = _float16_row_delta(lp)
    want = encode_logprobs(lp, "float16")[TOPK_LOGPROBS]
    assert got.dtype == want.dtype == np.uint16
    np.testing.assert_array_equal(got, want)

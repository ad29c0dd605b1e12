"""The tail mass of top-k logprob rows in NumPy alone (FORMAT.md 4.1): the reference formulas the
compiled pass of :mod:`.fastencode` must match bit for bit."""

from __future__ import annotations

import numpy as np


def tail_numpy(lp: np.ndarray) -> np.ndarray:
    """:func:`.records.tail_from_logprobs` of a float32 array with ``k >= 1``, in numpy alone."""
    m = lp[..., 0]
    with np.errstate(invalid="ignore"):  # -inf - -inf: NaN, sent to the float64 sum below
        rest = lp[..., 1:] - m[..., None]
    if rest.size and not bool((rest <= 0).all()):  # unsorted rows, or NaN (refused later)
        return tail_float64(lp)
    np.exp(rest, out=rest)
    tail = -np.expm1(m + np.log1p(rest.sum(axis=-1, dtype=np.float32)))
    return np.clip(tail, 0.0, 1.0).astype(np.float32, copy=False)


def tail_float64(topk_logprobs: np.ndarray) -> np.ndarray:
    """``clip(1 - sum_k exp(logprob), 0, 1)`` per row, summed in float64, as float32."""
    s = np.exp(np.asarray(topk_logprobs, dtype=np.float64)).sum(axis=-1)
    return np.clip(1.0 - s, 0.0, 1.0).astype(np.float32)

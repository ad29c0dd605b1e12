"""Storage encodings of top-k logprobs (FORMAT.md section "Logprob encodings").

- ``float16`` (default) / ``float32``: the value, after clipping to ``[-65504, 0]``.
  float16 keeps a relative error <= 2**-11 (about 4.9e-4 relative; e.g. <= 0.0078 absolute at -16).
- ``uint8`` / ``uint16``: lossy, relative to the row max. With ``m = max_j lp_j`` (rank 0),
  ``step = (m - min_j lp_j) / Q`` (``Q = 255`` or ``65535``), ``q_j = round((m - lp_j) / step)``.
  Decoding is ``lp_j' = m - q_j * step`` in float32. Error bound: ``|lp_j - lp_j'| <= step / 2 =
  (m - min_j lp_j) / (2 Q)`` (+ float32 rounding), rank 0 is exact, order is preserved (ties can
  appear). ``m`` and ``step`` are stored per row in ``logprob_max`` / ``logprob_step`` (float32).
"""

from __future__ import annotations

import numpy as np

from .spec import LOGPROB_MAX, LOGPROB_STEP, QUANTISED_DTYPES, TOPK_LOGPROBS

_QMAX = {"uint8": 255, "uint16": 65535}
F16_MIN = -65504.0


def encode_logprobs(lp: np.ndarray, dtype: str) -> dict[str, np.ndarray]:
    """Encode validated float32 ``[n, k]`` logprobs into the arrays stored for ``dtype``."""
    lp = np.minimum(np.asarray(lp, dtype=np.float32), 0.0)
    if dtype == "float32":
        return {TOPK_LOGPROBS: lp}
    if dtype == "float16":
        return {TOPK_LOGPROBS: np.maximum(lp, F16_MIN).astype(np.float16)}
    if dtype in QUANTISED_DTYPES:
        qmax = _QMAX[dtype]
        mx = lp.max(axis=1)
        step = ((mx - lp.min(axis=1)) / np.float32(qmax)).astype(np.float32)
        safe = np.where(step > 0, step, np.float32(1.0))
        q = np.rint((mx[:, None] - lp) / safe[:, None])
        q = np.clip(q, 0, qmax).astype(dtype)
        return {TOPK_LOGPROBS: q, LOGPROB_MAX: mx.astype(np.float32), LOGPROB_STEP: step}
    raise ValueError(f"unknown logprob dtype {dtype!r}")


def decode_logprobs(
    stored: np.ndarray, dtype: str, mx: np.ndarray | None = None, step: np.ndarray | None = None
) -> np.ndarray:
    """Inverse of :func:`encode_logprobs`: float32 ``[n, k]`` logprobs."""
    if dtype in QUANTISED_DTYPES:
        if mx is None or step is None:
            raise ValueError("quantised logprobs need logprob_max and logprob_step")
        out = mx[:, None].astype(np.float32) - stored.astype(np.float32) * step[:, None]
        return out.astype(np.float32, copy=False)
    return np.asarray(stored, dtype=np.float32)


def error_bound(lp: np.ndarray, dtype: str) -> np.ndarray:
    """Per-row worst-case absolute error of encoding ``lp`` as ``dtype`` (documented bound)."""
    lp = np.asarray(lp, dtype=np.float64)
    if dtype == "float32":
        return np.zeros(lp.shape[0])
    if dtype == "float16":
        return np.abs(lp).max(axis=1) * 2.0**-11 + 2.0**-25
    qmax = _QMAX[dtype]
    return (lp.max(axis=1) - lp.min(axis=1)) / (2 * qmax) * (1 + 1e-6) + np.abs(lp).max(
        axis=1
    ) * 2e-7

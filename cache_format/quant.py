"""Storage encodings of top-k logprobs (FORMAT.md §4 "Logprob encodings"): ``float16`` (clipped to
``[-65504, 0]``, nearest-even), ``float32`` (exact), ``uint8`` / ``uint16`` (quantised relative to
the row max, with per-row ``logprob_max`` / ``logprob_step``), each followed by the lossless
row-delta transform of the values' unsigned bit patterns (decoded by a cumulative sum modulo
``2**bits``)."""

from __future__ import annotations

import numpy as np

from . import _kernels as kernels
from .spec import LOGPROB_MAX, LOGPROB_STEP, QUANTISED_DTYPES, TOPK_LOGPROBS

_QMAX = {"uint8": 255, "uint16": 65535}
F16_MIN = -65504.0
STORED_DTYPE = {"float16": "uint16", "float32": "uint32", "uint8": "uint8", "uint16": "uint16"}
"""zarr dtype of the ``topk_logprobs`` array for each logical ``logprob_dtype``."""


def row_delta(u: np.ndarray) -> np.ndarray:
    """``d[:, 0] = u[:, 0]``, ``d[:, j] = u[:, j] - u[:, j-1]`` (unsigned, wrapping)."""
    d = np.empty_like(u)
    d[:, :1] = u[:, :1]
    np.subtract(u[:, 1:], u[:, :-1], out=d[:, 1:])
    return d


def row_undelta(d: np.ndarray) -> np.ndarray:
    """Inverse of :func:`row_delta` (cumulative sum in the same unsigned dtype, wrapping)."""
    return kernels.row_undelta(np.asarray(d))


def encode_logprobs(lp: np.ndarray, dtype: str) -> dict[str, np.ndarray]:
    """Encode validated float32 ``[n, k]`` logprobs into the arrays stored for ``dtype``."""
    lp = np.minimum(np.asarray(lp, dtype=np.float32), 0.0)
    if dtype == "float32":
        return {TOPK_LOGPROBS: row_delta(lp.view(np.uint32))}
    if dtype == "float16":
        h = np.maximum(lp, F16_MIN).astype(np.float16)
        return {TOPK_LOGPROBS: row_delta(h.view(np.uint16))}
    if dtype in QUANTISED_DTYPES:
        qmax = _QMAX[dtype]
        mx = lp.max(axis=1)
        step = ((mx - lp.min(axis=1)) / np.float32(qmax)).astype(np.float32)
        safe = np.where(step > 0, step, np.float32(1.0))
        q = np.clip(np.rint((mx[:, None] - lp) / safe[:, None]), 0, qmax).astype(dtype)
        return {TOPK_LOGPROBS: row_delta(q), LOGPROB_MAX: mx.astype(np.float32), LOGPROB_STEP: step}
    raise ValueError(f"unknown logprob dtype {dtype!r}")


OUT_DTYPES = ("float32", "float16")
"""Dtypes :func:`decode_logprobs` can return."""


def decode_logprobs(
    stored: np.ndarray,
    dtype: str,
    mx: np.ndarray | None = None,
    step: np.ndarray | None = None,
    *,
    out_dtype: str = "float32",
    in_place: bool = False,
) -> np.ndarray:
    """Inverse of :func:`encode_logprobs`: ``[n, k]`` logprobs as ``out_dtype`` (``"float32"``:
    FORMAT.md D3; ``"float16"``: a float16 store's stored values themselves, other encodings' values
    clipped and rounded). ``in_place=True`` lets the row-delta inverse overwrite ``stored``."""
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype!r}")
    d = np.asarray(stored, dtype=STORED_DTYPE[dtype])
    u = kernels.row_undelta(d, out=d if in_place and d is stored else None)
    if dtype == "float16":
        h = u.view(np.float16)
        return h if out_dtype == "float16" else kernels.half_to_float(h)
    if dtype == "float32":
        out = u.view(np.float32)
    elif dtype in QUANTISED_DTYPES:
        if mx is None or step is None:
            raise ValueError("quantised logprobs need logprob_max and logprob_step")
        out = mx[:, None].astype(np.float32) - u.astype(np.float32) * step[:, None]
        out = out.astype(np.float32, copy=False)
    else:
        raise ValueError(f"unknown logprob dtype {dtype!r}")
    if out_dtype == "float16":  # clip to the finite float16 range first (FORMAT.md D3)
        return np.clip(out, F16_MIN, -F16_MIN).astype(np.float16)
    return out

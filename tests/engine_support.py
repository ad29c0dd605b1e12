"""Helpers for the engine tests: comparing top-k rows that may swap at near-ties."""

from __future__ import annotations

from typing import Any

import numpy as np


def assert_rows_close(a: Any, b: Any, *, atol: float, max_mismatch_rows: float = 0.02) -> int:
    """Assert that two ``TeacherScores`` (or ``(ids, logprobs)`` pairs) give the same top-k.

    * the sorted logprob values agree within ``atol`` everywhere (id swaps don't change them);
    * an id present in both rows has logprobs within ``atol`` in both;
    * an id present in only one row is a boundary near-tie: its logprob is within ``2 atol`` of
      that row's k-th value;
    * at most ``max_mismatch_rows`` of the rows differ in their id lists at all.

    Returns the number of rows whose id lists differ.
    """
    ids_a, lp_a = _pair(a)
    ids_b, lp_b = _pair(b)
    assert ids_a.shape == ids_b.shape == lp_a.shape == lp_b.shape, (ids_a.shape, ids_b.shape)
    np.testing.assert_allclose(lp_a, lp_b, atol=atol, rtol=0)
    differing = np.flatnonzero((ids_a != ids_b).any(axis=1))
    for r in differing:
        da = dict(zip(ids_a[r].tolist(), lp_a[r].tolist(), strict=True))
        db = dict(zip(ids_b[r].tolist(), lp_b[r].tolist(), strict=True))
        for t in da.keys() & db.keys():
            assert abs(da[t] - db[t]) <= atol, (r, t, da[t], db[t])
        for t in da.keys() ^ db.keys():
            lp, kth = (da[t], lp_a[r, -1]) if t in da else (db[t], lp_b[r, -1])
            assert abs(lp - kth) <= 2 * atol, f"row {r}: id {t} ({lp}) is no tie with {kth}"
    assert len(differing) <= max(1, max_mismatch_rows * len(ids_a)), len(differing)
    return int(len(differing))


def _pair(x: Any) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(x, tuple):
        return np.asarray(x[0]), np.asarray(x[1])
    return np.asarray(x.topk_ids), np.asarray(x.topk_logprobs)


def full_forward_logprobs(model_dir: str, ids: list[int], temperature: float = 1.0) -> np.ndarray:
    """``log_softmax(logits / T)`` of a plain transformers forward, ``[L, V]`` (tests only)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits / temperature, dim=-1).numpy()

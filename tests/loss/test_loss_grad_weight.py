"""``grad_weight_dtype``: grad_W accumulated in the weight's dtype (the memory floor) or fp32."""

from __future__ import annotations

import pytest
import torch
from logitcache.client.loss import LossInputError, TopKDistillLoss, topk_distill_loss
from logitcache.client.loss.dispatch import AUTO_LOWP_MAX_CHUNKS
from loss_support import make_problem, rel_err, run


def _grad_w(prob, rows: int = 16, **kw) -> torch.Tensor:
    return run(prob, chunk_size=rows, **kw)[1][1]


def test_bf16_accumulation_error_vs_float64():
    """The error grows with the number of chunks (one bf16 rounding of the running sum each)."""
    n_chunks = 32
    ref = make_problem(n=16 * n_chunks, d=16, vocab=128, k=8, seed=4)
    ref_w = run(ref, impl="dense")[1][1]
    prob = make_problem(n=16 * n_chunks, d=16, vocab=128, k=8, seed=4, dtype=torch.bfloat16)
    g32 = _grad_w(prob, grad_weight_dtype="float32")
    glp = _grad_w(prob, grad_weight_dtype="weight")
    assert g32.dtype == glp.dtype == torch.bfloat16
    e32, elp = rel_err(g32, ref_w), rel_err(glp, ref_w)
    assert e32 < 6e-3  # the bf16 input band
    assert e32 < elp < 3e-2  # bf16 accumulation adds error, bounded


@pytest.mark.parametrize("impl", ["fused_chunked", "fused_chunked_recompute"])
def test_auto_switches_on_the_number_of_chunks(impl):
    kw = dict(impl=impl, reduction="sum")
    for n_chunks, same_as in [
        (AUTO_LOWP_MAX_CHUNKS, "weight"),
        (AUTO_LOWP_MAX_CHUNKS + 1, "float32"),
    ]:
        prob = make_problem(n=16 * n_chunks, d=16, vocab=200, k=5, seed=5, dtype=torch.bfloat16)
        auto = _grad_w(prob, grad_weight_dtype="auto", **kw)
        want = _grad_w(prob, grad_weight_dtype=same_as, **kw)
        other = _grad_w(
            prob, grad_weight_dtype="float32" if same_as == "weight" else "weight", **kw
        )
        assert torch.equal(auto, want), n_chunks
        assert not torch.equal(auto, other), n_chunks  # the two really differ here


def test_float64_ignores_the_option():
    prob = make_problem(n=40, d=8, vocab=30, k=4)
    a = _grad_w(prob, grad_weight_dtype="weight")
    b = _grad_w(prob, grad_weight_dtype="float32")
    assert torch.equal(a, b) and a.dtype == torch.float64


def test_bad_option_rejected():
    prob = make_problem(n=4)
    with pytest.raises(LossInputError, match="grad_weight_dtype"):
        topk_distill_loss(
            prob.hidden, prob.weight, prob.ids, prob.logprobs, grad_weight_dtype="fp16"
        )
    with pytest.raises(LossInputError, match="grad_weight_dtype"):
        TopKDistillLoss(grad_weight_dtype="bf16")

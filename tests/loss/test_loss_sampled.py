"""Sampled targets (random-sampling KD, issue #12): every impl, float64 reference, gradcheck."""

from __future__ import annotations

import pytest
import torch
from logitcache.client.loss import LossInputError, topk_distill_loss
from loss_support import rel_err, sample_targets

IMPLS = ["dense", "forward_chunked", "fused_chunked", "fused_chunked_recompute", "small_vocab"]


def _problem(n=20, d=8, vocab=50, draws=12, m=14, tau=0.8, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, d, generator=g, dtype=torch.float64) / d**0.5 * 2
    p = torch.softmax(torch.randn(n, vocab, generator=g, dtype=torch.float64) * 2, -1)
    ids, logw = sample_targets(p, draws, m, tau, generator=g)
    leaf = lambda t: t.to(dtype).requires_grad_()  # noqa: E731
    return leaf(hidden), leaf(weight), ids, logw.float()


def _reference(hidden, weight, ids, logw, mask=None):
    """Independent float64 formula: mean_r sum_i w_i (log w_i - log_softmax(h W^T)_i)."""
    logq = torch.log_softmax(hidden.double() @ weight.double().t(), -1).gather(1, ids)
    lw = logw.double()
    w = lw.exp()
    rows = torch.where(w > 0, w * (lw - logq), torch.zeros((), dtype=torch.float64)).sum(-1)
    if mask is not None:
        rows = rows[mask]
    return rows.mean()


@pytest.mark.parametrize("impl", IMPLS)
def test_every_impl_matches_float64_reference(impl):
    hidden, weight, ids, logw = _problem()
    assert bool(torch.isinf(logw).any())  # the problem has -inf padding
    mask = torch.ones(hidden.shape[0], dtype=torch.bool)
    mask[3] = False
    h0, w0 = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    ref = _reference(h0, w0, ids, logw, mask)
    ref.backward()
    loss = topk_distill_loss(
        hidden, weight, ids, logw, targets="sampled", impl=impl, chunk_size=6, mask=mask
    )
    loss.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)  # logw is float32 (as cached)
    assert rel_err(hidden.grad, h0.grad) < 1e-6
    assert rel_err(weight.grad, w0.grad) < 1e-6


def test_grad_wrt_logits_is_q_minus_w():
    """With W = I the hidden rows are the logits: d(sum of row losses)/dz = q - w."""
    n, vocab = 6, 30
    _, _, ids, logw = _problem(n=n, vocab=vocab)
    z = torch.randn(n, vocab, dtype=torch.float64, requires_grad=True)
    eye = torch.eye(vocab, dtype=torch.float64)
    topk_distill_loss(z, eye, ids, logw, targets="sampled", reduction="sum").backward()
    w = torch.zeros(n, vocab, dtype=torch.float64).scatter_(1, ids, logw.double().exp())
    want = torch.softmax(z.detach(), -1) - w
    assert rel_err(z.grad, want) < 1e-6


@pytest.mark.parametrize("impl", ["forward_chunked", "fused_chunked_recompute"])
def test_gradcheck(impl):
    hidden, weight, ids, logw = _problem(n=5, d=3, vocab=9, draws=5, m=6)
    logw = logw.double()  # exact weights, so the function is smooth in float64

    def f(h, w):
        return topk_distill_loss(
            h, w, ids, logw, targets="sampled", impl=impl, chunk_size=2, reduction="none"
        )

    assert torch.autograd.gradcheck(f, (hidden, weight), eps=1e-6, atol=1e-7)


def test_unbiased_for_tau_one():
    """E[grad] over draws = q - p, the full-vocabulary KL gradient (tau = 1)."""
    reps, vocab = 3000, 12
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(1, vocab, generator=g, dtype=torch.float64) * 1.5, -1)
    ids, logw = sample_targets(p.expand(reps, vocab), draws=8, m=vocab, tau=1.0, generator=g)
    z0 = torch.randn(1, vocab, generator=g, dtype=torch.float64)
    z = z0.expand(reps, vocab).clone().requires_grad_()
    eye = torch.eye(vocab, dtype=torch.float64)
    topk_distill_loss(z, eye, ids, logw, targets="sampled").backward()  # mean over draws
    mean_grad = z.grad.sum(0)
    want = (torch.softmax(z0, -1) - p)[0]
    assert (mean_grad - want).abs().max() < 0.01, (mean_grad - want).abs().max()


def test_sampled_input_checks():
    hidden, weight, ids, logw = _problem(n=4, vocab=20, draws=4, m=5)
    with pytest.raises(LossInputError, match="sum to 1"):
        topk_distill_loss(hidden, weight, ids, logw - 0.1, targets="sampled")
    tail = torch.zeros(4)
    with pytest.raises(LossInputError, match="tail_mass=None"):
        topk_distill_loss(hidden, weight, ids, logw, tail, targets="sampled")
    with pytest.raises(LossInputError, match="forward_kl"):
        topk_distill_loss(hidden, weight, ids, logw, targets="sampled", loss="jsd")
    with pytest.raises(LossInputError, match="targets must be one of"):
        topk_distill_loss(hidden, weight, ids, logw, targets="dense")
    # a small storage error (float16 log-weights) is accepted and renormalised exactly
    a = topk_distill_loss(hidden, weight, ids, logw.half().float(), targets="sampled")
    b = topk_distill_loss(hidden, weight, ids, logw, targets="sampled")
    assert a.item() == pytest.approx(b.item(), rel=1e-2)


# The Triton kernels on sampled rows: under Triton's CPU interpreter in
# test_loss_inputs.py::test_triton_kernels_under_interpreter, on the H200 in
# python -m benchmarks.loss sweep --variants floor (benchmarks/results/loss.md).

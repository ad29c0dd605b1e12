"""The loss variants agree with the float64 dense reference; gradients pass gradcheck."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from logitcache.client.loss import topk_distill_loss
from loss_support import make_problem, rel_err, run

IMPLS = ["forward_chunked", "fused_chunked", "fused_chunked_recompute", "small_vocab"]
KINDS = ["forward_kl", "renormalized_kl", "reverse_kl", "jsd"]


@pytest.mark.parametrize(
    ("kind", "with_tail", "temperature", "ce_weight"),
    [
        (kind, tail, t, ce)
        for kind, tail, (t, ce) in itertools.product(
            KINDS, [False, True], [(1.0, 0.0), (2.0, 0.3), (1.0, 0.5)]
        )
    ],
)
def test_variants_agree_with_dense_float64(kind, with_tail, temperature, ce_weight):
    prob = make_problem(n=29, vocab=40, k=6)
    kw = dict(
        labels=prob.labels,
        mask=prob.mask,
        loss=kind,
        temperature=temperature,
        ce_weight=ce_weight,
        tail_mass=prob.tail if with_tail else None,
        chunk_size=8,
    )
    ref_loss, ref_grads = run(prob, impl="dense", **kw)
    assert math.isfinite(ref_loss.item()) and ref_grads[0].abs().sum() > 0
    for impl in IMPLS:
        loss, grads = run(prob, impl=impl, **kw)
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-10, abs=1e-12), impl
        for g, r in zip(grads, ref_grads, strict=True):
            assert rel_err(g, r) < 1e-10, impl


def test_forward_kl_matches_closed_form_and_is_mass_weighted():
    """Without tail: L = sum_S p (log p - log q), reduced as a mean over counted rows."""
    prob = make_problem(n=10, vocab=30, k=5)
    loss = topk_distill_loss(prob.hidden, prob.weight, prob.ids, prob.logprobs, bias=prob.bias)
    logq = torch.log_softmax(prob.hidden @ prob.weight.t() + prob.bias, -1).gather(1, prob.ids)
    p = prob.logprobs.double().exp()
    expected = (p * (prob.logprobs.double() - logq)).sum(-1).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)


def test_forward_kl_with_tail_is_kl_of_coarsened_distributions():
    prob = make_problem(n=8, vocab=30, k=5)
    kw = dict(bias=prob.bias, reduction="none")
    rows = topk_distill_loss(
        prob.hidden, prob.weight, prob.ids, prob.logprobs, prob.tail, **kw
    ).detach()
    q = torch.softmax(prob.hidden @ prob.weight.t() + prob.bias, -1).detach()
    q_s = q.gather(1, prob.ids)
    teacher = torch.cat([prob.logprobs.double().exp(), prob.tail.double()[:, None]], 1)
    student = torch.cat([q_s, (1 - q_s.sum(-1, keepdim=True))], 1)
    expected = (teacher * (teacher.log() - student.log())).sum(-1)
    assert rel_err(rows, expected) < 1e-10
    assert (rows >= -1e-12).all()  # a true KL of distributions is non-negative


def test_reductions_and_leading_shape():
    prob = make_problem(n=12, lead=(3, 4))
    common = dict(labels=prob.labels, mask=prob.mask, bias=prob.bias)
    rows = topk_distill_loss(
        prob.hidden, prob.weight, prob.ids, prob.logprobs, reduction="none", **common
    )
    assert rows.shape == (3, 4)
    counted = prob.mask & (prob.labels != -100)
    assert (rows[~counted] == 0).all()
    total = topk_distill_loss(
        prob.hidden, prob.weight, prob.ids, prob.logprobs, reduction="sum", **common
    )
    mean = topk_distill_loss(prob.hidden, prob.weight, prob.ids, prob.logprobs, **common)
    assert total.item() == pytest.approx(rows.sum().item(), rel=1e-12)
    assert mean.item() == pytest.approx(total.item() / counted.sum().item(), rel=1e-12)


def test_masked_and_ignored_rows_get_no_gradient():
    prob = make_problem(n=12)
    _, (gh, _, _) = run(prob, labels=prob.labels, mask=prob.mask)
    assert (gh[1] == 0).all() and (gh[2] == 0).all() and gh[0].abs().sum() > 0


def test_all_rows_masked_gives_zero_loss_and_zero_grads():
    prob = make_problem(n=6)
    for impl in ["dense", *IMPLS]:
        loss, grads = run(prob, impl=impl, mask=torch.zeros(6, dtype=torch.bool))
        assert loss.item() == 0.0, impl
        assert all((g == 0).all() for g in grads), impl


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("impl", ["forward_chunked", "fused_chunked_recompute"])
def test_gradcheck_custom_functions(kind, impl):
    prob = make_problem(n=5, d=3, vocab=7, k=3)
    h, w, b = (t.detach().requires_grad_() for t in prob.leaves())

    def f(h, w, b):
        return topk_distill_loss(
            h,
            w,
            prob.ids,
            prob.logprobs,
            prob.tail,
            bias=b,
            labels=prob.labels,
            loss=kind,
            temperature=1.5,
            ce_weight=0.2,
            impl=impl,
            chunk_size=2,
            reduction="none",
        )

    assert torch.autograd.gradcheck(f, (h, w, b), eps=1e-6, atol=1e-7, fast_mode=True)


def test_gradient_in_forward_allows_one_backward_only():
    prob = make_problem(n=6)
    loss = topk_distill_loss(
        prob.hidden, prob.weight, prob.ids, prob.logprobs, impl="fused_chunked"
    )
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward"):
        loss.backward()


def test_no_grad_forward_computes_the_same_loss():
    prob = make_problem(n=9)
    with_grad = topk_distill_loss(prob.hidden, prob.weight, prob.ids, prob.logprobs)
    with torch.no_grad():
        without = topk_distill_loss(prob.hidden, prob.weight, prob.ids, prob.logprobs)
    assert without.item() == pytest.approx(with_grad.item(), rel=1e-12)


@pytest.mark.parametrize("k", [1, 40])
@pytest.mark.parametrize("kind", KINDS)
def test_k_edge_cases(k, kind):
    """k=1 and k=V (the whole vocabulary is the support: no outside mass)."""
    prob = make_problem(n=9, vocab=40, k=k)
    tail = torch.zeros_like(prob.tail) if k == 40 else prob.tail
    ref, ref_g = run(prob, impl="dense", loss=kind, tail_mass=tail)
    for impl in IMPLS:
        loss, grads = run(prob, impl=impl, loss=kind, tail_mass=tail, chunk_size=4)
        assert math.isfinite(loss.item())
        assert loss.item() == pytest.approx(ref.item(), rel=1e-9, abs=1e-12), impl
        for g, r in zip(grads, ref_g, strict=True):
            assert torch.isfinite(g).all()
            assert rel_err(g, r) < 1e-8, impl


def test_k_equals_v_forward_kl_equals_full_kl():
    """At k=V with a renormalised teacher, forward KL is the ordinary full-vocabulary KL."""
    prob = make_problem(n=7, vocab=20, k=20)
    lp = torch.log_softmax(prob.logprobs.double(), -1)
    loss = topk_distill_loss(prob.hidden, prob.weight, prob.ids, lp, bias=prob.bias)
    logits = prob.hidden @ prob.weight.t() + prob.bias
    teacher = torch.zeros_like(logits).scatter(1, prob.ids, lp)
    expected = torch.nn.functional.kl_div(
        torch.log_softmax(logits, -1), teacher, log_target=True, reduction="batchmean"
    )
    assert loss.item() == pytest.approx(expected.item(), rel=1e-10)


@pytest.mark.parametrize("kind", KINDS)
def test_extreme_logits_stay_finite(kind):
    prob = make_problem(n=8, vocab=30, k=5, logit_scale=400.0, dtype=torch.float32)
    for impl in ["fused_chunked", "forward_chunked", "fused_chunked_recompute"]:
        loss, grads = run(
            prob, impl=impl, loss=kind, tail_mass=prob.tail, labels=prob.labels, ce_weight=0.1
        )
        assert math.isfinite(loss.item()), impl
        assert all(torch.isfinite(g).all() for g in grads), impl


@pytest.mark.parametrize(
    ("dtype", "loss_tol", "grad_tol"), [(torch.float32, 1e-5, 1e-4), (torch.bfloat16, 1e-2, 3e-2)]
)
def test_low_precision_relative_error(dtype, loss_tol, grad_tol):
    ref_prob = make_problem(n=64, d=32, vocab=300, k=20, seed=3)
    ref, ref_g = run(
        ref_prob, impl="dense", tail_mass=ref_prob.tail, labels=ref_prob.labels, ce_weight=0.1
    )
    prob = make_problem(n=64, d=32, vocab=300, k=20, seed=3, dtype=dtype)
    for impl in IMPLS:
        loss, grads = run(
            prob, impl=impl, tail_mass=prob.tail, labels=prob.labels, ce_weight=0.1, chunk_size=16
        )
        assert rel_err(loss, ref) < loss_tol, impl
        for g, r in zip(grads, ref_g, strict=True):
            assert g.dtype == dtype
            assert rel_err(g, r) < grad_tol, impl


def test_module_face_matches_function():
    from logitcache.client.loss import TopKDistillLoss

    prob = make_problem(n=10)
    mod = TopKDistillLoss("jsd", beta=0.3, temperature=2.0, impl="fused_chunked")
    a = mod(prob.hidden, prob.weight, prob.ids, prob.logprobs, prob.tail, bias=prob.bias)
    b = topk_distill_loss(
        prob.hidden,
        prob.weight,
        prob.ids,
        prob.logprobs,
        prob.tail,
        bias=prob.bias,
        loss="jsd",
        beta=0.3,
        temperature=2.0,
        impl="dense",
    )
    assert a.item() == pytest.approx(b.item(), rel=1e-10)
    assert "jsd" in repr(mod)


def test_autocast_runs_the_projection_in_the_autocast_dtype():
    prob = make_problem(n=12, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, ref_g = run(prob, impl="dense")
        for impl in IMPLS:
            loss, grads = run(prob, impl=impl, chunk_size=4)
            assert all(g.dtype == torch.float32 for g in grads), impl
            assert rel_err(loss, ref) < 1e-3, impl  # bf16 logits: bias rounding differs
            assert all(rel_err(g, r) < 2e-2 for g, r in zip(grads, ref_g, strict=True)), impl

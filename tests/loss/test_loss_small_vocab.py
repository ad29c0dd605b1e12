"""``impl="small_vocab"`` (full logits, one exponential pass) and ``impl="auto"``'s choice of it.

Every target kind (top-k, top-k + tail, sampled, head + residual sampled) and option (loss,
temperature, CE, mask, ignore index, reduction, bias) against the float64 dense reference
(``impl="dense"``, reference.py), torch's numerical gradcheck, and the dispatch rule.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from logitcache.client.loss import LossInputError, TopKDistillLoss, topk_distill_loss
from logitcache.client.loss import api as loss_api
from logitcache.client.loss.dispatch import (
    SMALL_VOCAB_MAX_ELEMENTS,
    SMALL_VOCAB_MAX_VOCAB,
    picks_small_vocab,
    resolve_impl,
)
from loss_support import make_problem, rel_err, run, sample_targets

CPU = torch.device("cpu")


def _sampled(prob, draws: int = 10, m: int = 9, head: int = 0, seed: int = 0) -> None:
    """Replace the problem's targets by sampled rows (``head`` > 0: the teacher's top-``head``
    kept exactly, the draws spent on the rest, as ``sampling.head`` caches store them)."""
    from logitcache.cache_format.sampling import sample_rows, seeded_uniforms

    g = torch.Generator().manual_seed(seed)
    n, vocab = prob.ids.shape[0], prob.weight.shape[0]
    p = torch.softmax(torch.randn(n, vocab, generator=g, dtype=torch.float64) * 2, -1)
    if head:
        u = seeded_uniforms(seed, n, draws)
        ids, lw = sample_rows(p.log().float(), u, 1.0, head=head)
        prob.ids, prob.logprobs = torch.from_numpy(ids).long(), torch.from_numpy(lw)
        assert bool((prob.logprobs < -1e4).any())  # padding columns (PAD_LOGPROB)
        # the teacher's top-``head`` ids are in every row with their own probability
        top = p.topk(head, dim=1).indices
        hit = prob.ids[:, None, :] == top[:, :, None]  # [n, head, k]
        assert bool(hit.any(-1).all())
        w_top = (prob.logprobs.double().exp()[:, None, :] * hit).sum(-1)
        assert torch.allclose(w_top, p.gather(1, top), rtol=1e-5)
    else:
        ids, logw = sample_targets(p, draws, m, 0.8, generator=g)
        prob.ids, prob.logprobs = ids, logw.float()


KINDS = ["topk", "topk_tail", "sampled", "sampled_head"]
OPTIONS = [
    dict(),
    dict(loss="renormalized_kl"),
    dict(loss="reverse_kl"),
    dict(loss="jsd", beta=0.3),
    dict(temperature=2.0, ce_weight=0.3),  # a separate CE softmax
    dict(ce_weight=0.5, reduction="sum"),
    dict(temperature=0.7, reduction="none"),
]


def _case(kind: str, opts: dict, seed: int = 0):
    prob = make_problem(n=24, d=8, vocab=40, k=6, seed=seed)
    kw = dict(opts, labels=prob.labels, mask=prob.mask)  # row 1 ignored, row 2 masked
    if kind == "topk_tail":
        kw["tail_mass"] = prob.tail
    if kind.startswith("sampled"):
        if kw.get("loss", "forward_kl") != "forward_kl":
            return None, None  # sampled rows take the forward KL only
        _sampled(prob, head=3 if kind == "sampled_head" else 0, seed=seed)
        kw["targets"] = "sampled"
    return prob, kw


@pytest.mark.parametrize("kind", KINDS)
def test_matches_float64_reference_for_every_kind_and_option(kind):
    checked = 0
    for i, opts in enumerate(OPTIONS):
        prob, kw = _case(kind, opts, seed=i)
        if prob is None:
            continue
        ref, ref_g = run(prob, impl="dense", **kw)
        got, got_g = run(prob, impl="small_vocab", **kw)
        assert got.shape == ref.shape, opts
        assert rel_err(got, ref) < 1e-12, (kind, opts)
        for a, b in zip(got_g, ref_g, strict=True):
            assert rel_err(a, b) < 1e-12, (kind, opts)
        checked += 1
    assert checked >= (2 if kind.startswith("sampled") else len(OPTIONS))


@pytest.mark.parametrize(
    "kind,opts",
    [
        ("topk", dict()),
        ("topk_tail", dict(loss="jsd")),
        ("topk_tail", dict(temperature=1.7, ce_weight=0.4)),
        ("topk", dict(loss="reverse_kl")),
        ("sampled", dict()),
        ("sampled_head", dict()),
    ],
)
def test_gradcheck(kind, opts):
    prob = make_problem(n=6, d=3, vocab=11, k=4, seed=3)
    kw = dict(opts, labels=prob.labels, mask=prob.mask)
    if kind == "topk_tail":
        kw["tail_mass"] = prob.tail.double()
    if kind.startswith("sampled"):
        _sampled(prob, draws=6, m=6, head=2 if kind == "sampled_head" else 0)
        kw["targets"] = "sampled"
    lp = prob.logprobs.double()

    def f(h, w, b):
        return topk_distill_loss(h, w, prob.ids, lp, bias=b, impl="small_vocab", **kw)

    assert torch.autograd.gradcheck(f, prob.leaves(), eps=1e-6, atol=1e-7)


def test_underflowed_outside_mass_as_the_chunked_impls():
    """A float32 row whose every logit outside the ids is ~200 below them: ``exp`` underflows
    to 0 there, so ``log Q_o = -inf`` and the floor applies, as in the chunked impls (whose
    ``logsumexp`` of an all ``-inf`` row is ``-inf`` too); the loss and gradient stay finite.
    With W = I the hidden rows are the logits."""
    vocab, k = 12, 4
    g = torch.Generator().manual_seed(0)
    z = torch.randn(3, vocab, generator=g)
    ids = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(3)])
    z[0] = -200.0
    z[0, ids[0]] = torch.randn(k, generator=g)
    lp = torch.log_softmax(torch.randn(3, k, generator=g), -1) + np.log(0.9)
    tail = torch.full((3,), 0.1)
    eye = torch.eye(vocab)
    out = {}
    for impl in ("forward_chunked", "fused_chunked", "small_vocab"):
        zz = z.clone().requires_grad_()
        loss = topk_distill_loss(zz, eye, ids, lp, tail, impl=impl, reduction="none")
        loss.sum().backward()
        out[impl] = (loss.detach(), zz.grad)
    loss, grad = out["small_vocab"]
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
    for impl in ("forward_chunked", "fused_chunked"):
        assert rel_err(loss, out[impl][0]) < 1e-6, impl
        assert rel_err(grad, out[impl][1]) < 1e-6, impl


def test_float32_and_bf16_inputs_near_float64():
    ref = make_problem(n=64, d=16, vocab=96, k=8, seed=7)
    ref_loss, ref_g = run(ref, impl="dense", tail_mass=ref.tail)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        prob = make_problem(n=64, d=16, vocab=96, k=8, seed=7, dtype=dtype)
        loss, grads = run(prob, impl="small_vocab", tail_mass=prob.tail)
        assert all(g.dtype == dtype for g in grads)
        assert rel_err(loss, ref_loss) < tol, dtype
        assert all(rel_err(a, b) < tol * 2 for a, b in zip(grads, ref_g, strict=True)), dtype


def test_only_counted_rows_and_no_counted_rows():
    prob = make_problem(n=10, d=4, vocab=16, k=3)
    prob.ids[2, 1] = prob.ids[2, 0]  # a repeated id in the masked row is not an error
    prob.logprobs[2] = float("nan")
    loss, grads = run(prob, impl="small_vocab", mask=prob.mask, reduction="none")
    assert loss[2] == 0 and torch.isfinite(loss).all()
    mask = torch.zeros(10, dtype=torch.bool)
    loss, grads = run(prob, impl="small_vocab", mask=mask)
    assert loss.item() == 0 and all(float(g.abs().sum()) == 0 for g in grads)


def test_duplicate_and_out_of_range_ids_rejected():
    prob = make_problem(n=8, d=4, vocab=16, k=3)
    dup = prob.ids.clone()
    dup[4, 2] = dup[4, 0]
    with pytest.raises(LossInputError, match="duplicate"):
        topk_distill_loss(prob.hidden, prob.weight, dup, prob.logprobs, impl="small_vocab")
    # check_ids=False skips the check (as for the other impls)
    topk_distill_loss(
        prob.hidden, prob.weight, dup, prob.logprobs, impl="small_vocab", check_ids=False
    )
    bad = prob.ids.clone()
    bad[0, 0] = 16
    with pytest.raises(LossInputError, match="out of range"):
        topk_distill_loss(prob.hidden, prob.weight, bad, prob.logprobs, impl="small_vocab")


def test_second_backward_with_retained_graph():
    prob = make_problem(n=12, d=4, vocab=20, k=4)
    out = topk_distill_loss(
        prob.hidden, prob.weight, prob.ids, prob.logprobs, prob.tail, impl="small_vocab"
    )
    out.backward(retain_graph=True)
    first = prob.hidden.grad.clone()
    prob.hidden.grad = None
    out.backward()
    assert torch.equal(prob.hidden.grad, first)


def test_auto_rule():
    assert SMALL_VOCAB_MAX_VOCAB == 4096
    n_max = SMALL_VOCAB_MAX_ELEMENTS // 1024
    assert picks_small_vocab(512, 1024, CPU, None, False)  # the tiny distill step
    assert picks_small_vocab(n_max, 1024, CPU, None, False)
    assert not picks_small_vocab(n_max + 1, 1024, CPU, None, False)
    assert not picks_small_vocab(512, 128256, CPU, None, False)  # a real vocabulary
    assert not picks_small_vocab(16, 8192, CPU, None, False)  # no faster from V = 8K on
    assert picks_small_vocab(1024, 4096, CPU, None, False)
    assert not picks_small_vocab(512, 1024, torch.device("cuda"), None, False)
    assert not picks_small_vocab(512, 1024, CPU, 256, False)  # chunks asked for
    assert not picks_small_vocab(512, 1024, CPU, None, True)  # vocab-parallel
    kw = dict(vocab=1024, device=CPU)
    assert resolve_impl("auto", "mean", n_rows=512, **kw) == "small_vocab"
    assert resolve_impl("auto", "none", n_rows=512, **kw) == "small_vocab"
    assert resolve_impl("auto", "none", n_rows=n_max + 1, **kw) == "fused_chunked_recompute"
    assert resolve_impl("auto", "mean", n_rows=n_max + 1, **kw) == "fused_chunked"
    assert resolve_impl("auto", "mean") == "fused_chunked"  # no sizes: the fused default
    assert resolve_impl("fused_chunked", "mean", n_rows=512, **kw) == "fused_chunked"


def test_auto_runs_small_vocab_on_a_small_cpu_problem(monkeypatch):
    calls = []
    real = loss_api.small_vocab_rows
    monkeypatch.setattr(
        loss_api, "small_vocab_rows", lambda *a: calls.append(a[1].hidden.shape) or real(*a)
    )
    prob = make_problem(n=16, d=4, vocab=32, k=4)
    ref, ref_g = run(prob, impl="dense", tail_mass=prob.tail)
    got, got_g = run(prob, tail_mass=prob.tail)  # impl="auto"
    assert calls == [(16, 4)]
    assert rel_err(got, ref) < 1e-12 and rel_err(got_g[1], ref_g[1]) < 1e-12
    TopKDistillLoss()(prob.hidden, prob.weight, prob.ids, prob.logprobs)  # the module too
    assert len(calls) == 2
    run(prob, tail_mass=prob.tail, chunk_size=8)  # chunks asked for: the fused path
    assert len(calls) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exp_and_logsumexp_flush_only_below_e_tiny(dtype):
    """``row_math.exp_ftz`` / ``logsumexp_ftz`` (sampled rows' padding off torch's slow exp
    path): bit-equal to ``exp`` / ``logsumexp`` except results below ``e * tiny``, exactly 0."""
    from logitcache.client.loss.row_math import exp_ftz, logsumexp_ftz

    lo = float(np.log(torch.finfo(dtype).tiny)) + 1.0
    t = torch.tensor([0.0, -3.5, -80.0, lo, lo - 0.5, -200.0, -65504.0, float("-inf")], dtype=dtype)
    want = torch.where(t >= lo, t.exp(), torch.zeros((), dtype=dtype))
    assert torch.equal(exp_ftz(t), want)
    assert exp_ftz(t)[4] == 0 and t.exp()[4] > 0  # the flushed sliver
    rows = torch.log_softmax(torch.randn(6, 9, dtype=dtype), -1)
    rows[:, 5:] = -65504.0
    rows[1, 3:] = float("-inf")
    torch.testing.assert_close(logsumexp_ftz(rows), torch.logsumexp(rows, -1), rtol=0, atol=1e-6)
    assert logsumexp_ftz(rows, keepdim=True).shape == (6, 1)
    neg_inf = torch.full((2, 3), float("-inf"), dtype=dtype)
    assert torch.equal(logsumexp_ftz(neg_inf), torch.logsumexp(neg_inf, -1))

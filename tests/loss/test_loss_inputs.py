"""Bad input is rejected with a clear LossInputError; padded rows may hold garbage."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from logitcache.client.loss import LossInputError, TopKDistillLoss, topk_distill_loss
from loss_support import make_problem, run


def call(prob, **kw):
    args = dict(
        hidden=prob.hidden, weight=prob.weight, topk_ids=prob.ids, topk_logprobs=prob.logprobs
    )
    args.update(kw)
    return topk_distill_loss(**args)


@pytest.mark.parametrize("impl", ["dense", "forward_chunked", "fused_chunked"])
def test_duplicate_ids_rejected(impl):
    prob = make_problem(n=6, k=4)
    ids = prob.ids.clone()
    ids[3, 2] = ids[3, 0]
    with pytest.raises(LossInputError, match="duplicate"):
        call(prob, topk_ids=ids, impl=impl)


@pytest.mark.parametrize("bad", [-1, 40, 10_000])
def test_out_of_range_ids_rejected(bad):
    prob = make_problem(n=6, vocab=40)
    ids = prob.ids.clone()
    ids[4, 1] = bad
    with pytest.raises(LossInputError, match="out of range"):
        call(prob, topk_ids=ids)


def test_garbage_in_rows_that_do_not_count_is_accepted():
    """Padded rows (masked, or ignore_index labels) may repeat ids or hold NaN logprobs."""
    prob = make_problem(n=6)
    ids, lp, labels = prob.ids.clone(), prob.logprobs.clone(), prob.labels.clone()
    ids[2] = 0  # row 2 is masked
    lp[2] = float("nan")
    ids[1] = -7  # row 1 has an ignored label
    ref = call(prob, mask=prob.mask, labels=labels, impl="dense")
    for impl in ["dense", "forward_chunked", "fused_chunked"]:
        out = call(prob, topk_ids=ids, topk_logprobs=lp, mask=prob.mask, labels=labels, impl=impl)
        assert out.item() == pytest.approx(ref.item(), rel=1e-10)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(loss="kl"), "loss must be one of"),
        (dict(loss="jsd", beta=1.0), "beta"),
        (dict(temperature=0.0), "temperature"),
        (dict(ce_weight=-1.0), "ce_weight must be"),
        (dict(ce_weight=0.5), "needs labels"),
        (dict(reduction="avg"), "reduction"),
        (dict(impl="cuda"), "impl"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(kernels="cuda"), "kernels must be"),
    ],
)
def test_bad_options(kw, match):
    prob = make_problem(n=4)
    with pytest.raises(LossInputError, match=match):
        call(prob, **kw)


def test_bad_shapes_and_dtypes():
    prob = make_problem(n=6, vocab=40, k=5)
    cases = [
        (dict(weight=prob.weight[:, :3]), "weight must be"),
        (dict(weight=prob.weight.float()), "dtype"),
        (dict(topk_ids=prob.ids.float()), "integer"),
        (dict(topk_ids=prob.ids[:, :3]), "topk_logprobs must have shape"),
        (dict(topk_logprobs=prob.logprobs[:4]), "topk_logprobs must have shape"),
        (dict(tail_mass=prob.tail[:2]), "tail_mass must have shape"),
        (dict(tail_mass=prob.tail + 2), r"tail_mass must be in \[0, 1\]"),
        (dict(topk_logprobs=prob.logprobs + 1.0), "log-probabilities"),
        (dict(labels=torch.full((6,), 99)), "labels out of range"),
        (dict(bias=torch.zeros(3, dtype=prob.hidden.dtype)), "bias must have shape"),
        (dict(hidden=prob.hidden[0]), "at least 2 dims"),
    ]
    for kw, match in cases:
        with pytest.raises(LossInputError, match=match):
            call(prob, **kw)


def test_module_checks_options_at_construction():
    with pytest.raises(LossInputError):
        TopKDistillLoss("forward_kl", reduction="bogus")
    with pytest.raises(LossInputError):
        TopKDistillLoss("jsd", beta=0.0)
    with pytest.raises(LossInputError, match="kernels"):
        TopKDistillLoss("forward_kl", kernels="fast")


def test_kernels_torch_and_auto_agree_on_cpu():
    """``kernels="torch"`` and ``"auto"`` run the same torch passes on the CPU (Triton is used
    by "auto" on CUDA only); ``"triton"`` without Triton installed is a typed error."""
    from logitcache.client.loss import TRITON_AVAILABLE

    prob = make_problem(n=10, d=8, vocab=50, k=4, dtype=torch.float32)
    a, ga = run(prob, impl="fused_chunked", kernels="auto", chunk_size=4)
    b, gb = run(prob, impl="fused_chunked", kernels="torch", chunk_size=4)
    assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(ga, gb, strict=True))
    if not TRITON_AVAILABLE:
        with pytest.raises(LossInputError, match="Triton"):
            run(prob, impl="fused_chunked", kernels="triton")


_TRITON_SCRIPT = textwrap.dedent(
    """
    import torch
    from loss_support import make_problem, rel_err, run
    prob = make_problem(n=20, d=16, vocab=300, k=7, dtype=torch.float32)
    kw = dict(labels=prob.labels, mask=prob.mask, tail_mass=prob.tail, ce_weight=0.2,
              temperature=2.0, chunk_size=8)
    cases = [("fused_chunked", "forward_kl"), ("fused_chunked", "jsd"),
             ("forward_chunked", "reverse_kl"), ("fused_chunked_recompute", "forward_kl")]
    for impl, kind in cases:
        r, rg = run(prob, impl="dense", loss=kind, **kw)
        loss, grads = run(prob, impl=impl, loss=kind, kernels="triton", **kw)
        assert rel_err(loss, r) < 1e-5, (impl, kind)
        assert all(rel_err(g, x) < 1e-4 for g, x in zip(grads, rg)), (impl, kind)
    # sampled targets (random-sampling KD rows with -inf padding) through the same kernels
    from test_loss_sampled import _problem
    from logitcache.client.loss import topk_distill_loss
    h, w, ids, logw = _problem(n=12, d=8, vocab=300, draws=10, m=10, dtype=torch.float32)
    out = {}
    for kernels, impl in [("torch", "dense"), ("triton", "fused_chunked"),
                          ("triton", "fused_chunked_recompute")]:
        h.grad = w.grad = None
        loss = topk_distill_loss(h, w, ids, logw, targets="sampled", impl=impl, chunk_size=5,
                                 kernels=kernels)
        loss.backward()
        out[impl] = (loss.detach(), h.grad.clone(), w.grad.clone())
    for impl in ("fused_chunked", "fused_chunked_recompute"):
        assert all(rel_err(a, b) < 1e-5 for a, b in zip(out[impl], out["dense"])), impl
    print("ok")
    """
)


@pytest.mark.subprocess
def test_triton_kernels_under_interpreter():
    """The Triton path (kernels run by Triton's CPU interpreter) agrees with the reference,
    for top-k rows (4 objective/impl cases) and for sampled rows."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    here = os.path.dirname(__file__)
    proc = subprocess.run(
        [sys.executable, "-c", _TRITON_SCRIPT],
        cwd=here,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")

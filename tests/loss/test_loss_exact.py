"""The exact loss (teacher hidden states + teacher head) against a dense float64 reference."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from logitcache.client.loss import (
    ExactKernelConfig,
    LossInputError,
    VocabParallel,
    exact_distill_loss,
)
from logitcache.client.loss.exact import CHUNK_BUFFERS
from loss_support import spawn_workers
from memory_support import LiveBytes

LOSSES = ["forward_kl", "reverse_kl", "jsd"]


def problem(n=12, ds=8, dt=6, vocab=37, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, s=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * s).to(dtype)

    student = [r(n, ds).requires_grad_(), r(vocab, ds, s=0.6).requires_grad_()]
    student.append(r(vocab, s=0.3).requires_grad_())
    teacher = [r(n, dt), r(vocab, dt, s=0.8), r(vocab, s=0.3)]
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[1] = -100
    mask = torch.ones(n, dtype=torch.bool)
    mask[2] = False
    return student, teacher, labels, mask


def dense_rows(hs, ws, bs, ht, wt, bt, loss, t, beta=0.5, scale=1.0, cap=None, ce=0.0, labels=None):
    """Full [N, V] logits, full softmax, plain autograd (float64)."""
    y = ht @ wt.T + (0 if bt is None else bt)
    y = y * scale
    if cap is not None:
        y = cap * torch.tanh(y / cap)
    x = hs @ ws.T + (0 if bs is None else bs)
    lp, lq = torch.log_softmax(y / t, -1), torch.log_softmax(x / t, -1)
    p, q = lp.exp(), lq.exp()
    if loss == "forward_kl":
        kd = (p * (lp - lq)).sum(-1)
    elif loss == "reverse_kl":
        kd = (q * (lq - lp)).sum(-1)
    else:
        m = beta * p + (1 - beta) * q
        kd = beta * (p * (lp - m.log())).sum(-1) + (1 - beta) * (q * (lq - m.log())).sum(-1)
    out = kd * t * t
    if ce:
        lab = labels.clamp_min(0)
        out = out - ce * torch.log_softmax(x, -1).gather(1, lab[:, None]).squeeze(1)
    return out


def reference(student, teacher, labels, mask, loss, t, reduction, **kw):
    rows = dense_rows(*student, *teacher, loss, t, labels=labels, **kw)
    valid = mask & (labels != -100)
    rows = torch.where(valid, rows, torch.zeros_like(rows))
    if reduction == "none":
        return rows
    return rows.sum() / (1 if reduction == "sum" else valid.sum())


def exact(student, teacher, labels, mask, loss, t, reduction, chunk, **kw):
    hs, ws, bs = student
    ht, wt, bt = teacher
    return exact_distill_loss(
        hs, ws, ht, wt, student_bias=bs, teacher_bias=bt, labels=labels, mask=mask,
        loss=loss, temperature=t, reduction=reduction, chunk_size=chunk, **kw,
    )  # fmt: skip


def grads_of(out, student):
    weights = torch.linspace(0.5, 1.5, out.numel(), dtype=out.dtype).reshape(out.shape)
    return torch.autograd.grad((out * weights).sum(), student)


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("t", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ce", [0.0, 0.4])
def test_equals_the_dense_float64_reference(loss, t, reduction, ce):
    student, teacher, labels, mask = problem(seed=int(t * 10))
    ref = reference(student, teacher, labels, mask, loss, t, reduction, ce=ce)
    ref_g = grads_of(ref, student)
    for chunk in (3, 5, None):
        out = exact(student, teacher, labels, mask, loss, t, reduction, chunk, ce_weight=ce)
        assert out.shape == ref.shape
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
        for a, b in zip(grads_of(out, student), ref_g, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    if reduction == "none":  # rows that do not count are 0
        assert out[1].item() == 0.0 and out[2].item() == 0.0 and out[0].item() != 0.0


@pytest.mark.parametrize("loss", LOSSES)
def test_logit_scale_and_softcap_of_the_teacher_head(loss):
    student, teacher, labels, mask = problem(seed=3)
    kw = dict(scale=3.0, cap=2.5)
    ref = reference(student, teacher, labels, mask, loss, 1.5, "mean", beta=0.3, **kw)
    out = exact(
        student, teacher, labels, mask, loss, 1.5, "mean", 4,
        teacher_logit_scale=3.0, teacher_softcap=2.5, beta=0.3,
    )  # fmt: skip
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    plain = exact(student, teacher, labels, mask, loss, 1.5, "mean", 4, beta=0.3)
    assert abs(plain.item() - out.item()) > 1e-3  # the transform matters


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("reduction", ["none", "mean_of_rows"])
def test_gradcheck(loss, reduction):
    ce = 0.3 if loss == "jsd" else 0.0
    """The recompute path (``"none"``); the gradient-in-forward path allows one backward only
    (as the top-k loss's), so it is held to the float64 reference above instead."""
    student, teacher, labels, mask = problem(n=5, ds=3, dt=4, vocab=7, seed=11)

    def fn(hs, ws, bs):
        out = exact_distill_loss(
            hs, ws, teacher[0], teacher[1], student_bias=bs, teacher_bias=teacher[2],
            labels=labels, mask=mask, loss=loss, beta=0.3, temperature=1.7, reduction="none",
            chunk_size=2, ce_weight=ce,
        )  # fmt: skip
        return out.mean() if reduction == "mean_of_rows" else out

    assert torch.autograd.gradcheck(fn, tuple(student), eps=1e-6, atol=1e-8)


def test_gradient_in_forward_allows_one_backward_only():
    student, teacher, labels, mask = problem(seed=4)
    out = exact(student, teacher, labels, mask, "forward_kl", 1.0, "mean", 4)
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward only"):
        out.backward()


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_no_gradient_reaches_the_teacher(reduction):
    student, teacher, labels, mask = problem(seed=5)
    teacher = [t.clone().requires_grad_() for t in teacher]
    out = exact(student, teacher, labels, mask, "jsd", 2.0, reduction, 4)
    out.sum().backward()
    assert all(t.grad is None for t in teacher)
    assert all(s.grad is not None and s.grad.abs().sum() > 0 for s in student)


def test_teacher_in_bfloat16_beside_a_float32_student():
    student, teacher, labels, mask = problem(seed=7, dtype=torch.float32)
    tb = [t.to(torch.bfloat16) for t in teacher]
    out = exact(student, tb, labels, mask, "forward_kl", 1.0, "mean", 4)
    s64 = [s.detach().double() for s in student]
    t64 = [t.double() for t in tb]  # the bf16 teacher, computed in float64
    ref = reference(s64, t64, labels, mask, "forward_kl", 1.0, "mean")
    # the bf16 teacher product is rounded once to bf16 before the float32 softmax
    assert out.dtype == torch.float32 and abs(out.item() - ref.item()) < 2e-2 * ref.item()


def test_identical_heads_give_zero_loss_and_gradient():
    student, _, labels, mask = problem(seed=2)
    teacher = [s.detach() for s in student]
    for loss in LOSSES:
        out = exact(student, teacher, labels, mask, loss, 1.3, "mean", 4)
        g = torch.autograd.grad(out, student)
        assert abs(out.item()) < 1e-12 and max(x.abs().max().item() for x in g) < 1e-12


D, V, C = 16, 512, 64


def peak_bytes(n: int, loss: str) -> int:
    g = torch.Generator().manual_seed(n)
    hs = torch.randn(n, D, generator=g).requires_grad_()
    ws = (torch.randn(V, D, generator=g) * 0.3).requires_grad_()
    ht, wt = torch.randn(n, D, generator=g), torch.randn(V, D, generator=g) * 0.3
    mode = LiveBytes().known(hs, ws, ht, wt)
    with mode:
        exact_distill_loss(hs, ws, ht, wt, loss=loss, chunk_size=C).backward()
    return mode.peak


@pytest.mark.parametrize("loss", LOSSES)
def test_peak_is_a_few_chunks_whatever_the_number_of_chunks(loss):
    """Largest intermediates are [chunk, V]: the peak grows with N only by the grad_h rows."""
    p4, p16 = peak_bytes(4 * C, loss), peak_bytes(16 * C, loss)
    grad_h_rows = 12 * C * D * 4
    assert 0 < p16 - p4 - grad_h_rows <= 12 * C * 64, (p4, p16)
    grads = 4 * C * D * 4 + V * D * 4
    # at most CHUNK_BUFFERS float32 [C, V] buffers (JSD: 6, the KLs: 4) + row bookkeeping
    bound = grads + CHUNK_BUFFERS * C * V * 4 + 4 * C * 64
    assert p4 <= bound, (p4, bound)
    if loss != "jsd":
        assert p4 <= grads + 4 * C * V * 4 + 4 * C * 64, p4
    assert p16 < 16 * C * V * 4 / 2  # less than half the [N, V] float32 logits of one side


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(student_weight=torch.zeros(37, 5, dtype=torch.float64)), r"student_weight must"),
        (dict(teacher_weight=torch.zeros(37, 5, dtype=torch.float64)), r"teacher_weight must"),
        (
            dict(teacher_weight=torch.zeros(40, 6, dtype=torch.float64), teacher_bias=None),
            "one vocabulary",
        ),
        (dict(teacher_weight=torch.zeros(37, 6)), r"teacher_weight dtype"),
        (dict(student_weight=torch.zeros(37, 8)), r"student_weight dtype"),
        (dict(teacher_bias=torch.zeros(36, dtype=torch.float64)), r"teacher_bias must"),
        (dict(teacher_hidden=torch.zeros(11, 6, dtype=torch.float64)), "leading shape"),
        (dict(teacher_hidden=torch.zeros(12, dtype=torch.float64)), "teacher_hidden must"),
        (dict(student_hidden=torch.zeros(12, 8, dtype=torch.int64)), "floating point"),
        (dict(loss="renormalized_kl"), "loss must be one of"),
        (dict(loss="jsd", beta=1.0), "beta"),
        (dict(temperature=-1.0), "temperature"),
        (dict(reduction="avg"), "reduction"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(teacher_softcap=0.0), "teacher_softcap"),
        (dict(teacher_logit_scale=math.inf), "teacher_logit_scale"),
        (dict(mask=torch.ones(11, dtype=torch.bool)), "mask must"),
        (dict(labels=torch.zeros(12)), "labels must be an integer"),
        (dict(vocab_parallel="tp"), "must be a VocabParallel"),
        (dict(ce_weight=0.5), "needs labels"),
        (dict(ce_weight=-1.0), "ce_weight"),
        (dict(labels=torch.full((12,), 37)), r"labels out of range \[0, 37\)"),
    ],
)
def test_bad_input_is_a_typed_error(change, match):
    (hs, ws, bs), (ht, wt, bt), _, _ = problem()
    args = dict(
        student_hidden=hs, student_weight=ws, teacher_hidden=ht, teacher_weight=wt,
        student_bias=bs, teacher_bias=bt,
    )  # fmt: skip
    args.update(change)
    with pytest.raises(LossInputError, match=match):
        exact_distill_loss(**args)


def test_vocab_parallel_without_a_process_group_is_a_typed_error(monkeypatch):
    """No default process group (this process may hold one: an in-process vLLM engine of an
    earlier test makes it, so the check is shown one that is not initialised)."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    (hs, ws, bs), (ht, wt, bt), _, _ = problem()
    with pytest.raises(LossInputError, match="initialised torch.distributed"):
        exact_distill_loss(
            student_hidden=hs, student_weight=ws, teacher_hidden=ht, teacher_weight=wt,
            student_bias=bs, teacher_bias=bt, vocab_parallel=VocabParallel(),
        )  # fmt: skip


def test_readme_example_runs():
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    pattern = r"<!-- exact-loss:start -->\s*```python\n(.*?)```\s*<!-- exact-loss:end -->"
    m = re.search(pattern, text, re.S)
    assert m, "README has no exact-loss block"
    ns: dict = {}
    exec(compile(m.group(1), "README:exact-loss", "exec"), ns)
    assert ns["loss"].item() > 0
    assert ns["lm_head"].weight.grad is not None and ns["h"].grad.abs().sum() > 0


@pytest.mark.subprocess
@pytest.mark.timeout(120)
def test_vocab_parallel_heads_equal_one_process():
    """Both heads split unevenly over 2 gloo ranks (V=41: 21 + 20): loss and student grads
    equal the single-process run within 1e-10 (float64), for the 3 objectives and "none"."""
    spawn_workers("exact_vocab_parallel_worker", 2)


def test_no_counted_row_gives_zero_and_zero_gradients():
    student, teacher, labels, _ = problem(seed=8)
    none = torch.zeros(12, dtype=torch.bool)
    out = exact(student, teacher, labels, none, "reverse_kl", 1.0, "mean", 4)
    grads = torch.autograd.grad(out, student)
    assert out.item() == 0.0 and all((g == 0).all() for g in grads)


def test_autocast_runs_the_student_projection_in_bfloat16():
    student, teacher, labels, mask = problem(seed=9, dtype=torch.float32)
    full = exact(student, teacher, labels, mask, "forward_kl", 1.0, "mean", 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = exact(student, teacher, labels, mask, "forward_kl", 1.0, "mean", 4)
    grads = torch.autograd.grad(low, student)
    assert low.dtype == torch.float32 and all(g.dtype == torch.float32 for g in grads)
    assert low.item() != full.item() and abs(low.item() - full.item()) < 5e-2 * full.item()


_TRITON_EXACT = """
import torch
from logitcache.client.loss import ExactKernelConfig
from test_loss_exact import LOSSES, exact, grads_of, problem, reference

# rows split over programs (V=37: 3 statistics and 5 gradient segments)
split = ExactKernelConfig(stats_block=8, stats_cols=16, grad_block=4, grad_cols=8, grad_stages=2)
cases = [(1.0, "mean", {}, None), (2.0, "none", {}, None),
         (0.5, "sum", dict(scale=1.3, cap=3.0), None), (2.0, "none", dict(cap=3.0), split),
         (0.5, "mean", {}, split), (1.0, "none", dict(scale=1.3), split)]
for loss in LOSSES:
    for t, reduction, kw, cfg in cases:
        student, teacher, labels, mask = problem(seed=3)
        ref = reference(student, teacher, labels, mask, loss, t, reduction, **kw)
        head = dict(teacher_logit_scale=kw.get("scale", 1.0), teacher_softcap=kw.get("cap"))
        out = exact(student, teacher, labels, mask, loss, t, reduction, 5, kernels="triton",
                    kernel_config=cfg, **head)
        # the kernels compute in float32 whatever the inputs' dtype
        assert float((out - ref).norm() / ref.norm()) < 1e-5, (loss, t, cfg)
        for a, b in zip(grads_of(out, student), grads_of(ref, student), strict=True):
            assert float((a - b).norm() / b.norm()) < 1e-5, (loss, t, cfg)
print("ok")
"""


@pytest.mark.subprocess
def test_triton_passes_under_interpreter():
    """The Triton passes (Triton's CPU interpreter) equal the float64 reference to float32
    rounding, every objective, with temperature, logit scale and soft-cap, all reductions, for
    rows split over several programs."""
    pytest.importorskip("triton")
    here = Path(__file__).resolve().parent
    proc = subprocess.run(
        [sys.executable, "-c", _TRITON_EXACT],
        cwd=here,
        env=dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{here.parent}:{here.parents[1]}"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")


def test_triton_kernels_refuse_what_they_do_not_cover():
    pytest.importorskip("triton")
    (hs, ws, _), (ht, wt, _), labels, _ = problem()
    with pytest.raises(LossInputError, match="does not cover"):
        exact_distill_loss(hs, ws, ht, wt, labels=labels, ce_weight=0.5, kernels="triton")
    with pytest.raises(LossInputError, match="kernels must be one of"):
        exact_distill_loss(hs, ws, ht, wt, kernels="cuda")


@pytest.mark.parametrize(
    "bad",
    [
        dict(stats_block=1000),
        dict(grad_cols=3000),
        dict(stats_cols=1024, stats_block=2048),
        dict(grad_warps=3),
        dict(stats_stages=0),
        dict(grad_block=True),
    ],
)
def test_bad_kernel_config_is_a_typed_error(bad):
    with pytest.raises(LossInputError, match="ExactKernelConfig"):
        ExactKernelConfig(**bad)


def test_kernel_config_must_be_an_exact_kernel_config():
    (hs, ws, _), (ht, wt, _), _, _ = problem()
    with pytest.raises(LossInputError, match="kernel_config must be"):
        exact_distill_loss(hs, ws, ht, wt, kernel_config={"stats_block": 8})  # type: ignore[arg-type]

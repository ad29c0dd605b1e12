"""The exact loss's Triton row passes before the split-row kernels (git a7f791a), for
``python -m benchmarks.loss exact`` to time beside the library's in one run: variants
``exact_<loss>..._before`` and the pass timings of config ``before``. One program per row,
blocks of 2048 columns, six block reductions per step in the statistics pass; the gradient
scale copied to the device each chunk. Benchmark-only: the library does not import it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import triton
import triton.language as tl

_BLOCK = 2048
_STATS_WARPS = 4
_GRAD_WARPS = 8
_LOSS_CODE = {"forward_kl": 0, "reverse_kl": 1, "jsd": 2}


@triton.jit
def _teacher_logits(y, y_scale, cap, inv_t, SOFTCAP: tl.constexpr):
    """``c tanh(s y / c) / T`` (no tanh unless SOFTCAP) of float32 raw teacher logits."""
    y = y * y_scale
    if SOFTCAP:
        y = cap * (2.0 * tl.sigmoid(2.0 * y / cap) - 1.0)
    return y * inv_t


@triton.jit
def exact_stats_kernel(
    y_ptr,
    y_stride,
    x_ptr,
    x_stride,
    n_cols,
    y_scale,
    cap,
    inv_t,
    out_ptr,
    SOFTCAP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Per row of teacher logits ``y`` and student logits ``x`` (one read of each), with ``a``
    the tempered teacher logits and ``b = x / T``: ``out[row] = (lse(a), lse(b), sum_v p_v
    (a_v - b_v), sum_v q_v (b_v - a_v))``, ``p = softmax(a)``, ``q = softmax(b)``."""
    row = tl.program_id(0).to(tl.int64)
    yb = y_ptr + row * y_stride
    xb = x_ptr + row * x_stride
    ma = tl.max(tl.full([BLOCK], -float("inf"), tl.float32), 0)
    mb = ma
    sa = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    sb = sa
    fw = sa
    rv = sa
    for start in range(0, n_cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        msk = offs < n_cols
        y = tl.load(yb + offs, mask=msk, other=0.0).to(tl.float32)
        a = tl.where(msk, _teacher_logits(y, y_scale, cap, inv_t, SOFTCAP), -float("inf"))
        b = tl.load(xb + offs, mask=msk, other=-float("inf")).to(tl.float32) * inv_t
        d = tl.where(msk, a - b, 0.0)
        na = tl.maximum(ma, tl.max(a, 0))
        nb = tl.maximum(mb, tl.max(b, 0))
        ca = tl.exp(ma - na)
        cb = tl.exp(mb - nb)
        ea = tl.exp(a - na)
        eb = tl.exp(b - nb)
        sa = sa * ca + tl.sum(ea, 0)
        fw = fw * ca + tl.sum(ea * d, 0)
        sb = sb * cb + tl.sum(eb, 0)
        rv = rv * cb - tl.sum(eb * d, 0)
        ma = na
        mb = nb
    tl.store(out_ptr + row * 4, ma + tl.log(sa))
    tl.store(out_ptr + row * 4 + 1, mb + tl.log(sb))
    tl.store(out_ptr + row * 4 + 2, fw / sa)
    tl.store(out_ptr + row * 4 + 3, rv / sb)


@triton.jit
def _log_probs(yb, xb, offs, msk, y_scale, cap, inv_t, lse_a, lse_b, SOFTCAP: tl.constexpr):
    y = tl.load(yb + offs, mask=msk, other=0.0).to(tl.float32)
    lp = _teacher_logits(y, y_scale, cap, inv_t, SOFTCAP) - lse_a
    lq = tl.load(xb + offs, mask=msk, other=0.0).to(tl.float32) * inv_t - lse_b
    return lp, lq


@triton.jit
def _log_mix(lp, lq, log_beta, log_1mbeta):
    """``log(beta p + (1 - beta) q)``."""
    u = lp + log_beta
    v = lq + log_1mbeta
    m = tl.maximum(u, v)
    return m + tl.log(tl.exp(u - m) + tl.exp(v - m))


@triton.jit
def exact_jsd_sums_kernel(
    y_ptr,
    y_stride,
    x_ptr,
    x_stride,
    n_cols,
    y_scale,
    cap,
    inv_t,
    log_beta,
    log_1mbeta,
    stats_ptr,
    out_ptr,
    SOFTCAP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``out[row] = (sum p (log p - log m), sum q (log q - log m))``, ``m = beta p + (1 -
    beta) q``, with the row log-sum-exps of :func:`exact_stats_kernel`."""
    row = tl.program_id(0).to(tl.int64)
    yb = y_ptr + row * y_stride
    xb = x_ptr + row * x_stride
    lse_a = tl.load(stats_ptr + row * 4)
    lse_b = tl.load(stats_ptr + row * 4 + 1)
    tp = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    tq = tp
    for start in range(0, n_cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        msk = offs < n_cols
        lp, lq = _log_probs(yb, xb, offs, msk, y_scale, cap, inv_t, lse_a, lse_b, SOFTCAP)
        lm = _log_mix(lp, lq, log_beta, log_1mbeta)
        tp += tl.sum(tl.where(msk, tl.exp(lp) * (lp - lm), 0.0), 0)
        tq += tl.sum(tl.where(msk, tl.exp(lq) * (lq - lm), 0.0), 0)
    tl.store(out_ptr + row * 2, tp)
    tl.store(out_ptr + row * 2 + 1, tq)


@triton.jit
def exact_grad_kernel(
    y_ptr,
    y_stride,
    x_ptr,
    x_stride,
    g_ptr,
    g_stride,
    n_cols,
    y_scale,
    cap,
    inv_t,
    log_beta,
    log_1mbeta,
    stats_ptr,
    row_ptr,
    coef_ptr,
    LOSS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The student-logits gradient ``g`` (may alias ``x``), times ``coef[row]``; ``LOSS``: 0
    forward KL ``q - p``, 1 reverse KL ``q (log q - log p - KD)``, 2 JSD ``q (1 - beta)
    (log q - log m - t_q)``; ``row_ptr[row]`` holds KD (1) or t_q (2)."""
    row = tl.program_id(0).to(tl.int64)
    yb = y_ptr + row * y_stride
    xb = x_ptr + row * x_stride
    gb = g_ptr + row * g_stride
    lse_a = tl.load(stats_ptr + row * 4)
    lse_b = tl.load(stats_ptr + row * 4 + 1)
    r = tl.load(row_ptr + row)
    c = tl.load(coef_ptr + row)
    for start in range(0, n_cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        msk = offs < n_cols
        lp, lq = _log_probs(yb, xb, offs, msk, y_scale, cap, inv_t, lse_a, lse_b, SOFTCAP)
        q = tl.exp(lq)
        if LOSS == 0:
            g = q - tl.exp(lp)
        elif LOSS == 1:
            g = q * (lq - lp - r)
        else:
            lm = _log_mix(lp, lq, log_beta, log_1mbeta)
            g = q * (tl.exp(log_1mbeta) * (lq - lm - r))
        tl.store(gb + offs, (g * c).to(g_ptr.dtype.element_ty), mask=msk)


def row_stats(y: torch.Tensor, x: torch.Tensor, tf: Any) -> torch.Tensor:
    rows, cols = x.shape
    out = torch.empty(rows, 4, dtype=torch.float32, device=x.device)
    exact_stats_kernel[(rows,)](
        y, y.stride(0), x, x.stride(0), cols, *tf.args(), out,
        SOFTCAP=tf.softcap is not None, BLOCK=_BLOCK, num_warps=_STATS_WARPS,
    )  # fmt: skip
    return out


def jsd_sums(y: torch.Tensor, x: torch.Tensor, tf: Any, stats: torch.Tensor) -> torch.Tensor:
    rows, cols = x.shape
    out = torch.empty(rows, 2, dtype=torch.float32, device=x.device)
    exact_jsd_sums_kernel[(rows,)](
        y, y.stride(0), x, x.stride(0), cols, *tf.args(), *tf.mix(), stats, out,
        SOFTCAP=tf.softcap is not None, BLOCK=_BLOCK, num_warps=_STATS_WARPS,
    )  # fmt: skip
    return out


def row_grad(y, x, tf, loss, stats, row_term, coef) -> torch.Tensor:  # type: ignore[no-untyped-def]
    rows, cols = x.shape
    row_term = row_term.to(torch.float32).contiguous()
    coef = coef.to(torch.float32).expand(rows).contiguous()
    exact_grad_kernel[(rows,)](
        y, y.stride(0), x, x.stride(0), x, x.stride(0), cols, *tf.args(), *tf.mix(),
        stats, row_term, coef,
        LOSS=_LOSS_CODE[loss], SOFTCAP=tf.softcap is not None, BLOCK=_BLOCK,
        num_warps=_GRAD_WARPS,
    )  # fmt: skip
    return x


def chunk_terms(inp: Any, rows: Any, row_weight: Any) -> tuple[torch.Tensor, Any]:
    """The exact loss's ``_chunk_terms_triton`` as it was."""
    from logitcache.client.loss import exact_kernels as ek
    from logitcache.client.loss.fused_chunked import project, take_rows

    spec, head = inp.spec, inp.teacher
    t = spec.temperature
    tf = ek.Transform(head.logit_scale, head.softcap, spec.inv_temperature, spec.beta)
    y = project(take_rows(inp.teacher_hidden, rows), head.weight, head.bias)
    x = project(take_rows(inp.hidden, rows), inp.weight, inp.bias)
    stats = row_stats(y, x, tf)
    lse_a, lse_b, fw, rv = stats.unbind(1)
    term = stats[:, 0]
    if spec.loss == "forward_kl":
        kd = fw - lse_a + lse_b
    elif spec.loss == "reverse_kl":
        kd = term = rv - lse_b + lse_a
    else:
        tp, tq = jsd_sums(y, x, tf, stats).unbind(1)
        kd = spec.beta * tp + (1.0 - spec.beta) * tq
        term = tq
    loss = kd.to(inp.work_dtype) * (t * t)
    if row_weight is None:
        return loss, None
    coef = torch.as_tensor(row_weight, dtype=torch.float32, device=x.device).reshape(-1) * t
    return loss, row_grad(y, x, tf, spec.loss, stats, term, coef)


def passes(y: torch.Tensor, x: torch.Tensor, tf: Any, loss: str) -> None:
    """One chunk's row passes (statistics, JSD sums, gradient over ``x``) as they were."""
    stats = row_stats(y, x, tf)
    term = stats[:, 0]
    if loss == "jsd":
        term = jsd_sums(y, x, tf, stats)[:, 1]
    coef = torch.as_tensor(1.0, dtype=torch.float32, device=x.device).reshape(-1)
    row_grad(y, x, tf, loss, stats, term, coef)


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """Run ``exact_distill_loss`` with these passes inside the block."""
    from logitcache.client.loss import exact

    new = exact._chunk_terms_triton
    exact._chunk_terms_triton = chunk_terms  # type: ignore[assignment]
    try:
        yield
    finally:
        exact._chunk_terms_triton = new  # type: ignore[assignment]

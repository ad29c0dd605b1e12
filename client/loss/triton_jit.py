"""The ``@triton.jit`` kernels behind :mod:`.triton_kernels` (imports Triton: load lazily)."""

import triton
import triton.language as tl


@triton.jit
def row_lse_kernel(
    x_ptr, stride, n_cols, scale, out1_ptr, out2_ptr, HAS2: tl.constexpr, BLOCK: tl.constexpr
):
    """Row log-sum-exp of ``scale * x`` into out1 (and of ``x`` into out2 when HAS2)."""
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride
    m1 = tl.max(tl.full([BLOCK], -float("inf"), tl.float32), 0)
    s1 = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    m2 = m1
    s2 = s1
    for start in range(0, n_cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < n_cols, other=-float("inf")).to(tl.float32)
        y = x * scale
        mn = tl.maximum(m1, tl.max(y, 0))
        ms = tl.where(mn == -float("inf"), 0.0, mn)
        s1 = s1 * tl.exp(m1 - ms) + tl.sum(tl.exp(y - ms), 0)
        m1 = mn
        if HAS2:
            mn2 = tl.maximum(m2, tl.max(x, 0))
            ms2 = tl.where(mn2 == -float("inf"), 0.0, mn2)
            s2 = s2 * tl.exp(m2 - ms2) + tl.sum(tl.exp(x - ms2), 0)
            m2 = mn2
    tl.store(out1_ptr + row, tl.where(s1 > 0, m1 + tl.log(s1), -float("inf")))
    if HAS2:
        tl.store(out2_ptr + row, tl.where(s2 > 0, m2 + tl.log(s2), -float("inf")))


@triton.jit
def row_grad_kernel(
    x_ptr,
    x_stride,
    g_ptr,
    g_stride,
    n_cols,
    scale,
    lse1_ptr,
    c1_ptr,
    lse2_ptr,
    c2_ptr,
    HAS2: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``g = c1 * exp(scale * x - lse1) [+ c2 * exp(x - lse2)]`` row-wise (g may alias x)."""
    row = tl.program_id(0).to(tl.int64)
    xb = x_ptr + row * x_stride
    gb = g_ptr + row * g_stride
    lse1 = tl.load(lse1_ptr + row)
    c1 = tl.load(c1_ptr + row)
    lse2 = lse1
    c2 = c1
    if HAS2:
        lse2 = tl.load(lse2_ptr + row)
        c2 = tl.load(c2_ptr + row)
    for start in range(0, n_cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        msk = offs < n_cols
        x = tl.load(xb + offs, mask=msk, other=-float("inf")).to(tl.float32)
        g = c1 * tl.exp(x * scale - lse1)
        if HAS2:
            g += c2 * tl.exp(x - lse2)
        tl.store(gb + offs, g.to(g_ptr.dtype.element_ty), mask=msk)


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

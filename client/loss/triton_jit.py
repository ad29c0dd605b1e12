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


# ----------------------------------------------------------------------------- the exact loss
# Grids ``(rows, parts)``: program ``(r, s)`` covers columns ``[s seg, min((s + 1) seg, V))`` of
# row ``r`` in steps of ``BLOCK`` columns.


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
    seg,
    y_scale,
    cap,
    inv_t,
    part_ptr,
    SOFTCAP: tl.constexpr,
    BLOCK: tl.constexpr,
    STAGES: tl.constexpr,
):
    """One read of a segment of teacher logits ``y`` and student logits ``x``; with ``a`` the
    tempered teacher logits and ``b = x / T``, ``part[row, s] = (m_a, s_a, f_a, m_b, s_b, f_b)``:
    running maxima ``m``, ``s_a = sum exp(a - m_a)``, ``f_a = sum exp(a - m_a) (a - b)``,
    ``s_b = sum exp(b - m_b)``, ``f_b = sum exp(b - m_b) (b - a)``. The maxima are per block,
    the sums per lane (one reduction each at the end)."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    yb = y_ptr + row * y_stride
    xb = x_ptr + row * x_stride
    lo = part * seg
    hi = tl.minimum(lo + seg, n_cols)
    ma = tl.max(tl.full([BLOCK], -1.0e30, tl.float32), 0)
    mb = ma
    sa = tl.zeros([BLOCK], tl.float32)
    fa = sa
    sb = sa
    fb = sa
    for start in tl.range(lo, hi, BLOCK, num_stages=STAGES):
        offs = start + tl.arange(0, BLOCK)
        msk = offs < hi
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
        sa = sa * ca + ea
        fa = fa * ca + ea * d
        sb = sb * cb + eb
        fb = fb * cb - eb * d
        ma = na
        mb = nb
    out = part_ptr + (row * tl.num_programs(1) + part) * 6
    tl.store(out, ma)
    tl.store(out + 1, tl.sum(sa, 0))
    tl.store(out + 2, tl.sum(fa, 0))
    tl.store(out + 3, mb)
    tl.store(out + 4, tl.sum(sb, 0))
    tl.store(out + 5, tl.sum(fb, 0))


@triton.jit
def _merge(part_ptr, n_parts, PARTS: tl.constexpr):
    """``(lse, sum exp(z - lse) u)`` of one side of a row's partials ``(m, s, f)`` at
    ``part_ptr`` (stride 6), with ``f = sum exp(z - m) u``."""
    i = tl.arange(0, PARTS)
    msk = i < n_parts
    m = tl.load(part_ptr + i * 6, mask=msk, other=-1.0e30)
    s = tl.load(part_ptr + i * 6 + 1, mask=msk, other=0.0)
    f = tl.load(part_ptr + i * 6 + 2, mask=msk, other=0.0)
    top = tl.max(m, 0)
    w = tl.exp(m - top)
    total = tl.sum(s * w, 0)
    return top + tl.log(total), tl.sum(f * w, 0) / total


@triton.jit
def exact_combine_kernel(part_ptr, n_parts, out_ptr, PARTS: tl.constexpr):
    """``out[row] = (lse(a), lse(b), KL(p || q), KL(q || p))`` from the row's ``n_parts``
    partials of :func:`exact_stats_kernel` (``PARTS``: a power of two >= ``n_parts``)."""
    row = tl.program_id(0).to(tl.int64)
    base = part_ptr + row * n_parts * 6
    lse_a, fw = _merge(base, n_parts, PARTS)
    lse_b, rv = _merge(base + 3, n_parts, PARTS)
    tl.store(out_ptr + row * 4, lse_a)
    tl.store(out_ptr + row * 4 + 1, lse_b)
    tl.store(out_ptr + row * 4 + 2, fw - lse_a + lse_b)
    tl.store(out_ptr + row * 4 + 3, rv - lse_b + lse_a)


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
    seg,
    y_scale,
    cap,
    inv_t,
    log_beta,
    log_1mbeta,
    stats_ptr,
    out_ptr,
    SOFTCAP: tl.constexpr,
    BLOCK: tl.constexpr,
    STAGES: tl.constexpr,
):
    """``out[row, s] = (sum p (log p - log m), sum q (log q - log m))`` over segment ``s``,
    ``m = beta p + (1 - beta) q``, with the row log-sum-exps of :func:`exact_combine_kernel`."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    yb = y_ptr + row * y_stride
    xb = x_ptr + row * x_stride
    lo = part * seg
    hi = tl.minimum(lo + seg, n_cols)
    lse_a = tl.load(stats_ptr + row * 4)
    lse_b = tl.load(stats_ptr + row * 4 + 1)
    tp = tl.zeros([BLOCK], tl.float32)
    tq = tp
    for start in tl.range(lo, hi, BLOCK, num_stages=STAGES):
        offs = start + tl.arange(0, BLOCK)
        msk = offs < hi
        lp, lq = _log_probs(yb, xb, offs, msk, y_scale, cap, inv_t, lse_a, lse_b, SOFTCAP)
        lm = _log_mix(lp, lq, log_beta, log_1mbeta)
        tp += tl.where(msk, tl.exp(lp) * (lp - lm), 0.0)
        tq += tl.where(msk, tl.exp(lq) * (lq - lm), 0.0)
    out = out_ptr + (row * tl.num_programs(1) + part) * 2
    tl.store(out, tl.sum(tp, 0))
    tl.store(out + 1, tl.sum(tq, 0))


@triton.jit
def exact_grad_kernel(
    y_ptr,
    y_stride,
    x_ptr,
    x_stride,
    g_ptr,
    g_stride,
    n_cols,
    seg,
    y_scale,
    cap,
    inv_t,
    log_beta,
    log_1mbeta,
    stats_ptr,
    term_ptr,
    term_stride,
    coef_ptr,
    coef,
    LOSS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ROW_COEF: tl.constexpr,
    BLOCK: tl.constexpr,
    STAGES: tl.constexpr,
):
    """The student-logits gradient over a segment, written to ``g`` (may alias ``x``), times
    ``coef_ptr[row]`` (``ROW_COEF``) or ``coef``; ``LOSS``: 0 forward KL ``q - p``, 1 reverse
    KL ``q (log q - log p - KD)``, 2 JSD ``q (1 - beta) (log q - log m - t_q)``;
    ``term_ptr[row * term_stride]`` holds KD (1) or t_q (2)."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    yb = y_ptr + row * y_stride
    xb = x_ptr + row * x_stride
    gb = g_ptr + row * g_stride
    lo = part * seg
    hi = tl.minimum(lo + seg, n_cols)
    lse_a = tl.load(stats_ptr + row * 4)
    lse_b = tl.load(stats_ptr + row * 4 + 1)
    r = tl.load(term_ptr + row * term_stride)
    c = coef
    if ROW_COEF:
        c = tl.load(coef_ptr + row)
    for start in tl.range(lo, hi, BLOCK, num_stages=STAGES):
        offs = start + tl.arange(0, BLOCK)
        msk = offs < hi
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

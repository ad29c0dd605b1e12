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
# row ``r`` in steps of ``BLOCK`` columns (``seg`` a multiple of ``BLOCK``, so only the row's end
# needs a mask). The loops work in base 2: ``inv_t2 = log2(e) / T``, so tempered logits come out
# in bits and every exponential and logarithm is one ``ex2`` / ``lg2`` instruction; results
# leave the kernels in natural units (``* 0.6931...``, ln 2).


@triton.jit
def _teacher_logits(y, y_scale, cap, inv_t2, SOFTCAP: tl.constexpr):
    """``(c tanh(s y / c)) log2(e) / T`` (no tanh unless SOFTCAP) of float32 raw teacher
    logits: the tempered teacher logits in bits."""
    y = y * y_scale
    if SOFTCAP:
        y = cap * (2.0 * tl.sigmoid(2.0 * y / cap) - 1.0)
    return y * inv_t2


@triton.jit
def _online(m, s, f, z, u):
    """One element per lane into a lane's running ``(max m, sum 2^(z - m), sum 2^(z - m) u)``:
    one ``ex2`` (of ``-|z - m|``), whichever side of the maximum ``z`` falls."""
    dz = z - m
    e = tl.exp2(-tl.abs(dz))
    up = dz > 0
    return tl.maximum(m, z), tl.where(up, s * e + 1.0, s + e), tl.where(up, f * e + u, f + e * u)


@triton.jit
def _lanes(m, s, f):
    """A segment's ``(m, s, f)`` from its lanes' ``(m, s, f)``."""
    top = tl.max(m, 0)
    w = tl.exp2(m - top)
    return top, tl.sum(s * w, 0), tl.sum(f * w, 0)


@triton.jit
def _stats_loop(
    yb,
    xb,
    lo,
    hi,
    n_cols,
    y_scale,
    cap,
    inv_t2,
    SOFTCAP: tl.constexpr,
    BLOCK: tl.constexpr,
    STAGES: tl.constexpr,
):
    """One read of columns ``[lo, hi)`` of a row of teacher logits (at ``yb``) and student
    logits (at ``xb``); with ``a`` the tempered teacher logits and ``b = x / T``, both in bits:
    ``(m_a, s_a, f_a, m_b, s_b, f_b)``, maxima ``m``, ``s_a = sum 2^(a - m_a)``, ``f_a = sum
    2^(a - m_a) (a - b)``, ``s_b = sum 2^(b - m_b)``, ``f_b = sum 2^(b - m_b) (b - a)``.
    Each lane keeps its own maxima and sums (no reduction inside the loop), merged at the end."""
    ma = tl.full([BLOCK], -1.0e30, tl.float32)
    mb = ma
    sa = tl.zeros([BLOCK], tl.float32)
    fa = sa
    sb = sa
    fb = sa
    for start in tl.range(lo, hi, BLOCK, num_stages=STAGES):
        offs = start + tl.arange(0, BLOCK)
        msk = offs < n_cols
        y = tl.load(yb + offs, mask=msk, other=0.0).to(tl.float32)
        a = tl.where(msk, _teacher_logits(y, y_scale, cap, inv_t2, SOFTCAP), -float("inf"))
        b = tl.load(xb + offs, mask=msk, other=-float("inf")).to(tl.float32) * inv_t2
        d = tl.where(msk, a - b, 0.0)
        ma, sa, fa = _online(ma, sa, fa, a, d)
        mb, sb, fb = _online(mb, sb, fb, b, -d)
    ma, sa, fa = _lanes(ma, sa, fa)
    mb, sb, fb = _lanes(mb, sb, fb)
    return ma, sa, fa, mb, sb, fb


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
    inv_t2,
    part_ptr,
    SOFTCAP: tl.constexpr,
    BLOCK: tl.constexpr,
    STAGES: tl.constexpr,
):
    """``part[row, s]`` = :func:`_stats_loop` of segment ``s`` of the row."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    lo = part * seg
    hi = tl.minimum(lo + seg, n_cols)
    ma, sa, fa, mb, sb, fb = _stats_loop(
        y_ptr + row * y_stride, x_ptr + row * x_stride, lo, hi, n_cols, y_scale, cap, inv_t2,
        SOFTCAP, BLOCK, STAGES,
    )  # fmt: skip
    out = part_ptr + (row * tl.num_programs(1) + part) * 6
    tl.store(out, ma)
    tl.store(out + 1, sa)
    tl.store(out + 2, fa)
    tl.store(out + 3, mb)
    tl.store(out + 4, sb)
    tl.store(out + 5, fb)


@triton.jit
def _merge(part_ptr, n_parts, PARTS: tl.constexpr):
    """``(lse, sum exp(z - lse) u)`` in natural units of one side of a row's partials ``(m, s,
    f)`` in bits at ``part_ptr`` (stride 6), with ``f = sum 2^(z - m) u``."""
    i = tl.arange(0, PARTS)
    msk = i < n_parts
    m = tl.load(part_ptr + i * 6, mask=msk, other=-1.0e30)
    s = tl.load(part_ptr + i * 6 + 1, mask=msk, other=0.0)
    f = tl.load(part_ptr + i * 6 + 2, mask=msk, other=0.0)
    top = tl.max(m, 0)
    w = tl.exp2(m - top)
    total = tl.sum(s * w, 0)
    return (top + tl.log2(total)) * 0.6931471805599453, tl.sum(
        f * w, 0
    ) / total * 0.6931471805599453


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
def _log_probs(yb, xb, offs, msk, y_scale, cap, inv_t2, lse_a2, lse_b2, SOFTCAP: tl.constexpr):
    """``(log2 p, log2 q)`` of a block, given the row log-sum-exps in bits."""
    y = tl.load(yb + offs, mask=msk, other=0.0).to(tl.float32)
    lp = _teacher_logits(y, y_scale, cap, inv_t2, SOFTCAP) - lse_a2
    lq = tl.load(xb + offs, mask=msk, other=0.0).to(tl.float32) * inv_t2 - lse_b2
    return lp, lq


@triton.jit
def _log_mix(p, q, beta, one_m_beta):
    """``log2(beta p + (1 - beta) q)``, floored at ``log2(1e-37)`` where both underflow (the
    terms it enters are multiplied by ``p`` or ``q`` there)."""
    return tl.log2(tl.maximum(beta * p + one_m_beta * q, 1.0e-37))


@triton.jit
def _sums_loop(
    yb,
    xb,
    lo,
    hi,
    n_cols,
    y_scale,
    cap,
    inv_t2,
    beta,
    one_m_beta,
    lse_a2,
    lse_b2,
    SOFTCAP: tl.constexpr,
    BLOCK: tl.constexpr,
    STAGES: tl.constexpr,
):
    """``(sum p (log p - log m), sum q (log q - log m))`` in natural units over columns
    ``[lo, hi)``, ``m = beta p + (1 - beta) q``."""
    tp = tl.zeros([BLOCK], tl.float32)
    tq = tp
    for start in tl.range(lo, hi, BLOCK, num_stages=STAGES):
        offs = start + tl.arange(0, BLOCK)
        msk = offs < n_cols
        lp, lq = _log_probs(yb, xb, offs, msk, y_scale, cap, inv_t2, lse_a2, lse_b2, SOFTCAP)
        p = tl.exp2(lp)
        q = tl.exp2(lq)
        lm = _log_mix(p, q, beta, one_m_beta)
        tp += tl.where(msk, p * (lp - lm), 0.0)
        tq += tl.where(msk, q * (lq - lm), 0.0)
    return tl.sum(tp, 0) * 0.6931471805599453, tl.sum(tq, 0) * 0.6931471805599453


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
    inv_t2,
    beta,
    one_m_beta,
    stats_ptr,
    out_ptr,
    SOFTCAP: tl.constexpr,
    BLOCK: tl.constexpr,
    STAGES: tl.constexpr,
):
    """``out[row, s]`` = :func:`_sums_loop` over segment ``s``, with the row log-sum-exps of
    :func:`exact_combine_kernel`."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    lo = part * seg
    hi = tl.minimum(lo + seg, n_cols)
    tp, tq = _sums_loop(
        y_ptr + row * y_stride, x_ptr + row * x_stride, lo, hi, n_cols, y_scale, cap, inv_t2,
        beta, one_m_beta, tl.load(stats_ptr + row * 4) * 1.4426950408889634,
        tl.load(stats_ptr + row * 4 + 1) * 1.4426950408889634, SOFTCAP, BLOCK, STAGES,
    )  # fmt: skip
    out = out_ptr + (row * tl.num_programs(1) + part) * 2
    tl.store(out, tp)
    tl.store(out + 1, tq)


@triton.jit
def _grad_loop(
    yb,
    xb,
    gb,
    lo,
    hi,
    n_cols,
    y_scale,
    cap,
    inv_t2,
    beta,
    one_m_beta,
    lse_a2,
    lse_b2,
    r,
    c,
    LOSS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    BLOCK: tl.constexpr,
    STAGES: tl.constexpr,
):
    """``c * dKD/db`` over columns ``[lo, hi)`` written at ``gb`` (may be ``xb``); ``LOSS``: 0
    forward KL ``q - p``, 1 reverse KL ``q (log q - log p - r)`` (``r`` = KD), 2 JSD ``q (1 -
    beta) (log q - log m - r)`` (``r = t_q``); ``r`` in natural units."""
    r2 = r * 1.4426950408889634
    if LOSS == 1:
        c = c * 0.6931471805599453
    elif LOSS == 2:
        c = c * (one_m_beta * 0.6931471805599453)
    for start in tl.range(lo, hi, BLOCK, num_stages=STAGES):
        offs = start + tl.arange(0, BLOCK)
        msk = offs < n_cols
        lp, lq = _log_probs(yb, xb, offs, msk, y_scale, cap, inv_t2, lse_a2, lse_b2, SOFTCAP)
        q = tl.exp2(lq)
        if LOSS == 0:
            g = q - tl.exp2(lp)
        elif LOSS == 1:
            g = q * (lq - lp - r2)
        else:
            g = q * (lq - _log_mix(tl.exp2(lp), q, beta, one_m_beta) - r2)
        tl.store(gb + offs, (g * c).to(gb.dtype.element_ty), mask=msk)


@triton.jit
def exact_grad_kernel(
    y_ptr,
    y_stride,
    x_ptr,
    x_stride,
    n_cols,
    seg,
    y_scale,
    cap,
    inv_t2,
    beta,
    one_m_beta,
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
    """:func:`_grad_loop` over segment ``s`` of the row, written over ``x``, with ``r =
    term_ptr[row * term_stride]`` and ``c = coef_ptr[row]`` (``ROW_COEF``) or ``coef``."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    xb = x_ptr + row * x_stride
    lo = part * seg
    hi = tl.minimum(lo + seg, n_cols)
    c = coef
    if ROW_COEF:
        c = tl.load(coef_ptr + row)
    _grad_loop(
        y_ptr + row * y_stride, xb, xb, lo, hi, n_cols, y_scale, cap, inv_t2, beta,
        one_m_beta, tl.load(stats_ptr + row * 4) * 1.4426950408889634,
        tl.load(stats_ptr + row * 4 + 1) * 1.4426950408889634,
        tl.load(term_ptr + row * term_stride), c,
        LOSS, SOFTCAP, BLOCK, STAGES,
    )  # fmt: skip


@triton.jit
def exact_fused_kernel(
    y_ptr,
    y_stride,
    x_ptr,
    x_stride,
    n_rows,
    n_cols,
    y_scale,
    cap,
    inv_t2,
    beta,
    one_m_beta,
    stats_ptr,
    sums_ptr,
    coef_ptr,
    coef,
    LOSS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ROW_COEF: tl.constexpr,
    GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
    STAGES: tl.constexpr,
):
    """Every pass of a whole row in one program, rows ``pid, pid + P, ...`` (``P`` programs):
    ``stats[row] = (lse(a), lse(b), KL(p || q), KL(q || p))``, for JSD ``sums[row] = (t_p,
    t_q)``, and (``GRAD``) the gradient written over ``x``. The second and third reads of a
    row come from L2 while ``P`` rows fit in it."""
    first = tl.program_id(0).to(tl.int64)
    for i in range(0, tl.cdiv(n_rows, tl.num_programs(0))):
        row = first + i * tl.num_programs(0)
        if row < n_rows:
            yb = y_ptr + row * y_stride
            xb = x_ptr + row * x_stride
            ma, sa, fa, mb, sb, fb = _stats_loop(
                yb, xb, 0, n_cols, n_cols, y_scale, cap, inv_t2, SOFTCAP, BLOCK, STAGES
            )
            lse_a2 = ma + tl.log2(sa)
            lse_b2 = mb + tl.log2(sb)
            term = (fb / sb - lse_b2 + lse_a2) * 0.6931471805599453
            tl.store(stats_ptr + row * 4, lse_a2 * 0.6931471805599453)
            tl.store(stats_ptr + row * 4 + 1, lse_b2 * 0.6931471805599453)
            tl.store(stats_ptr + row * 4 + 2, (fa / sa - lse_a2 + lse_b2) * 0.6931471805599453)
            tl.store(stats_ptr + row * 4 + 3, term)
            if LOSS == 2:
                tp, term = _sums_loop(
                    yb, xb, 0, n_cols, n_cols, y_scale, cap, inv_t2, beta, one_m_beta, lse_a2,
                    lse_b2, SOFTCAP, BLOCK, STAGES,
                )  # fmt: skip
                tl.store(sums_ptr + row * 2, tp)
                tl.store(sums_ptr + row * 2 + 1, term)
            if GRAD:
                c = coef
                if ROW_COEF:
                    c = tl.load(coef_ptr + row)
                _grad_loop(
                    yb, xb, xb, 0, n_cols, n_cols, y_scale, cap, inv_t2, beta, one_m_beta,
                    lse_a2, lse_b2, term, c, LOSS, SOFTCAP, BLOCK, STAGES,
                )  # fmt: skip

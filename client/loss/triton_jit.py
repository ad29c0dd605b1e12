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
# Grid ``(rows * S,)``: program ``pid`` holds segment ``s = pid % S`` (columns ``[s BLOCK, (s +
# 1) BLOCK)``) of row ``pid // S`` in registers for all its steps. The programs of a row exchange
# partial sums through ``part [rows, 8, S]`` (float32, every word filled with the bit pattern
# ``SENTINEL`` before the launch): fields 0-5 the statistics, 6-7 JSD's sums.

SENTINEL = tl.constexpr(0x7FBADBAD)  # a NaN no arithmetic produces
SPINS = tl.constexpr(1 << 14)  # polls before a wait gives up (the partials stay NaN)


@triton.jit
def _teacher_logits(y, y_scale, cap, inv_t, SOFTCAP: tl.constexpr):
    """``c tanh(s y / c) / T`` (no tanh unless SOFTCAP) of float32 raw teacher logits."""
    y = y * y_scale
    if SOFTCAP:
        y = cap * (2.0 * tl.sigmoid(2.0 * y / cap) - 1.0)
    return y * inv_t


@triton.jit
def _max2(a1, b1, a2, b2):
    return tl.maximum(a1, a2), tl.maximum(b1, b2)


@triton.jit
def _add2(a1, b1, a2, b2):
    return a1 + a2, b1 + b2


@triton.jit
def _add4(a1, b1, c1, d1, a2, b2, c2, d2):
    return a1 + a2, b1 + b2, c1 + c2, d1 + d2


@triton.jit
def _field(base, n, f: tl.constexpr, SP: tl.constexpr):
    """Field ``f`` of a row's ``n`` partials (``SP``: a power of two >= ``n``), read from L2."""
    i = tl.arange(0, SP)
    return tl.load(base + f * n + i, mask=i < n, other=0.0, volatile=True)


@triton.jit
def _pending(base, n, F0: tl.constexpr, NF: tl.constexpr, SP: tl.constexpr):
    """How many of fields ``[F0, F0 + NF)`` of the row's partials still hold the sentinel."""
    left = tl.zeros([SP], tl.int32)
    for f in tl.static_range(F0, F0 + NF):
        v = _field(base, n, f, SP).to(tl.int32, bitcast=True)
        left += (v == SENTINEL).to(tl.int32)
    return tl.sum(left, 0)


@triton.jit
def _wait(base, n, stop_ptr, F0: tl.constexpr, NF: tl.constexpr, SP: tl.constexpr):
    """Poll until every program of the row has written fields ``[F0, F0 + NF)``. A wait that
    polls ``SPINS`` times in vain writes 0 at ``stop_ptr`` (else the sentinel), which ends every
    other wait of the launch at once: its rows come out NaN instead of the launch hanging (the
    row's programs are resident together, see :func:`exact_rows_kernel`: not expected)."""
    left = _pending(base, n, F0, NF, SP)
    spins = 0
    go = tl.load(stop_ptr, volatile=True).to(tl.int32, bitcast=True) == SENTINEL
    while (left > 0) & go:
        left = _pending(base, n, F0, NF, SP)
        spins += 1
        go = tl.load(stop_ptr, volatile=True).to(tl.int32, bitcast=True) == SENTINEL
        if spins >= SPINS:
            tl.store(stop_ptr, 0.0)
            go = False


@triton.jit
def _merge(base, n, F0: tl.constexpr, SP: tl.constexpr):
    """``(lse, sum exp(z - lse) u)`` of one side from the row's partials ``(m, s, f)`` (fields
    ``F0..F0 + 2``: maximum, ``sum exp(z - m)``, ``sum exp(z - m) u``)."""
    m = _field(base, n, F0, SP)
    s = _field(base, n, F0 + 1, SP)
    f = _field(base, n, F0 + 2, SP)
    i = tl.arange(0, SP)
    m = tl.where(i < n, m, -1.0e30)
    top = tl.max(m, 0)
    w = tl.exp(m - top)
    total = tl.sum(s * w, 0)
    return top + tl.log(total), tl.sum(f * w, 0) / total


@triton.jit
def exact_rows_kernel(
    y_ptr,
    y_stride,
    x_ptr,
    x_stride,
    n_cols,
    n_parts,
    y_scale,
    cap,
    inv_t,
    log_beta,
    log_1mbeta,
    part_ptr,
    stop_ptr,
    stats_ptr,
    sums_ptr,
    coef_ptr,
    coef,
    LOSS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ROW_COEF: tl.constexpr,
    GRAD: tl.constexpr,
    PHASE: tl.constexpr,
    SP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One read of the segment's teacher logits ``y`` and student logits ``x``; with ``a`` the
    tempered teacher logits (scale, soft-cap, ``/ T``) and ``b = x / T``, ``p = softmax(a)``,
    ``q = softmax(b)``:

    1. segment partials (maxima, ``sum exp``, ``sum exp(a - m_a) (a - b)`` and ``sum exp(b -
       m_b) (b - a)``) published to ``part``; the row's are merged into ``stats[row] =
       (lse(a), lse(b), KL(p || q), KL(q || p))``;
    2. JSD (``LOSS`` 2): ``sums[row] = (sum p log(p / m), sum q log(q / m))``, ``m = beta p +
       (1 - beta) q``, the same way;
    3. ``GRAD``: ``c * dKD/db`` written over the segment of ``x`` (``c = coef_ptr[row]`` with
       ``ROW_COEF``, else ``coef``): ``LOSS`` 0 forward KL ``q - p``, 1 reverse KL ``q (log q -
       log p - KD)``, 2 JSD ``(1 - beta) q (log q - log m - t_q)``.

    ``PHASE`` 0 runs all steps, each program polling ``part`` for its row's partials: this
    needs the ``n_parts`` programs of a row resident at once, which holds as programs start in
    grid order and the GPU holds far more than ``n_parts`` of them (``stop_ptr``: see
    :func:`_wait`). ``PHASE`` 1, 2, 3 run one
    step per launch (1: publish the statistics; 2: JSD's sums; 3: the rest), each reading the
    segment again (the interpreter's way; no program waits)."""
    pid = tl.program_id(0)
    row = (pid // n_parts).to(tl.int64)
    seg = pid % n_parts
    base = part_ptr + row * 8 * n_parts
    offs = seg * BLOCK + tl.arange(0, BLOCK)
    msk = offs < n_cols
    y = tl.load(y_ptr + row * y_stride + offs, mask=msk, other=0.0).to(tl.float32)
    a = tl.where(msk, _teacher_logits(y, y_scale, cap, inv_t, SOFTCAP), -float("inf"))
    xb = x_ptr + row * x_stride
    b = tl.load(xb + offs, mask=msk, other=-float("inf")).to(tl.float32) * inv_t
    d = tl.where(msk, a - b, 0.0)
    ma, mb = tl.reduce((a, b), 0, _max2)
    ea = tl.exp(a - ma)
    eb = tl.exp(b - mb)
    if PHASE <= 1:
        sa, fa, sb, fb = tl.reduce((ea, ea * d, eb, eb * d), 0, _add4)
        tl.store(base + seg, ma)
        tl.store(base + n_parts + seg, sa)
        tl.store(base + 2 * n_parts + seg, fa)
        tl.store(base + 3 * n_parts + seg, mb)
        tl.store(base + 4 * n_parts + seg, sb)
        tl.store(base + 5 * n_parts + seg, -fb)
    if PHASE != 1:
        if PHASE == 0:
            _wait(base, n_parts, stop_ptr, 0, 6, SP)
        lse_a, fw = _merge(base, n_parts, 0, SP)
        lse_b, rv = _merge(base + 3 * n_parts, n_parts, 0, SP)
        kl_f = fw - lse_a + lse_b
        kl_r = rv - lse_b + lse_a
        p = ea * tl.exp(ma - lse_a)
        q = eb * tl.exp(mb - lse_b)
        term = kl_r
        lm = p  # JSD's log m and where m > 0 (LOSS 2)
        live = msk
        if LOSS == 2:
            # m = beta p + (1 - beta) q: one log; where m underflows, so do p and q (terms 0)
            mix = tl.exp(log_beta) * p + tl.exp(log_1mbeta) * q
            live = msk & (mix > 0.0)
            lm = tl.log(tl.where(live, mix, 1.0))
            if PHASE <= 2:
                tp_s, tq_s = tl.reduce(
                    (
                        tl.where(live, p * (a - lse_a - lm), 0.0),
                        tl.where(live, q * (b - lse_b - lm), 0.0),
                    ),
                    0,
                    _add2,
                )
                tl.store(base + 6 * n_parts + seg, tp_s)
                tl.store(base + 7 * n_parts + seg, tq_s)
            if PHASE != 2:
                if PHASE == 0:
                    _wait(base, n_parts, stop_ptr, 6, 2, SP)
                tp = tl.sum(_field(base, n_parts, 6, SP), 0)
                term = tl.sum(_field(base, n_parts, 7, SP), 0)
                tl.store(sums_ptr + row * 2, tp, mask=seg == 0)
                tl.store(sums_ptr + row * 2 + 1, term, mask=seg == 0)
        if PHASE != 2:
            tl.store(stats_ptr + row * 4, lse_a, mask=seg == 0)
            tl.store(stats_ptr + row * 4 + 1, lse_b, mask=seg == 0)
            tl.store(stats_ptr + row * 4 + 2, kl_f, mask=seg == 0)
            tl.store(stats_ptr + row * 4 + 3, kl_r, mask=seg == 0)
            if GRAD:
                c = coef
                if ROW_COEF:
                    c = tl.load(coef_ptr + row)
                if LOSS == 0:
                    g = q - p
                elif LOSS == 1:
                    g = q * (lse_a - lse_b - d - term)
                else:
                    g = tl.where(live, q * (tl.exp(log_1mbeta) * (b - lse_b - lm - term)), 0.0)
                tl.store(xb + offs, (g * c).to(x_ptr.dtype.element_ty), mask=msk)

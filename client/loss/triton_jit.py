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

"""Triton kernels for the two full-vocabulary passes over a chunk of logits (GPU only).

Triton is imported on the first call (``chunk_ops.TRITON_AVAILABLE`` says whether it is
installed; ``topk_distill_loss(kernels=...)`` chooses). Both kernels run one program per row
and stream the row in blocks, reading the logits in their storage dtype and computing in
float32:

* ``row_lse``: ``lse1 = log sum_u exp(scale * x_u)`` (and ``lse2`` of ``x`` unscaled), with one
  running max and one exponential per element; rows that are all ``-inf`` give ``-inf``.
* ``row_grad``: ``g_u = c1 * exp(scale * x_u - lse1) [+ c2 * exp(x_u - lse2)]``, written to
  ``out`` (which may alias ``x``: each block is read before it is written).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

_BLOCK = 4096
_WARPS = 8


@functools.cache
def _kernels() -> dict[str, Any]:
    from . import triton_jit

    return {"lse": triton_jit.row_lse_kernel, "grad": triton_jit.row_grad_kernel}


def _check(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError("triton loss kernels need a 2-D tensor with unit column stride")


def row_lse(
    x: torch.Tensor, scale: float, want_unscaled: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Row log-sum-exp of ``scale * x`` (float32 [C]) and, if asked, of ``x``."""
    _check(x)
    rows, cols = x.shape
    out1 = torch.empty(rows, dtype=torch.float32, device=x.device)
    out2 = torch.empty(rows, dtype=torch.float32, device=x.device) if want_unscaled else out1
    if rows:
        _kernels()["lse"][(rows,)](
            x,
            x.stride(0),
            cols,
            float(scale),
            out1,
            out2,
            HAS2=want_unscaled,
            BLOCK=_BLOCK,
            num_warps=_WARPS,
        )
    return out1, (out2 if want_unscaled else None)


def row_grad(
    x: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    lse1: torch.Tensor,
    c1: torch.Tensor,
    lse2: torch.Tensor | None,
    c2: torch.Tensor | None,
) -> torch.Tensor:
    """``out = c1 * exp(scale * x - lse1) [+ c2 * exp(x - lse2)]`` row-wise; returns ``out``."""
    _check(x)
    _check(out)
    rows, cols = x.shape
    has2 = c2 is not None
    f32 = torch.float32
    lse1, c1 = lse1.to(f32).contiguous(), c1.to(f32).contiguous()
    lse2 = lse2.to(f32).contiguous() if has2 and lse2 is not None else lse1
    c2 = c2.to(f32).contiguous() if c2 is not None else c1
    if rows:
        _kernels()["grad"][(rows,)](
            x,
            x.stride(0),
            out,
            out.stride(0),
            cols,
            float(scale),
            lse1,
            c1,
            lse2,
            c2,
            HAS2=has2,
            BLOCK=_BLOCK,
            num_warps=_WARPS,
        )
    return out

"""Triton kernels for the exact loss's full-vocabulary passes over one chunk (GPU only).

Each kernel runs one program per row and streams the row's teacher logits ``y`` and student
logits ``x`` in blocks, reading them in their storage dtype (bf16 from the GEMMs) and
computing in float32, so no float32 ``[chunk, V]`` buffer exists:

* :func:`row_stats`: ``(lse(a), lse(b), sum p (a - b), sum q (b - a))`` per row, one read of
  each table (``a`` = tempered teacher logits after scale and soft-cap, ``b = x / T``);
* :func:`jsd_sums`: JSD's two sums against the mixture, a second read (JSD only);
* :func:`row_grad`: the student-logits gradient, written over ``x``.

Triton is imported on the first call (``chunk_ops.TRITON_AVAILABLE`` says whether it is
installed).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

_BLOCK = 2048
#: Warps per program: the statistics passes (two tables read, block reductions) run fastest with
#: 4, the gradient pass (two read, one written) with 8 (H200, [2048, 128256] bf16 tables).
_STATS_WARPS = 4
_GRAD_WARPS = 8
#: ``LOSS`` constexpr of the gradient kernel per objective.
_LOSS_CODE = {"forward_kl": 0, "reverse_kl": 1, "jsd": 2}


@functools.cache
def _jit() -> Any:
    from . import triton_jit

    return triton_jit


@dataclass(frozen=True)
class Transform:
    """The teacher-logit transform and temperature the kernels apply."""

    logit_scale: float
    softcap: float | None
    inv_temperature: float
    beta: float = 0.5

    def args(self) -> tuple[float, float, float]:
        return (float(self.logit_scale), float(self.softcap or 1.0), float(self.inv_temperature))

    def mix(self) -> tuple[float, float]:
        return math.log(self.beta), math.log1p(-self.beta)


def _check(*ts: torch.Tensor) -> None:
    for t in ts:
        if t.dim() != 2 or t.stride(1) != 1:
            raise ValueError("exact loss kernels need 2-D tensors with unit column stride")


def row_stats(y: torch.Tensor, x: torch.Tensor, tf: Transform) -> torch.Tensor:
    """``[C, 4]`` float32: ``lse(a), lse(b), sum p (a - b), sum q (b - a)`` per row."""
    _check(y, x)
    rows, cols = x.shape
    out = torch.empty(rows, 4, dtype=torch.float32, device=x.device)
    if rows:
        _jit().exact_stats_kernel[(rows,)](
            y, y.stride(0), x, x.stride(0), cols, *tf.args(), out,
            SOFTCAP=tf.softcap is not None, BLOCK=_BLOCK, num_warps=_STATS_WARPS,
        )  # fmt: skip
    return out


def jsd_sums(y: torch.Tensor, x: torch.Tensor, tf: Transform, stats: torch.Tensor) -> torch.Tensor:
    """``[C, 2]`` float32: ``sum p (log p - log m), sum q (log q - log m)`` per row."""
    _check(y, x)
    rows, cols = x.shape
    out = torch.empty(rows, 2, dtype=torch.float32, device=x.device)
    if rows:
        _jit().exact_jsd_sums_kernel[(rows,)](
            y, y.stride(0), x, x.stride(0), cols, *tf.args(), *tf.mix(), stats, out,
            SOFTCAP=tf.softcap is not None, BLOCK=_BLOCK, num_warps=_STATS_WARPS,
        )  # fmt: skip
    return out


def row_grad(
    y: torch.Tensor,
    x: torch.Tensor,
    tf: Transform,
    loss: str,
    stats: torch.Tensor,
    row_term: torch.Tensor,
    coef: torch.Tensor,
) -> torch.Tensor:
    """Write ``coef[row] * dKD/db`` over ``x`` (``row_term``: KD for the reverse KL, ``t_q``
    for JSD, unused for the forward KL); returns ``x``."""
    _check(y, x)
    rows, cols = x.shape
    f32 = torch.float32
    row_term = row_term.to(f32).contiguous()
    coef = coef.to(f32).expand(rows).contiguous()
    if rows:
        _jit().exact_grad_kernel[(rows,)](
            y, y.stride(0), x, x.stride(0), x, x.stride(0), cols, *tf.args(), *tf.mix(),
            stats, row_term, coef,
            LOSS=_LOSS_CODE[loss], SOFTCAP=tf.softcap is not None, BLOCK=_BLOCK,
            num_warps=_GRAD_WARPS,
        )  # fmt: skip
    return x

"""Triton kernels for the exact loss's full-vocabulary passes over one chunk.

Each kernel reads the chunk's teacher logits ``y`` and student logits ``x`` in their storage
dtype (bf16 from the GEMMs) and computes in float32, so no float32 ``[chunk, V]`` buffer exists.
A row is split into segments of :attr:`ExactKernelConfig.stats_cols` (statistics passes) or
:attr:`ExactKernelConfig.grad_cols` (gradient pass) columns, one program each, which stream their
segment in blocks:

* :func:`row_stats`: per segment the maxima, sums and divergence sums of both tables (one read
  of each), merged per row into ``(lse(a), lse(b), KL(p || q), KL(q || p))`` (``a`` = tempered
  teacher logits after scale and soft-cap, ``b = x / T``);
* :func:`jsd_sums`: JSD's two sums against the mixture, a second read (JSD only);
* :func:`row_grad`: the student-logits gradient, written over ``x``.

Chunk traffic: the KLs read both tables twice and write one; JSD reads them three times.
Triton is imported on the first call (``chunk_ops.TRITON_AVAILABLE`` says whether it is
installed); on the CPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

from .spec import LossInputError

#: ``LOSS`` constexpr of the gradient kernel per objective.
_LOSS_CODE = {"forward_kl": 0, "reverse_kl": 1, "jsd": 2}
_WARPS = (1, 2, 4, 8, 16, 32)


@functools.cache
def _jit() -> Any:
    from . import triton_jit

    return triton_jit


def _stages(n: int) -> int | None:
    """The loops' ``num_stages``: ``None`` (no pipelining attribute) for 1."""
    return n if n > 1 else None


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class ExactKernelConfig:
    """Launch geometry of the passes: per pass, columns per loop step (``*_block``, a power of
    two), columns per program (``*_cols``, a multiple of the block: a row of ``V`` columns runs
    as ``ceil(V / cols)`` programs), warps per program and software-pipeline stages of the
    loop (``*_stages``; 1: none). The statistics settings also run the JSD sums pass.
    The defaults are the fastest split-pass settings of the pass sweep in
    ``benchmarks/exact_passes.py`` at git 969549c on an H100 at V=128,256 (statistics:
    2048-column blocks, 4 warps; gradient: 4096-column blocks, 8 warps; 16,384 columns per
    program)."""

    stats_block: int = 2048
    stats_cols: int = 16384
    stats_warps: int = 4
    stats_stages: int = 1
    grad_block: int = 4096
    grad_cols: int = 16384
    grad_warps: int = 8
    grad_stages: int = 1

    def __post_init__(self) -> None:
        for side in ("stats", "grad"):
            block, cols, warps, stages = (
                getattr(self, f"{side}_{k}") for k in ("block", "cols", "warps", "stages")
            )
            ok = (
                all(isinstance(v, int) and not isinstance(v, bool) for v in (block, cols))
                and _pow2(block)
                and cols >= block
                and cols % block == 0
                and warps in _WARPS
                and isinstance(stages, int)
                and 1 <= stages <= 8
            )
            if not ok:
                raise LossInputError(
                    f"ExactKernelConfig {side}: block must be a power of two, cols a positive "
                    f"multiple of it, warps one of {_WARPS}, stages in 1..8; got block={block!r}, "
                    f"cols={cols!r}, warps={warps!r}, stages={stages!r}"
                )

    @staticmethod
    def parts(cols: int, n_cols: int) -> int:
        """Programs per row for ``n_cols`` columns at ``cols`` columns per program."""
        return max(1, -(-n_cols // cols))


#: The library's launch geometry.
DEFAULT_CONFIG = ExactKernelConfig()


@dataclass(frozen=True)
class Transform:
    """The teacher-logit transform and temperature the kernels apply."""

    logit_scale: float
    softcap: float | None
    inv_temperature: float
    beta: float = 0.5

    def args(self) -> tuple[float, float, float]:
        """``(logit scale, soft-cap (1.0: none), log2(e) / T)``: the kernels work in bits."""
        inv_t2 = float(self.inv_temperature) * math.log2(math.e)
        return (float(self.logit_scale), float(self.softcap or 1.0), inv_t2)

    def mix(self) -> tuple[float, float]:
        """JSD's mixture weights ``(beta, 1 - beta)``."""
        return float(self.beta), 1.0 - float(self.beta)


def _check(*ts: torch.Tensor) -> None:
    for t in ts:
        if t.dim() != 2 or t.stride(1) != 1:
            raise ValueError("exact loss kernels need 2-D tensors with unit column stride")


def row_stats(
    y: torch.Tensor, x: torch.Tensor, tf: Transform, cfg: ExactKernelConfig = DEFAULT_CONFIG
) -> torch.Tensor:
    """``[C, 4]`` float32: ``lse(a), lse(b), KL(p || q), KL(q || p)`` per row."""
    _check(y, x)
    rows, cols = x.shape
    out = torch.empty(rows, 4, dtype=torch.float32, device=x.device)
    if rows:
        parts = cfg.parts(cfg.stats_cols, cols)
        part = torch.empty(rows, parts, 6, dtype=torch.float32, device=x.device)
        jit = _jit()
        jit.exact_stats_kernel[(rows, parts)](
            y, y.stride(0), x, x.stride(0), cols, cfg.stats_cols, *tf.args(), part,
            SOFTCAP=tf.softcap is not None, BLOCK=cfg.stats_block, STAGES=_stages(cfg.stats_stages),
            num_warps=cfg.stats_warps,
        )  # fmt: skip
        p2 = max(2, 1 << (parts - 1).bit_length())
        jit.exact_combine_kernel[(rows,)](part, parts, out, PARTS=p2, num_warps=1)
    return out


def jsd_sums(
    y: torch.Tensor,
    x: torch.Tensor,
    tf: Transform,
    stats: torch.Tensor,
    cfg: ExactKernelConfig = DEFAULT_CONFIG,
) -> torch.Tensor:
    """``[C, 2]`` float32: ``sum p (log p - log m), sum q (log q - log m)`` per row."""
    _check(y, x)
    rows, cols = x.shape
    parts = cfg.parts(cfg.stats_cols, cols)
    out = torch.empty(rows, parts, 2, dtype=torch.float32, device=x.device)
    if rows:
        _jit().exact_jsd_sums_kernel[(rows, parts)](
            y, y.stride(0), x, x.stride(0), cols, cfg.stats_cols, *tf.args(), *tf.mix(), stats,
            out, SOFTCAP=tf.softcap is not None, BLOCK=cfg.stats_block,
            STAGES=_stages(cfg.stats_stages), num_warps=cfg.stats_warps,
        )  # fmt: skip
    return out.sum(1)


def row_grad(
    y: torch.Tensor,
    x: torch.Tensor,
    tf: Transform,
    loss: str,
    stats: torch.Tensor,
    row_term: torch.Tensor,
    coef: float | torch.Tensor,
    cfg: ExactKernelConfig = DEFAULT_CONFIG,
) -> torch.Tensor:
    """Write ``coef * dKD/db`` over ``x`` (``coef``: one number, or ``[C]`` per row;
    ``row_term [C]``: KD for the reverse KL, ``t_q`` for JSD, unused for the forward KL);
    returns ``x``."""
    _check(y, x)
    rows, cols = x.shape
    if row_term.dim() != 1 or row_term.dtype != torch.float32:
        raise ValueError("row_term must be a [C] float32 tensor")
    per_row = isinstance(coef, torch.Tensor)
    coef_t = stats
    coef_v = 0.0
    if isinstance(coef, torch.Tensor):
        coef_t = coef.to(torch.float32).expand(rows).contiguous()
    else:
        coef_v = float(coef)
    if rows:
        _jit().exact_grad_kernel[(rows, cfg.parts(cfg.grad_cols, cols))](
            y, y.stride(0), x, x.stride(0), cols, cfg.grad_cols, *tf.args(),
            *tf.mix(), stats, row_term, row_term.stride(0), coef_t,
            coef_v,
            LOSS=_LOSS_CODE[loss], SOFTCAP=tf.softcap is not None, ROW_COEF=per_row,
            BLOCK=cfg.grad_block, STAGES=_stages(cfg.grad_stages), num_warps=cfg.grad_warps,
        )  # fmt: skip
    return x

"""Triton kernel for the exact loss's full-vocabulary passes over one chunk.

:func:`rows` runs one kernel (:func:`~.triton_jit.exact_rows_kernel`) over the chunk's teacher
logits ``y`` and student logits ``x`` in their storage dtype (bf16 from the GEMMs), computing
in float32, so no float32 ``[chunk, V]`` buffer exists. A row is split into segments of
:attr:`ExactKernelConfig.block` columns, one program each, which keeps its segment in registers
from its one read of ``y`` and ``x`` to its write of the gradient over ``x``; the programs of a
row exchange their partial sums (maxima, sums of exponentials, divergence sums) through a small
buffer, once for the log-sum-exps and the KLs and once more for JSD's sums against the mixture.
Chunk traffic, every objective: both tables read once, the gradient written once.
Triton is imported on the first call (``chunk_ops.TRITON_AVAILABLE`` says whether it is
installed); on the CPU the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

from .spec import LossInputError

#: ``LOSS`` constexpr of the kernel per objective.
_LOSS_CODE = {"forward_kl": 0, "reverse_kl": 1, "jsd": 2}
_WARPS = (1, 2, 4, 8, 16, 32)
#: Fields per segment in the partials buffer, and the word every one holds until written.
_FIELDS = 8
_SENTINEL = 0x7FBADBAD


@functools.cache
def _jit() -> Any:
    from . import triton_jit

    return triton_jit


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class ExactKernelConfig:
    """Launch geometry of the kernel: ``block`` columns per program (a power of two; a row of
    ``V`` columns runs as ``ceil(V / block)`` programs), ``warps`` per program. ``sync=False``
    runs the kernel's steps as separate launches that each read the two tables again (three
    reads for JSD, two for the KLs; as on the CPU, where the interpreter runs one program at a
    time), a slower reference for the one-read kernel. The defaults: 2048-column segments of 8
    warps (8 columns of each table per thread) at 64 registers: four programs per SM for
    every objective, none spilling (ptxas, sm_90)."""

    block: int = 2048
    warps: int = 8
    sync: bool = True
    max_regs: int = 64

    def __post_init__(self) -> None:
        block, warps, sync, regs = self.block, self.warps, self.sync, self.max_regs
        ok = (
            isinstance(regs, int)
            and not isinstance(regs, bool)
            and (regs == 0 or 24 <= regs <= 255)
            and isinstance(block, int)
            and not isinstance(block, bool)
            and _pow2(block)
            and warps in _WARPS
            and not isinstance(warps, bool)
            and isinstance(sync, bool)
        )
        if not ok:
            raise LossInputError(
                f"ExactKernelConfig: block must be a power of two, warps one of {_WARPS}, sync a "
                f"bool, max_regs 0 or in 24..255; got block={block!r}, warps={warps!r}, "
                f"sync={sync!r}, max_regs={regs!r}"
            )

    def parts(self, n_cols: int) -> int:
        """Programs per row for ``n_cols`` columns."""
        return max(1, -(-n_cols // self.block))


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
        return (float(self.logit_scale), float(self.softcap or 1.0), float(self.inv_temperature))

    def mix(self) -> tuple[float, float]:
        return math.log(self.beta), math.log1p(-self.beta)


def _check(*ts: torch.Tensor) -> None:
    for t in ts:
        if t.dim() != 2 or t.stride(1) != 1:
            raise ValueError("exact loss kernels need 2-D tensors with unit column stride")


def rows(
    y: torch.Tensor,
    x: torch.Tensor,
    tf: Transform,
    loss: str,
    coef: float | torch.Tensor | None,
    cfg: ExactKernelConfig = DEFAULT_CONFIG,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per row ``stats [C, 4]`` float32 ``(lse(a), lse(b), KL(p || q), KL(q || p))`` and, for
    JSD, ``sums [C, 2]`` ``(sum p log(p / m), sum q log(q / m))``; unless ``coef`` is ``None``,
    ``coef * dKD/db`` (``coef``: one number, or ``[C]`` per row) written over ``x``."""
    _check(y, x)
    n_rows, cols = x.shape
    dev = x.device
    stats = torch.empty(n_rows, 4, dtype=torch.float32, device=dev)
    sums = torch.empty(n_rows, 2, dtype=torch.float32, device=dev) if loss == "jsd" else None
    coef_t, coef_v = stats, 0.0
    if isinstance(coef, torch.Tensor):
        coef_t = coef.to(device=dev, dtype=torch.float32).expand(n_rows).contiguous()
    elif coef is not None:
        coef_v = float(coef)
    if not n_rows:
        return stats, sums
    parts = cfg.parts(cols)
    words = n_rows * _FIELDS * parts
    part = torch.full((words + 1,), _SENTINEL, dtype=torch.int32, device=dev).view(torch.float32)
    if cfg.sync and (dev.type == "cuda" or parts == 1):  # one program a row: nothing to wait on
        phases: tuple[int, ...] = (0,)
    else:
        phases = (1, 2, 3) if loss == "jsd" else (1, 3)
    extra = {"maxnreg": cfg.max_regs} if cfg.max_regs else {}
    for phase in phases:
        _jit().exact_rows_kernel[(n_rows * parts,)](
            y, y.stride(0), x, x.stride(0), cols, parts, *tf.args(), *tf.mix(),
            part, part[words:], stats, stats if sums is None else sums, coef_t, coef_v,
            LOSS=_LOSS_CODE[loss], SOFTCAP=tf.softcap is not None,
            ROW_COEF=isinstance(coef, torch.Tensor), GRAD=coef is not None, PHASE=phase,
            SP=max(2, 1 << (parts - 1).bit_length()), BLOCK=cfg.block, num_warps=cfg.warps, **extra,
        )  # fmt: skip
    return stats, sums

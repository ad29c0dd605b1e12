"""The two full-vocabulary passes over one chunk of logits, in torch or in Triton.

``stats_pass`` gathers the top-k (and label) logits, blanks the top-k columns to ``-inf`` and
takes the row log-sum-exp of what is left (``lse_out``), so the student's outside-top-k mass is
exact rather than ``1 - sum q``. ``grad_pass`` writes the logits gradient
``c1 * exp(x/T - lse) [+ c2 * exp(x - lse1)]`` and then the explicit top-k and label values.
The Triton path reads and writes the chunk in its own dtype (bf16 logits: 2 bytes/elt/pass);
the torch path upcasts to the working dtype (it is the CPU and reference-precision path).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.util import find_spec
from typing import TYPE_CHECKING

import torch

from .row_math import RowCoefs, row_coefs
from .spec import KERNELS, LossInputError, LossSpec, check_choice, given

if TYPE_CHECKING:
    from .validation import Prepared

#: Whether Triton is installed, decided once at import (``logitcache info --versions`` shows
#: it): without it the full-vocabulary passes run in torch on every device.
TRITON_AVAILABLE: bool = find_spec("triton") is not None
#: Rows of a chunk: a slice, or an index tensor of the counted rows.
Rows = slice | torch.Tensor


@dataclass
class ChunkTargets:
    """The teacher side of one chunk of rows."""

    ids: torch.Tensor  # [C, k] int64
    logprobs: torch.Tensor  # [C, k] working dtype
    tail: torch.Tensor | None  # [C]
    labels: torch.Tensor | None  # [C] int64
    has_label: torch.Tensor | None  # [C] bool

    def select(self, rows: Rows) -> ChunkTargets:
        """The targets of ``rows`` (a slice or an index tensor)."""

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else take_rows(t, rows)

        ids, logprobs = take_rows(self.ids, rows), take_rows(self.logprobs, rows)
        return ChunkTargets(ids, logprobs, pick(self.tail), pick(self.labels), pick(self.has_label))


def targets_of(prep: Prepared) -> ChunkTargets:
    """The teacher side of every row of ``prep``."""
    return ChunkTargets(prep.ids, prep.logprobs, prep.tail, prep.labels, prep.has_label)


def take_rows(t: torch.Tensor, rows: Rows) -> torch.Tensor:
    """The rows ``rows`` (a slice or an index tensor) of ``t``."""
    return t[rows] if isinstance(rows, slice) else t.index_select(0, rows)


def use_triton(kernels: str, device: torch.device) -> bool:
    """Whether the Triton kernels run the passes: ``kernels="auto"``: on CUDA when Triton is
    installed; ``"torch"``: never; ``"triton"``: always (on the CPU too, under Triton's
    interpreter ``TRITON_INTERPRET=1``; an error without Triton)."""
    check_choice("kernels", kernels, KERNELS)
    if kernels == "triton" and not TRITON_AVAILABLE:
        raise LossInputError('kernels="triton" needs Triton installed')
    if kernels == "auto":
        return device.type == "cuda" and TRITON_AVAILABLE
    return kernels == "triton"


def stats_pass(
    spec: LossSpec,
    x: torch.Tensor,
    tgt: ChunkTargets,
    work_dtype: torch.dtype,
    *,
    inplace: bool,
    triton: bool,
) -> RowCoefs:
    """Per-row loss and unit gradient coefficients of a chunk of raw logits ``x`` [C, V].

    With ``inplace`` the top-k columns of ``x`` are left at ``-inf`` (the caller overwrites the
    buffer with the gradient next); otherwise ``x`` is not modified.
    """
    x_s = x.gather(1, tgt.ids).to(work_dtype)
    need_ce = spec.ce_weight > 0.0
    x_label = None
    if need_ce:
        x_label = x.gather(1, given(tgt.labels, "labels")[:, None]).squeeze(1).to(work_dtype)
    if triton:
        buf = x if inplace else x.clone()
    else:
        reuse = inplace and x.dtype == work_dtype
        buf = x if reuse else x.to(work_dtype, copy=True)
    buf.scatter_(1, tgt.ids, float("-inf"))
    lse_out, lse1_out = blanked_lse(spec, buf, work_dtype, triton=triton)
    return row_coefs(spec, x_s, lse_out, tgt.logprobs, tgt.tail, x_label, lse1_out, tgt.has_label)


def blanked_lse(
    spec: LossSpec, buf: torch.Tensor, work_dtype: torch.dtype, *, triton: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Row log-sum-exps of a chunk ``buf`` whose target columns hold ``-inf``: of ``buf / T``
    and (when CE has its own softmax) of ``buf``, in the working dtype."""
    if triton:
        from . import triton_kernels

        lse, lse1 = triton_kernels.row_lse(buf, spec.inv_temperature, spec.separate_ce_softmax)
        return lse.to(work_dtype), None if lse1 is None else lse1.to(work_dtype)
    xf = buf.to(work_dtype)
    scaled = xf if spec.temperature == 1.0 else xf * spec.inv_temperature
    lse1 = torch.logsumexp(xf, dim=1) if spec.separate_ce_softmax else None
    return torch.logsumexp(scaled, dim=1), lse1


def dense_row_grad(
    spec: LossSpec, x: torch.Tensor, out: torch.Tensor, coefs: RowCoefs, *, triton: bool
) -> torch.Tensor:
    """Write the dense part of d(loss)/d(x), ``c1 exp(s x - lse) + c2 exp(x - lse1)``, into
    ``out`` (may be ``x`` itself); the sparse target and label terms are the caller's."""
    s = spec.inv_temperature
    if triton:
        from . import triton_kernels

        triton_kernels.row_grad(x, out, s, coefs.lse, coefs.c1, coefs.lse1, coefs.c2)
    else:
        xf = x.to(coefs.lse.dtype)
        zs = xf if s == 1.0 else xf * s
        g = (zs - coefs.lse[:, None]).exp_().mul_(coefs.c1[:, None])
        if coefs.c2 is not None:
            g += (xf - given(coefs.lse1, "lse1")[:, None]).exp_().mul_(coefs.c2[:, None])
        out.copy_(g)
    return out


def grad_pass(
    spec: LossSpec,
    x: torch.Tensor,
    out: torch.Tensor,
    coefs: RowCoefs,
    tgt: ChunkTargets,
    *,
    triton: bool,
) -> torch.Tensor:
    """Write d(loss)/d(x) for the chunk into ``out`` (may be ``x`` itself) and return it.

    ``coefs`` must already carry the row weights (see :meth:`RowCoefs.scaled`). ``x`` may hold
    ``-inf`` at the top-k columns (left by an in-place :func:`stats_pass`): those are overwritten.
    """
    dense_row_grad(spec, x, out, coefs, triton=triton)
    out.scatter_(1, tgt.ids, coefs.sparse.to(out.dtype))
    if coefs.label_add is not None:
        out.scatter_add_(
            1, given(tgt.labels, "labels")[:, None], coefs.label_add[:, None].to(out.dtype)
        )
    return out

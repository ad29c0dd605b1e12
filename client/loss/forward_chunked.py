"""``impl="forward_chunked"``: full student logits, the sparse loss computed chunk by chunk.

The projection ``x = h W^T (+ b)`` is an ordinary autograd op and keeps the full ``[N, V]``
logits (and, in backward, their gradient); only the loss is chunked over positions, so no fp32
``[N, V]`` temporaries and no dense teacher exist. Forward saves, per row, the log-sum-exps and
the unit gradient coefficients (``O(N k)``); backward writes ``d loss / d x`` chunk by chunk.
"""

from __future__ import annotations

from typing import Any

import torch

from .chunk_ops import ChunkTargets, grad_pass, stats_pass, targets_of
from .spec import LossSpec
from .validation import Prepared


class _ChunkedLossOnLogits(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        spec: LossSpec,
        tgt: ChunkTargets,
        work_dtype: torch.dtype,
        chunk: int,
        triton: bool,
    ) -> torch.Tensor:
        parts = []
        for start in range(0, logits.shape[0], chunk):
            rows = slice(start, start + chunk)
            parts.append(
                stats_pass(
                    spec, logits[rows], tgt.select(rows), work_dtype, inplace=False, triton=triton
                )
            )
        ctx.save_for_backward(logits)
        ctx.parts, ctx.tgt, ctx.spec, ctx.chunk, ctx.triton = parts, tgt, spec, chunk, triton
        return torch.cat([p.loss for p in parts])

    @staticmethod
    def backward(ctx: Any, grad_rows: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (logits,) = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for i, part in enumerate(ctx.parts):
            rows = slice(i * ctx.chunk, (i + 1) * ctx.chunk)
            coefs = part.scaled(grad_rows[rows].to(part.c1.dtype))
            grad_pass(
                ctx.spec, logits[rows], grad[rows], coefs, ctx.tgt.select(rows), triton=ctx.triton
            )
        return grad, None, None, None, None, None


def forward_chunked_rows(
    spec: LossSpec, prep: Prepared, chunk: int, triton: bool = False
) -> torch.Tensor:
    """Per-row losses (zero on rows that do not count), differentiable w.r.t. h, W and b."""
    logits = prep.hidden @ prep.weight.t()
    if prep.bias is not None:
        logits = logits + prep.bias
    tgt = targets_of(prep)
    rows = _ChunkedLossOnLogits.apply(logits, spec, tgt, prep.work_dtype, chunk, triton)
    return torch.where(prep.valid, rows, torch.zeros((), dtype=rows.dtype, device=rows.device))

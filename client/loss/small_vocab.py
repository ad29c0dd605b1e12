r"""``impl="small_vocab"``: full student logits and one exponential pass, for a small ``N x V``.

Per counted row (notation of :func:`~.api.topk_distill_loss`): logits ``x = W h + b``, tempered
``z = x / T``, cached ids ``S``. With ``m = max_u z_u`` and ``e_u = exp(z_u - m)`` off ``S``
(``0`` on ``S``), the log-sum-exp of ``z`` outside ``S`` is ``lse_out = m + log sum_u e_u``,
exact (no ``-inf`` entries, no cancellation). The row loss and its gradient coefficients then
come from ``z_S``, ``lse_out`` and the targets through :func:`.row_math.row_coefs`, the formulas
of every chunked impl. The gradient w.r.t. the raw logits is

    dL/dx_u = c1 * q_u + c2 * softmax(x)_u     (u not in S),   q_u = e_u * exp(m - lse)
    dL/dx_v = sparse_v                         (v in S)

plus ``label_add`` at the label column (``c2`` and a second pass over ``x`` only with a
separate CE softmax). ``e`` is kept for backward, so one exponential over ``[N, V]`` serves
both; the projection is plain autograd on the counted rows. Memory ``O(N V)``, so
``impl="auto"`` picks it only on the CPU for a small ``N x V`` (``dispatch.picks_small_vocab``),
where it beats the fused impl, whose ``-inf`` blanking and id sort cost more than the GEMM it
saves (benchmarks/results/loss.md). Duplicate ids are found by counting them into an ``[N, V]``
buffer, not by a sort.
"""

from __future__ import annotations

from typing import Any

import torch

from .chunk_ops import ChunkTargets, targets_of
from .row_math import RowCoefs, row_coefs
from .spec import LossInputError, LossSpec, given
from .validation import DUPLICATE_IDS, Prepared


def check_distinct(ids: torch.Tensor, vocab: int) -> None:
    """:class:`LossInputError` if a row of ``ids`` [C, k] (in range) repeats an id: the ids'
    counts per row, scattered into a ``[C, V]`` buffer (int16 while ``k`` fits: no overflow)."""
    k = ids.shape[1]
    dtype = torch.int16 if k < 2**15 else torch.int32
    counts = torch.zeros(ids.shape[0], vocab, dtype=dtype, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones((), dtype=dtype, device=ids.device).expand_as(ids))
    if ids.numel() and int(counts.amax()) > 1:
        raise LossInputError(DUPLICATE_IDS)


def _exp_outside(
    z: torch.Tensor, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``e = exp(z - m)`` set to 0 on the ids, ``m = max z`` and ``lse_out = m + log sum e``,
    per row of ``z``."""
    m = z.amax(dim=1, keepdim=True)
    e = torch.sub(z, m).exp_().scatter_(1, ids, 0.0)
    m = m.squeeze(1)
    return e, m, m + e.sum(dim=1).log()


class _SmallVocabOnLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, spec: LossSpec, tgt: ChunkTargets) -> torch.Tensor:
        x = logits.to(tgt.logprobs.dtype)  # the working dtype
        z = x if spec.temperature == 1.0 else x * spec.inv_temperature
        ctx.e, ctx.m, lse_out = _exp_outside(z, tgt.ids)
        x_label = lse1_out = ctx.e1 = ctx.m1 = None
        if spec.ce_weight > 0.0:
            x_label = x.gather(1, given(tgt.labels, "labels")[:, None]).squeeze(1)
        if spec.separate_ce_softmax:
            ctx.e1, ctx.m1, lse1_out = _exp_outside(x, tgt.ids)
        coefs = row_coefs(
            spec,
            x.gather(1, tgt.ids),
            lse_out,
            tgt.logprobs,
            tgt.tail,
            x_label,
            lse1_out,
            tgt.has_label,
        )
        ctx.coefs, ctx.tgt, ctx.out_dtype = coefs, tgt, logits.dtype
        return coefs.loss

    @staticmethod
    def backward(ctx: Any, grad_rows: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # off the ids: c1 * exp(z - lse) = c1 * e * exp(m - lse), with row_coefs' lse
        c: RowCoefs = ctx.coefs.scaled(grad_rows.to(ctx.coefs.c1.dtype))
        grad = ctx.e * (c.c1 * (ctx.m - c.lse).exp())[:, None]
        if c.c2 is not None:
            grad += ctx.e1 * (c.c2 * (ctx.m1 - given(c.lse1, "lse1")).exp())[:, None]
        grad.scatter_(1, ctx.tgt.ids, c.sparse)
        if c.label_add is not None:
            grad.scatter_add_(1, ctx.tgt.labels[:, None], c.label_add[:, None])
        return grad.to(ctx.out_dtype), None, None


def small_vocab_rows(spec: LossSpec, prep: Prepared, check_ids: bool) -> torch.Tensor:
    """Per-row losses (zero on rows that do not count), differentiable w.r.t. h, W and b.

    Only counted rows are projected. ``check_ids``: raise on duplicate ids (``prepare`` has
    checked the range already and left the duplicate check to :func:`check_distinct`).
    """
    tgt = targets_of(prep)
    hidden, idx = prep.hidden, None
    if not prep.all_valid:
        idx = prep.valid.nonzero().squeeze(1)
        hidden, tgt = hidden.index_select(0, idx), tgt.select(idx)
    if check_ids:
        check_distinct(tgt.ids, prep.weight.shape[0])
    logits = hidden @ prep.weight.t()
    if prep.bias is not None:
        logits = logits + prep.bias
    rows = _SmallVocabOnLogits.apply(logits, spec, tgt)
    if idx is None:
        return rows
    return rows.new_zeros(prep.valid.numel()).index_copy(0, idx, rows)

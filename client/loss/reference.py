"""Dense reference: full student logits, the teacher rebuilt over the full vocabulary, autograd.

This is written independently of the chunked paths (it never uses :mod:`.row_math`): the
teacher's top-k are scattered into a dense ``[N, V + 1]`` *coarsened* distribution whose last
column is the tail bucket, the student is coarsened the same way (its probabilities on the
top-k ids, and its mass outside them in the last column), and the divergence is the textbook
formula on those two vectors; torch autograd supplies every gradient. Use it in float64 as the
ground truth for tests, and as the ``impl="dense"`` baseline (memory ``O(N * V)``).
"""

from __future__ import annotations

import math

import torch

from .spec import LOG_FLOOR, LossSpec, given
from .validation import Prepared


def _xlogy_diff(a: torch.Tensor, log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """``sum a * (log a - log b)`` with ``0 * (...) = 0``."""
    zero = torch.zeros((), dtype=a.dtype, device=a.device)
    return torch.where(a > 0, a * (log_a - log_b), zero).sum(-1)


def dense_row_losses(spec: LossSpec, prep: Prepared) -> torch.Tensor:
    """Per-row loss ``T**2 * D(teacher, student) + ce_weight * CE`` (0 on rows not counted)."""
    work = prep.work_dtype
    logits = prep.hidden @ prep.weight.t()
    if prep.bias is not None:
        logits = logits + prep.bias
    logits = logits.to(work)
    n, vocab = logits.shape
    z = logits / spec.temperature
    logq = torch.log_softmax(z, dim=-1)
    in_s = torch.zeros(n, vocab, dtype=torch.bool, device=z.device).scatter_(1, prep.ids, True)
    floor = torch.full((), LOG_FLOOR, dtype=work, device=z.device)
    neg_inf = torch.full((), -math.inf, dtype=work, device=z.device)
    lp_dense = torch.full((n, vocab), -math.inf, dtype=work, device=z.device)
    lp_dense = lp_dense.scatter(1, prep.ids, prep.logprobs)

    if spec.loss == "renormalized_kl":
        log_pt = torch.log_softmax(lp_dense, dim=-1)
        log_qt = torch.log_softmax(torch.where(in_s, z, neg_inf), dim=-1)
        kd = _xlogy_diff(log_pt.exp(), log_pt, torch.where(in_s, log_qt, floor))
    else:
        log_qo = torch.logsumexp(torch.where(in_s, neg_inf, z), dim=-1) - torch.logsumexp(z, -1)
        log_qo = torch.maximum(log_qo, floor)
        p_dense = lp_dense.exp()
        if spec.uses_tail_bucket:
            if prep.tail is not None:
                p_o = prep.tail
            else:
                p_o = (1.0 - p_dense.sum(-1)).clamp(0.0, 1.0)
        else:
            p_o = torch.zeros(n, dtype=work, device=z.device)
        # coarsened distributions over [V ids in S | tail bucket]
        pc = torch.cat([p_dense, p_o[:, None]], dim=1)
        log_pc = torch.cat(
            [
                torch.maximum(lp_dense, floor),
                torch.maximum(p_o.clamp_min(1e-30).log(), floor)[:, None],
            ],
            dim=1,
        )
        qc = torch.cat([torch.where(in_s, logq.exp(), 0.0), log_qo.exp()[:, None]], dim=1)
        log_qc = torch.cat([torch.where(in_s, logq, floor), log_qo[:, None]], dim=1)
        if spec.loss == "forward_kl":
            kd = _xlogy_diff(pc, log_pc, log_qc)
        elif spec.loss == "reverse_kl":
            kd = _xlogy_diff(qc, log_qc, log_pc)
        else:
            b = spec.beta
            log_m = torch.logaddexp(math.log(b) + log_pc, math.log1p(-b) + log_qc)
            kd = b * _xlogy_diff(pc, log_pc, log_m) + (1 - b) * _xlogy_diff(qc, log_qc, log_m)
    rows = kd * spec.temperature**2
    if spec.ce_weight > 0.0:
        labels, has_label = given(prep.labels, "labels"), given(prep.has_label, "has_label")
        ce = -torch.log_softmax(logits, dim=-1).gather(1, labels[:, None]).squeeze(1)
        rows = rows + spec.ce_weight * ce * has_label.to(work)
    return torch.where(prep.valid, rows, torch.zeros((), dtype=work, device=rows.device))

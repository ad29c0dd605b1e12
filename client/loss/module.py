"""``TopKDistillLoss``: the :func:`topk_distill_loss` options bound in an ``nn.Module``."""

from __future__ import annotations

import torch
from torch import nn

from .api import topk_distill_loss
from .dispatch import check_chunk_size, resolve_impl
from .spec import REDUCTIONS, LossInputError, LossSpec


class TopKDistillLoss(nn.Module):
    """Module face of :func:`topk_distill_loss` (same options and formulas; no parameters).

    ``forward(hidden, weight, topk_ids, topk_logprobs, tail_mass=None, *, bias=None,
    labels=None, mask=None)`` returns the loss. Options are checked at construction.
    """

    def __init__(
        self,
        loss: str = "forward_kl",
        *,
        beta: float = 0.5,
        temperature: float = 1.0,
        ce_weight: float = 0.0,
        ignore_index: int = -100,
        reduction: str = "mean",
        impl: str = "auto",
        chunk_size: int | None = None,
        check_ids: bool = True,
    ) -> None:
        super().__init__()
        LossSpec(loss=loss, beta=beta, temperature=temperature, ce_weight=ce_weight)
        if reduction not in REDUCTIONS:
            raise LossInputError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        resolve_impl(impl, reduction)
        check_chunk_size(chunk_size)
        self.options = dict(
            loss=loss,
            beta=beta,
            temperature=temperature,
            ce_weight=ce_weight,
            ignore_index=ignore_index,
            reduction=reduction,
            impl=impl,
            chunk_size=chunk_size,
            check_ids=check_ids,
        )

    def forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_logprobs: torch.Tensor,
        tail_mass: torch.Tensor | None = None,
        *,
        bias: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return topk_distill_loss(
            hidden,
            weight,
            topk_ids,
            topk_logprobs,
            tail_mass,
            bias=bias,
            labels=labels,
            mask=mask,
            **self.options,
        )

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())

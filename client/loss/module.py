"""``TopKDistillLoss`` (the loss options bound in a module) and ``TopKDistillHead`` (the loss
computed inside a module that owns the lm-head, so that FSDP2 ``fully_shard`` unshards it)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .api import topk_distill_loss
from .dispatch import check_options
from .spec import LossSpec
from .vocab_parallel import VocabParallel


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
        targets: str = "topk",
        grad_weight_dtype: str = "auto",
        vocab_parallel: VocabParallel | None = None,
        kernels: str = "auto",
    ) -> None:
        super().__init__()
        LossSpec(loss=loss, beta=beta, temperature=temperature, ce_weight=ce_weight)
        check_options(reduction, chunk_size, grad_weight_dtype, kernels, impl)
        self.options: dict[str, Any] = dict(
            loss=loss,
            beta=beta,
            temperature=temperature,
            ce_weight=ce_weight,
            ignore_index=ignore_index,
            reduction=reduction,
            impl=impl,
            chunk_size=chunk_size,
            check_ids=check_ids,
            targets=targets,
            grad_weight_dtype=grad_weight_dtype,
            vocab_parallel=vocab_parallel,
            kernels=kernels,
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


class TopKDistillHead(nn.Module):
    """The student's lm-head (an ``nn.Linear(d, V)``) with the distillation loss as its forward.

    ``forward(hidden, topk_ids, topk_logprobs, tail_mass=None, *, labels=None, mask=None)``
    returns :func:`topk_distill_loss` on ``self.lm_head.weight`` (and bias) with the options
    given here. Because the loss runs *inside* this module's forward, the usual wrappers see the
    lm-head used: FSDP2 ``fully_shard(head)`` all-gathers the weight before the loss and
    reduce-scatters its gradient after backward; torch ``ColwiseParallel`` on ``head.lm_head``
    makes the weight a ``Shard(0)`` DTensor, which the loss runs vocab-parallel.
    """

    def __init__(self, lm_head: nn.Linear, **loss_options: Any) -> None:
        super().__init__()
        self.lm_head = lm_head
        self.loss = TopKDistillLoss(**loss_options)

    def forward(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_logprobs: torch.Tensor,
        tail_mass: torch.Tensor | None = None,
        *,
        labels: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.loss(
            hidden,
            self.lm_head.weight,
            topk_ids,
            topk_logprobs,
            tail_mass,
            bias=self.lm_head.bias,
            labels=labels,
            mask=mask,
        )

"""Fused chunked distillation loss against cached sparse top-k teacher targets.

``topk_distill_loss`` (function) and ``TopKDistillLoss`` (module) take student hidden states
and the lm-head weight and never build the full ``[N, V]`` logits (``impl="fused_chunked"``,
the default); ``"dense"`` and ``"forward_chunked"`` are the same objective computed the simple
ways, for reference and comparison. See :func:`topk_distill_loss` for the formulas.
"""

from .api import topk_distill_loss
from .module import TopKDistillLoss
from .spec import LOSS_KINDS, LossInputError, LossSpec

__all__ = ["LOSS_KINDS", "LossInputError", "LossSpec", "TopKDistillLoss", "topk_distill_loss"]

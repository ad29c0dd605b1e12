"""Fused chunked distillation loss against cached sparse top-k teacher targets.

``topk_distill_loss`` (function) and ``TopKDistillLoss`` (module) take student hidden states
and the lm-head weight and never build the full ``[N, V]`` logits (``impl="fused_chunked"``,
the default); ``"dense"`` and ``"forward_chunked"`` are the same objective computed the simple
ways, for reference and comparison; ``"small_vocab"`` computes it on the full logits, the
default on the CPU when ``N x V`` is small (about 1K vocabulary entries). See
:func:`topk_distill_loss` for the formulas.
A lm-head split along the vocabulary over a tensor-parallel group runs through the same fused
path (``vocab_parallel=VocabParallel(group)`` or a ``Shard(0)`` DTensor weight);
``TopKDistillHead`` computes the loss inside a module that owns the lm-head (for FSDP2).
``exact_distill_loss`` is the exact objective: the teacher's full distribution rebuilt chunk by
chunk from its final hidden states and its output head (forward/reverse KL, JSD at any
temperature), with the same chunking and errors.
"""

from .api import topk_distill_loss
from .chunk_ops import TRITON_AVAILABLE
from .exact import EXACT_LOSS_KINDS, exact_distill_loss
from .exact_kernels import ExactKernelConfig
from .module import TopKDistillHead, TopKDistillLoss
from .spec import LOSS_KINDS, TARGET_KINDS, LossInputError, LossSpec
from .vocab_parallel import VocabParallel

__all__ = [
    "EXACT_LOSS_KINDS",
    "ExactKernelConfig",
    "LOSS_KINDS",
    "TARGET_KINDS",
    "LossInputError",
    "LossSpec",
    "TRITON_AVAILABLE",
    "TopKDistillHead",
    "TopKDistillLoss",
    "VocabParallel",
    "exact_distill_loss",
    "topk_distill_loss",
]

"""Choosing the implementation and the chunk size."""

from __future__ import annotations

import torch

from .spec import IMPLS, LossInputError

#: Bytes of one chunk's logits buffer that the automatic chunk size aims at.
CHUNK_BUDGET_BYTES_GPU = 1 << 30
CHUNK_BUDGET_BYTES_CPU = 64 << 20
_ROW_MULTIPLE = 256


def resolve_impl(impl: str, reduction: str) -> str:
    """The concrete implementation for ``impl`` ("auto" is the fused chunked path)."""
    if impl not in IMPLS:
        raise LossInputError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        impl = "fused_chunked"
    if impl == "fused_chunked" and reduction == "none":
        impl = "fused_chunked_recompute"  # per-row grad_output is only known in backward
    return impl


def auto_chunk_size(n_rows: int, vocab: int, dtype: torch.dtype, device: torch.device) -> int:
    """Rows per chunk so that one chunk of logits is about the budget (a multiple of 256).

    On CUDA the budget is 1 GiB of logits in their own dtype (the Triton passes need no other
    ``[chunk, V]`` buffer): 4096 rows at V=128256 in bf16. On CPU the torch path also keeps
    float32 temporaries, so the budget is 64 MiB counted at 4 bytes per logit.
    """
    if device.type == "cuda":
        per_row = vocab * torch.finfo(dtype).bits // 8
        budget = CHUNK_BUDGET_BYTES_GPU
    else:
        per_row = vocab * 4
        budget = CHUNK_BUDGET_BYTES_CPU
    rows = max(_ROW_MULTIPLE, budget // per_row // _ROW_MULTIPLE * _ROW_MULTIPLE)
    return max(1, min(rows, n_rows))


def check_chunk_size(chunk_size: int | None) -> None:
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise LossInputError(f"chunk_size must be a positive int or None, got {chunk_size!r}")

"""Shared helpers of the sampled-targets tests: random teacher rows over a small vocabulary."""

from __future__ import annotations

import torch

V = 64


def teacher_rows(rows: int, seed: int = 0, scale: float = 2.5) -> torch.Tensor:
    """``[rows, V]`` teacher log-probabilities from scaled normal logits (seeded)."""
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(rows, V, generator=g) * scale, -1)

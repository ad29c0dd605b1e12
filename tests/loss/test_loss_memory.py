"""The fused loss holds one chunk at a time: its peak does not grow with the number of chunks.

Measured on the CPU with ``memory_support.LiveBytes`` (a dispatch mode counting the
bytes of every tensor the loss creates, until freed). A buffer of one chunk that outlived its
chunk (the logits, the ``[C, k]`` row terms, a float32 ``grad_W`` accumulator) would make the
peak grow with N beyond the ``grad_h`` rows, or exceed the bound below.
"""

from __future__ import annotations

import torch
from logitcache.client.loss import topk_distill_loss
from memory_support import LiveBytes

D, V, K, C = 16, 512, 8, 64


def peak_bytes(n: int, grad_weight_dtype: str = "weight") -> int:
    g = torch.Generator().manual_seed(n)
    h = torch.randn(n, D, generator=g).requires_grad_()
    w = (torch.randn(V, D, generator=g) * 0.3).requires_grad_()
    ids = torch.rand(n, V, generator=g).topk(K, dim=1).indices
    lp = torch.log_softmax(torch.randn(n, K, generator=g).sort(1, descending=True).values, -1)
    mode = LiveBytes().known(h, w, ids, lp)
    with mode:
        topk_distill_loss(
            h, w, ids, lp - 0.1, chunk_size=C, grad_weight_dtype=grad_weight_dtype, check_ids=False
        ).backward()
    return mode.peak


def test_peak_is_one_chunk_whatever_the_number_of_chunks() -> None:
    p4, p16 = peak_bytes(4 * C), peak_bytes(16 * C)
    grad_h_rows = 12 * C * D * 4  # the extra rows of grad_h (float32)
    per_row = 64  # [N]-sized bookkeeping (masks, counts): a few bytes per row
    assert 0 < p16 - p4 - grad_h_rows <= 12 * C * per_row, (p4, p16)
    # grads + the chunk's logits and, on the torch path, one float32 [C, V] temporary + row terms
    bound = 4 * C * D * 4 + V * D * 4 + 2 * C * V * 4 + 16 * C * K * 4 + 4 * C * per_row
    assert p4 <= bound, (p4, bound)

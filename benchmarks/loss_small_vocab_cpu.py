"""The sparse distillation loss vs a full-vocabulary dense KL at the tiny fixture's shapes, on
one CPU thread (issue #12: why offline steps are ~0.6x of online KD's on the tiny setup).

Shapes of ``examples/distill.py``'s training step: 512 rows (4 x 128 tokens), student hidden
128, vocabulary 1,024, k = 128 (top-k) and 174 (a trimmed 384-draw sampled batch). Prints the
median of 30 forward + backward passes of ``topk_distill_loss`` for each ``impl`` and of a dense
full-vocabulary loss (student log-softmax over V times fixed targets), which is what online KD
computes beside its teacher forward, and of a gather-based forward KL with the tail bucket
(full student log-softmax, gathered at the ids; not a package impl: a sketch of what a
small-vocabulary impl could cost).

    .venv/bin/python benchmarks/loss_small_vocab_cpu.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from logitcache.client.loss import topk_distill_loss

ROWS, HIDDEN, VOCAB, REPEATS = 512, 128, 1024, 30


def median_ms(fn: Callable[[], torch.Tensor]) -> float:
    """Median wall time of ``fn().backward()`` over :data:`REPEATS` runs, in ms."""
    times = []
    for _ in range(REPEATS):
        t = time.perf_counter()
        fn().backward()
        times.append(time.perf_counter() - t)
    return sorted(times)[REPEATS // 2] * 1e3


def gather_kl(
    h: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, lp: torch.Tensor, tail: torch.Tensor
) -> torch.Tensor:
    """Forward KL over [top-k ids | tail bucket] from the full student log-softmax."""
    logq = (h @ w.T).log_softmax(-1)
    lq = logq.gather(1, ids)
    lqo = torch.log1p(-lq.exp().sum(-1).clamp(max=1 - 1e-6))
    kd = (lp.exp() * (lp - lq)).sum(-1)
    return (kd + torch.xlogy(tail, tail) - tail * lqo).sum()


def main() -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(ROWS, HIDDEN, generator=g, requires_grad=True)
    w = torch.randn(VOCAB, HIDDEN, generator=g, requires_grad=True)
    for k in (128, 174):
        ids = torch.stack([torch.randperm(VOCAB, generator=g)[:k] for _ in range(ROWS)])
        lp = torch.log_softmax(torch.randn(ROWS, k, generator=g), -1)
        tail = torch.zeros(ROWS)
        for impl in ("auto", "dense", "forward_chunked", "fused_chunked"):
            args = (h, w, ids, lp, tail)
            ms = median_ms(lambda a=args, i=impl: topk_distill_loss(*a, impl=i))
            print(f"k={k} topk_distill_loss impl={impl}: {ms:.2f} ms")
        ms = median_ms(lambda a=(h, w, ids, lp, tail + 0.05): gather_kl(*a))
        print(f"k={k} gather-based sketch: {ms:.2f} ms")
    target = torch.softmax(torch.randn(ROWS, VOCAB, generator=g), -1)
    ms = median_ms(lambda: -(target * (h @ w.T).log_softmax(-1)).sum())
    print(f"full-vocabulary dense loss: {ms:.2f} ms")


if __name__ == "__main__":
    main()

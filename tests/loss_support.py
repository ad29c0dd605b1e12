"""Random distillation problems for the loss tests (CPU, deterministic)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Problem:
    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor
    ids: torch.Tensor
    logprobs: torch.Tensor
    tail: torch.Tensor
    labels: torch.Tensor
    mask: torch.Tensor

    def leaves(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.hidden, self.weight, self.bias


def make_problem(
    n: int = 24,
    d: int = 16,
    vocab: int = 40,
    k: int = 6,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
    logit_scale: float = 1.0,
    lead: tuple[int, ...] | None = None,
) -> Problem:
    """Teacher: top-k of a random distribution, logprobs ``log_softmax(...) + log M`` with
    ``M ~ U(0.8, 0.95)``; tail = 1 - M. Student logits have std about ``2 * logit_scale``.
    Row 1 has an ignored label, row 2 is masked out (when n > 2)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, d, generator=g, dtype=torch.float64) * (2 * logit_scale / d**0.5)
    bias = torch.randn(vocab, generator=g, dtype=torch.float64) * 0.1
    scores = torch.rand(n, vocab, generator=g, dtype=torch.float64)
    ids = scores.topk(k, dim=1).indices
    mass = torch.rand(n, 1, generator=g, dtype=torch.float64) * 0.15 + 0.8
    raw = torch.randn(n, k, generator=g, dtype=torch.float64) * 2
    logprobs = torch.log_softmax(raw.sort(dim=1, descending=True).values, -1) + mass.log()
    tail = (1 - logprobs.exp().sum(-1)).clamp(0, 1)
    labels = torch.randint(0, vocab, (n,), generator=g)
    mask = torch.ones(n, dtype=torch.bool)
    if n > 2:
        labels[1] = -100
        mask[2] = False
    shape = (n,) if lead is None else lead

    def leaf(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype).requires_grad_()

    return Problem(
        hidden=leaf(hidden.reshape(*shape, d)),
        weight=leaf(weight),
        bias=leaf(bias),
        ids=ids.reshape(*shape, k),
        logprobs=logprobs.reshape(*shape, k).float(),
        tail=tail.reshape(shape).float(),
        labels=labels.reshape(shape),
        mask=mask.reshape(shape),
    )


def run(prob: Problem, **kw: object) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Loss value and the gradients of (hidden, weight, bias) for one call."""
    from logitcache.client.loss import topk_distill_loss

    for t in prob.leaves():
        t.grad = None
    kw.setdefault("bias", prob.bias)
    out = topk_distill_loss(prob.hidden, prob.weight, prob.ids, prob.logprobs, **kw)
    out.sum().backward()
    return out.detach(), [t.grad.clone() for t in prob.leaves()]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def sample_targets(
    p: torch.Tensor, draws: int, m: int, tau: float = 1.0, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random-sampling KD rows from teacher probabilities ``p [R, V]`` (the #12 contract).

    Draw ``draws`` ids per row from ``q ∝ p^(1/tau)``; keep the distinct ones with weights
    ``w ∝ count * p / q`` (normalised); pad to ``m`` columns with unused ids and ``log w = -inf``.
    Returns ``ids [R, m]`` (int64, distinct per row) and ``log w [R, m]`` (float64).
    """
    rows, vocab = p.shape
    q = p.pow(1.0 / tau)
    q = q / q.sum(-1, keepdim=True)
    picks = torch.multinomial(q, draws, replacement=True, generator=generator)
    counts = torch.zeros(rows, vocab, dtype=torch.float64).scatter_add_(
        1, picks, torch.ones(rows, draws, dtype=torch.float64)
    )
    w = counts * p / q
    w = w / w.sum(-1, keepdim=True)
    # sampled ids first (largest weight first), then unused ids as padding
    order = torch.where(counts > 0, w, -1.0 - torch.arange(vocab, dtype=torch.float64))
    ids = order.argsort(dim=1, descending=True)[:, :m]
    logw = w.gather(1, ids).log()  # exactly -inf on padding (weight 0)
    if bool((counts > 0).sum(-1).max() > m):
        raise ValueError("m is smaller than the number of distinct sampled ids")
    return ids, logw

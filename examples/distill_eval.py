"""Held-out quality of a student against its teacher: full-vocabulary KL and perplexity.

For held-out windows ``x_0 .. x_{T-1}`` (non-overlapping windows spread over the held-out token
stream, the same windows for every student), position ``t < T-1`` predicts ``x_{t+1}``:

* ``kl``  = mean over positions of ``KL(p_teacher || q_student) = sum_v p(v) (log p(v) - log q(v))``
  over the **whole vocabulary** (teacher run in PyTorch on the same windows, never the cache);
* ``ppl`` = ``exp(mean_t -log q(x_{t+1} | x_0..x_t))``, the student's perplexity;
* ``ece`` = expected calibration error of the student's top-1 prediction: positions binned by
  confidence ``c_t = max_v q(v)`` into :data:`ECE_BINS` equal-width bins ``B_b``,
  ``ECE = sum_b |B_b| / n * |acc(B_b) - conf(B_b)|`` with ``acc`` the share of positions whose
  argmax is ``x_{t+1}`` and ``conf`` the mean ``c_t`` of the bin;
* ``teacher_ppl`` (and the teacher's own ``teacher_ece``) on the same windows, for reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

#: Confidence bins of the expected calibration error.
ECE_BINS = 15


class Calibration:
    """Running per-bin counts of top-1 confidence and correctness (see the module docstring)."""

    def __init__(self, bins: int = ECE_BINS):
        self.count = np.zeros(bins)
        self.conf = np.zeros(bins)
        self.correct = np.zeros(bins)

    def add(self, logprobs: torch.Tensor, labels: torch.Tensor) -> None:
        """``logprobs [..., V]`` of a model, ``labels [...]`` the next tokens."""
        top_lp, top_id = logprobs.max(-1)
        conf = top_lp.exp().double().flatten().numpy()
        hit = (top_id == labels).flatten().numpy()
        b = np.minimum((conf * len(self.count)).astype(np.int64), len(self.count) - 1)
        np.add.at(self.count, b, 1)
        np.add.at(self.conf, b, conf)
        np.add.at(self.correct, b, hit)

    def ece(self) -> float:
        n = self.count.sum()
        gap = np.abs(self.correct - self.conf)  # |B| * |acc - conf| per bin
        return float(gap.sum() / n) if n else 0.0


@dataclass(frozen=True)
class HeldoutSet:
    """Held-out windows ``[n, T]`` (int64) and the teacher's log-probs over them (computed once)."""

    windows: torch.Tensor
    teacher_logprobs: list[torch.Tensor]  # per eval batch: [b, T-1, V] float32 (or bf16)
    teacher_ppl: float
    batch_size: int
    teacher_ece: float = 0.0

    @property
    def num_positions(self) -> int:
        return int(self.windows.shape[0] * (self.windows.shape[1] - 1))


def make_heldout(
    teacher: Any, stream: np.ndarray, window: int, max_tokens: int, batch_size: int = 16
) -> HeldoutSet:
    """``max_tokens // window`` non-overlapping windows spread evenly over the whole of
    ``stream`` (:func:`logitcache.fixtures.tiny.eval_windows`: docstrings, docs and sources in
    proportion), and the teacher run on them once."""
    from logitcache.fixtures.tiny import eval_windows

    if min(len(stream), max_tokens) < window:
        raise ValueError(f"held-out stream of {len(stream)} tokens is shorter than one window")
    windows = torch.from_numpy(eval_windows(stream, window, max_tokens))
    teacher.eval()
    logprobs, nll, count = [], 0.0, 0
    cal = Calibration()
    with torch.no_grad():
        for batch in windows.split(batch_size):
            lp = F.log_softmax(teacher(input_ids=batch).logits[:, :-1].float(), dim=-1)
            nll -= float(lp.gather(-1, batch[:, 1:, None]).sum())
            count += batch[:, 1:].numel()
            cal.add(lp, batch[:, 1:])
            logprobs.append(lp)
    return HeldoutSet(windows, logprobs, math.exp(nll / count), batch_size, cal.ece())


def evaluate(student: Any, held: HeldoutSet) -> dict[str, float]:
    """``{"kl", "ppl", "nll", "ece"}`` of ``student`` on ``held`` (see the module docstring)."""
    student.eval()
    kl_sum, nll_sum, count = 0.0, 0.0, 0
    cal = Calibration()
    with torch.no_grad():
        batches = held.windows.split(held.batch_size)
        for batch, t_lp in zip(batches, held.teacher_logprobs, strict=True):
            s_lp = F.log_softmax(student(input_ids=batch).logits[:, :-1].float(), dim=-1)
            kl_sum += float((t_lp.exp() * (t_lp - s_lp)).sum())
            nll_sum -= float(s_lp.gather(-1, batch[:, 1:, None]).sum())
            count += batch[:, 1:].numel()
            cal.add(s_lp, batch[:, 1:])
    student.train()
    return {
        "kl": kl_sum / count,
        "nll": nll_sum / count,
        "ppl": math.exp(nll_sum / count),
        "ece": cal.ece(),
    }

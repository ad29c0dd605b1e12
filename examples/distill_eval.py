"""Held-out quality of a student against its teacher: full-vocabulary KL and perplexity.

For held-out windows ``x_0 .. x_{T-1}`` (non-overlapping windows of the held-out token stream, the
same windows for every student), position ``t < T-1`` predicts ``x_{t+1}``:

* ``kl``  = mean over positions of ``KL(p_teacher || q_student) = sum_v p(v) (log p(v) - log q(v))``
  over the **whole vocabulary** (teacher run in PyTorch on the same windows, never the cache);
* ``ppl`` = ``exp(mean_t -log q(x_{t+1} | x_0..x_t))``, the student's perplexity;
* ``teacher_ppl`` on the same windows, for reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class HeldoutSet:
    """Held-out windows ``[n, T]`` (int64) and the teacher's log-probs over them (computed once)."""

    windows: torch.Tensor
    teacher_logprobs: list[torch.Tensor]  # per eval batch: [b, T-1, V] float32 (or bf16)
    teacher_ppl: float
    batch_size: int

    @property
    def num_positions(self) -> int:
        return int(self.windows.shape[0] * (self.windows.shape[1] - 1))


def make_heldout(
    teacher: Any, stream: np.ndarray, window: int, max_tokens: int, batch_size: int = 16
) -> HeldoutSet:
    """Cut ``stream`` into ``max_tokens // window`` windows and run the teacher on them once."""
    n = min(len(stream), max_tokens) // window
    if n == 0:
        raise ValueError(f"held-out stream of {len(stream)} tokens is shorter than one window")
    windows = torch.from_numpy(stream[: n * window].astype(np.int64)).view(n, window)
    teacher.eval()
    logprobs, nll, count = [], 0.0, 0
    with torch.no_grad():
        for batch in windows.split(batch_size):
            lp = F.log_softmax(teacher(input_ids=batch).logits[:, :-1].float(), dim=-1)
            nll -= float(lp.gather(-1, batch[:, 1:, None]).sum())
            count += batch[:, 1:].numel()
            logprobs.append(lp)
    return HeldoutSet(windows, logprobs, math.exp(nll / count), batch_size)


def evaluate(student: Any, held: HeldoutSet) -> dict[str, float]:
    """``{"kl", "ppl", "nll"}`` of ``student`` on ``held`` (see the module docstring)."""
    student.eval()
    kl_sum, nll_sum, count = 0.0, 0.0, 0
    with torch.no_grad():
        batches = held.windows.split(held.batch_size)
        for batch, t_lp in zip(batches, held.teacher_logprobs, strict=True):
            s_lp = F.log_softmax(student(input_ids=batch).logits[:, :-1].float(), dim=-1)
            kl_sum += float((t_lp.exp() * (t_lp - s_lp)).sum())
            nll_sum -= float(s_lp.gather(-1, batch[:, 1:, None]).sum())
            count += batch[:, 1:].numel()
    student.train()
    return {"kl": kl_sum / count, "nll": nll_sum / count, "ppl": math.exp(nll_sum / count)}

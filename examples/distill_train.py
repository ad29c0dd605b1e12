"""Train copies of one student with different objectives on the same stream, step by step.

Methods (every one reads the same ``CacheDataset`` stream: same seed, same data order, same
initial weights, same AdamW settings and schedule; position ``t`` of an item is trained against
``labels[t] = x_{t+1}`` and cache row ``t``, rows outside ``loss_mask`` never count):

* ``ce``: no distillation, ``mean_t -log q(x_{t+1})`` (hard labels only);
* ``online_kd``: the teacher (PyTorch, full model) runs on the batch at every step and the loss is
  the full-vocabulary ``mean_t KL(p_teacher || q_student)``;
* ``offline_topk``: ``topk_distill_loss`` (impl ``fused_chunked``) on the cached top-k without the
  tail mass: ``sum_{v in S} p_v log(p_v / q_v)``;
* ``offline_topk_tail``: the same with the cached tail mass as one more bucket:
  ``sum_S p_v log(p_v / q_v) + P_o log(P_o / Q_o)``;
* ``offline_sampled``: random-sampling KD (Anshumann et al. 2025) from a ``targets="sampled"``
  cache: ``sum_i w_i (log w_i - log q_i)`` over the sampled ids with importance weights ``w``
  (FORMAT.md 4.4), ``topk_distill_loss(..., targets="sampled")``.

A method spec may carry ``@n``: ``offline_topk@32`` / ``offline_topk_tail@32`` train from a
``k = 32`` cache, ``offline_sampled@24`` from a cache of 24 draws per row (``distill.py`` derives
these caches and measures their bytes on disk).

Runs are **interleaved**: step ``s`` of every method, then step ``s + 1``, so that a shared,
noisily loaded machine slows every method alike and the step-time ratios stay meaningful.
``step_s`` is the compute of one step (forward, backward, optimizer), ``data_s`` the time blocked
waiting for the next batch; the online teacher's forward is part of ``online_kd``'s step.
``step_cpu_s`` is the same step's CPU time in the training thread (``time.thread_time``; with one
torch thread the forward, backward and optimizer all run there, while the dataset's read-ahead
threads do not count): on a shared machine it leaves out the time the step waited for a core.
``columns`` is the width of each batch's teacher columns (``topk_ids.shape[-1]``; for a sampled
cache the dataset may trim padding columns, so it can be below the cache's draws).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

METHODS = ("ce", "online_kd", "offline_topk", "offline_topk_tail", "offline_sampled")


def parse_method(spec: str) -> tuple[str, int | None]:
    """``"offline_topk_tail@16"`` -> ``("offline_topk_tail", 16)``: an offline method trained on
    a ``k = 16`` cache (the first 16 columns of the scored cache's rows); ``"offline_sampled@24"``
    -> ``("offline_sampled", 24)``: a sampled cache of 24 draws per row (``@n`` required)."""
    base, _, k = spec.partition("@")
    if base not in METHODS:
        raise ValueError(f"unknown method {spec!r}; choose from {METHODS} (offline ones @k)")
    if not k:
        if base == "offline_sampled":
            raise ValueError(f"bad method {spec!r}: offline_sampled needs @draws, e.g. @24")
        return base, None
    if not base.startswith("offline") or not k.isdigit() or int(k) < 1:
        raise ValueError(f"bad method {spec!r}: only offline methods take @k with k >= 1")
    return base, int(k)


@dataclass(frozen=True)
class TrainSettings:
    """Optimisation settings shared by every method."""

    steps: int = 300
    lr: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    clip: float = 1.0
    chunk_size: int | None = None

    def lr_factor(self, step: int) -> float:
        """Linear warm-up, then cosine decay to 10% at the last step."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        t = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))


def _body(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Final hidden states ``[B, T, d]``. Packed items pass ``position_ids`` and no attention
    mask, so transformers builds the block-diagonal causal mask from them (no cross-document
    attention)."""
    out = model.model(
        input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
    )
    return out.last_hidden_state


def _masked_mean(rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (rows * mask).sum() / mask.sum().clamp_min(1)


def loss_fn(method: str, teacher: Any, settings: TrainSettings) -> Callable[..., torch.Tensor]:
    """``f(student, batch) -> scalar loss`` for one method (see the module docstring)."""
    from logitcache.client.loss import topk_distill_loss

    def ce(student: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = student.lm_head(_body(student, batch))
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)

    def online_kd(student: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            t_lp = F.log_softmax(teacher.lm_head(_body(teacher, batch)), dim=-1)
        s_lp = F.log_softmax(student.lm_head(_body(student, batch)), dim=-1)
        kl = (t_lp.exp() * (t_lp - s_lp)).sum(-1)
        return _masked_mean(kl, batch["loss_mask"].to(kl.dtype))

    def offline(with_tail: bool, sampled: bool = False) -> Callable[..., torch.Tensor]:
        def f(student: Any, batch: dict[str, Any]) -> torch.Tensor:
            if sampled and batch.get("target_kind") != "sampled":
                raise ValueError("offline_sampled needs a targets='sampled' cache")
            return topk_distill_loss(
                _body(student, batch),
                student.lm_head.weight,
                batch["topk_ids"],
                batch["topk_logprobs"],
                batch["tail_mass"] if with_tail else None,
                mask=batch["loss_mask"],
                impl="fused_chunked",
                chunk_size=settings.chunk_size,
                **({"targets": "sampled"} if sampled else {}),
            )

        return f

    table = {
        "ce": ce,
        "online_kd": online_kd,
        "offline_topk": offline(False),
        "offline_topk_tail": offline(True),
        "offline_sampled": offline(False, sampled=True),
    }
    if method not in table:
        raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
    return table[method]


def epochs(make_dataset: Callable[[], Any]) -> Iterator[dict[str, torch.Tensor]]:
    """Batches of the dataset, epoch after epoch (``set_epoch`` reshuffles deterministically)."""
    ds = make_dataset()
    epoch = 0
    while True:
        ds.set_epoch(epoch)
        empty = True
        for batch in ds:
            empty = False
            yield batch
        if empty:
            raise ValueError("the cache yields no items")
        epoch += 1


@dataclass
class Run:
    """One method's student, optimizer, stream and step log."""

    method: str
    student: Any
    loss: Callable[..., torch.Tensor]
    optimizer: torch.optim.Optimizer
    scheduler: Any
    stream: Iterator[dict[str, torch.Tensor]]
    settings: TrainSettings
    losses: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    step_cpu_s: list[float] = field(default_factory=list)
    data_s: list[float] = field(default_factory=list)
    columns: list[int] = field(default_factory=list)
    rows: int = 0

    def step(self) -> None:
        t0 = time.perf_counter()
        batch = next(self.stream)
        t1 = time.perf_counter()
        c1 = time.thread_time()
        loss = self.loss(self.student, batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.student.parameters(), self.settings.clip)
        self.optimizer.step()
        self.scheduler.step()
        self.losses.append(float(loss.detach()))
        self.step_cpu_s.append(time.thread_time() - c1)
        self.step_s.append(time.perf_counter() - t1)
        self.data_s.append(t1 - t0)
        if "topk_ids" in batch:
            self.columns.append(int(batch["topk_ids"].shape[-1]))
        self.rows += int(batch["loss_mask"].sum())


def make_run(
    method: str,
    load_student: Callable[[], Any],
    make_dataset: Callable[[str], Any],
    teacher: Any,
    settings: TrainSettings,
) -> Run:
    """A fresh student (same initial weights for every method) on a fresh stream
    (``make_dataset(method)``: the method's cache, every cache holding the same sequences in the
    same order, so every method sees the same items in the same order)."""
    base, _ = parse_method(method)
    student = load_student()
    student.train()
    opt = torch.optim.AdamW(
        student.parameters(), lr=settings.lr, betas=(0.9, 0.95), weight_decay=settings.weight_decay
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, settings.lr_factor)
    stream = epochs(lambda: make_dataset(method))
    return Run(method, student, loss_fn(base, teacher, settings), opt, sched, stream, settings)


def train_interleaved(
    runs: list[Run], steps: int, log_every: int = 50, load_every: int = 10
) -> list[float]:
    """Step every run once per round, ``steps`` rounds. Returns the machine's 1-minute load
    average sampled every ``load_every`` rounds (``os.getloadavg``; empty where there is none)."""
    load: list[float] = []
    for s in range(steps):
        if load_every and s % load_every == 0 and hasattr(os, "getloadavg"):
            load.append(os.getloadavg()[0])
        for run in runs:
            run.step()
        if log_every and ((s + 1) % log_every == 0 or s + 1 == steps):
            parts = ", ".join(f"{r.method} {r.losses[-1]:.3f}" for r in runs)
            print(f"[train] step {s + 1}/{steps}: {parts}", flush=True)
    return load

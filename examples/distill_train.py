"""Train copies of one student with different objectives on the same stream, step by step.

Methods (every one reads the same ``CacheDataset`` stream: same seed, same data order, same
initial weights, same AdamW settings and schedule; position ``t`` of an item is trained against
``labels[t] = x_{t+1}`` and cache row ``t``, rows outside ``loss_mask`` never count):

* ``ce``: no distillation, ``mean_t -log q(x_{t+1})`` (hard labels only);
* ``online_kd``: the teacher (PyTorch, full model) runs on the batch at every step and the loss is
  the full-vocabulary ``mean_t KL(p_teacher || q_student)``;
* ``offline_topk``: ``topk_distill_loss`` (``TrainSettings.loss_impl``, default ``auto``) on
  the cached top-k without the tail mass: ``sum_{v in S} p_v log(p_v / q_v)``;
* ``offline_topk_tail``: the same with the cached tail mass as one more bucket:
  ``sum_S p_v log(p_v / q_v) + P_o log(P_o / Q_o)``;
* ``offline_sampled``: random-sampling KD (Anshumann et al. 2025) from a ``targets="sampled"``
  cache: ``sum_i w_i (log w_i - log q_i)`` over the sampled ids with importance weights ``w``
  (FORMAT.md 4.4), ``topk_distill_loss(..., targets="sampled")``;
* ``offline_exact``: exact distillation from a ``targets="hidden"`` cache (FORMAT.md 4.10): the
  batch's ``hidden`` rows (the teacher's final hidden states, stored bfloat16) and the head the
  cache stores (:func:`logitcache.client.load_head`) rebuild the teacher's full distribution
  chunk by chunk in ``exact_distill_loss``, the same ``mean_t KL(p_teacher || q_student)`` as
  ``online_kd`` without the teacher's network in the step (rows and head in float32 on this CPU).

Ablations (issue #12: why every offline method sits above online KD). Each builds its targets
from the LIVE teacher's ``log_softmax`` on the very batch the student trains on (the teacher's
forward is part of the step, as in ``online_kd``), then takes the same loss as its offline twin,
so only the source of the targets differs:

* ``online_topk@k`` / ``online_topk_tail@k``: the live teacher's top-k (+ the tail bucket),
  ``topk_distill_loss`` (the same impl), no storage, no float16 rounding;
* ``online_sampled@N``: ``N`` fresh draws per row at every step
  (:func:`logitcache.cache_format.sampling.sample_rows` on the live rows, uniforms from a
  generator seeded by ``(seed, step)``), the sampled loss; ``online_sampled_head@m+N``: the same
  with the teacher's top-``m`` kept exactly (``sample_rows(..., head=m)``);
* ``online_kd_f16``: ``online_kd`` against the teacher's log-probabilities rounded through
  float16 (the cache's storage dtype).

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

#: ``--loss-impl`` choices (``topk_distill_loss(impl=...)``).
LOSS_IMPLS = ("auto", "fused_chunked", "small_vocab", "forward_chunked", "dense")
METHODS = (
    "ce",
    "online_kd",
    "offline_topk",
    "offline_topk_tail",
    "offline_sampled",
    "offline_sampled_head",
    "offline_exact",
    "online_kd_f16",
    "online_topk",
    "online_topk_tail",
    "online_sampled",
    "online_sampled_head",
)
#: Methods that need ``@n`` (k or draws).
SIZED = (
    "offline_sampled",
    "offline_sampled_head",
    "online_topk",
    "online_topk_tail",
    "online_sampled",
    "online_sampled_head",
)


def parse_head(spec: str) -> tuple[int, int]:
    """``"online_sampled_head@32+96"`` (or ``offline_sampled_head@32+96``, from a cache of the
    head + residual estimator) -> ``(32, 96)``: head ``m`` and draws ``N``."""
    base, _, n = spec.partition("@")
    m, plus, draws = n.partition("+")
    if not (plus and m.isdigit() and draws.isdigit() and int(m) >= 1 and int(draws) >= 1):
        raise ValueError(f"bad method {spec!r}: {base} takes @m+N, e.g. @32+96")
    return int(m), int(draws)


def parse_method(spec: str) -> tuple[str, int | None]:
    """``"offline_topk_tail@16"`` -> ``("offline_topk_tail", 16)``: an offline method trained on
    a ``k = 16`` cache (the first 16 columns of the scored cache's rows); ``"offline_sampled@24"``
    -> ``("offline_sampled", 24)``: a sampled cache of 24 draws per row (``@n`` required).
    The live-teacher ablations ``online_topk@k``, ``online_topk_tail@k``, ``online_sampled@N``
    need ``@n`` too; ``online_sampled_head@m+N`` returns ``m + N`` (:func:`parse_head`)."""
    base, _, k = spec.partition("@")
    if base not in METHODS:
        raise ValueError(f"unknown method {spec!r}; choose from {METHODS} (offline ones @k)")
    if not k:
        if base in SIZED:
            raise ValueError(f"bad method {spec!r}: {base} needs @n, e.g. {base}@24")
        return base, None
    if base.endswith("_sampled_head"):
        m, n = parse_head(spec)
        return base, m + n
    if not (base.startswith("offline") or base in SIZED) or not k.isdigit() or int(k) < 1:
        raise ValueError(f"bad method {spec!r}: only offline and sized methods take @k >= 1")
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
    seed: int = 0  # the live sampled ablations' draws: uniforms seeded by (seed, step)
    loss_impl: str = "auto"  # topk_distill_loss impl of the sparse-target methods

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


def live_topk(t_lp: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """Top-``k`` targets of live teacher log-probabilities ``[..., V]``: the batch keys of a top-k
    cache (``topk_ids``, ``topk_logprobs`` float32, ``tail_mass = 1 - sum_topk p``)."""
    lp, ids = torch.topk(t_lp.float(), k, dim=-1)
    tail = (1.0 - lp.exp().sum(-1)).clamp_min(0.0)
    return {"topk_ids": ids, "topk_logprobs": lp, "tail_mass": tail}


def step_seed(seed: int, step: int) -> int:
    """63-bit generator seed of one step's draws (distinct per seed and step)."""
    from logitcache.cache_format.sampling import sequence_seed

    return sequence_seed(seed, f"step{step}")


def live_sampled(
    t_lp: torch.Tensor, draws: int, seed: int, step: int, head: int = 0
) -> dict[str, torch.Tensor]:
    """Fresh sampled targets of live teacher log-probabilities ``[B, T, V]``: ``draws`` draws
    per row (after the exact top-``head``), uniforms from the ``(seed, step)`` generator,
    :func:`~logitcache.cache_format.sampling.sample_rows` at ``tau = 1``; trailing all-padding
    columns dropped (as ``CacheDataset`` trims a sampled batch)."""
    from logitcache.cache_format.sampling import PAD_LOGPROB, sample_rows, seeded_uniforms

    b, t, v = t_lp.shape
    u = seeded_uniforms(step_seed(seed, step), b * t, draws)
    kw = {"head": head} if head else {}
    ids, lw = sample_rows(t_lp.reshape(b * t, v), u, 1.0, **kw)
    ids_t = torch.from_numpy(ids).long().reshape(b, t, -1)
    lw_t = torch.from_numpy(lw).reshape(b, t, -1)
    real = (lw_t > PAD_LOGPROB / 2).flatten(0, 1).any(0)
    width = int(real.nonzero().max()) + 1 if bool(real.any()) else 1
    return {"topk_ids": ids_t[..., :width], "topk_logprobs": lw_t[..., :width]}


def loss_fn(
    method: str, teacher: Any, settings: TrainSettings, head: dict[str, Any] | None = None
) -> Callable[..., torch.Tensor]:
    """``f(student, batch) -> scalar loss`` for one method (see the module docstring); ``method``
    is a spec (``online_topk_tail@128``) or a base name for the methods that take no ``@n``.
    ``head``: ``offline_exact``'s teacher head (``load_head``'s keyword arguments)."""
    from logitcache.client.loss import exact_distill_loss, topk_distill_loss

    base, n = parse_method(method) if "@" in method else (method, None)
    if base in SIZED and n is None:
        raise ValueError(f"{base} needs @n (got {method!r})")
    steps = [0]  # the sampled ablations' step counter (fresh draws per step)

    def teacher_lp(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            return F.log_softmax(teacher.lm_head(_body(teacher, batch)), dim=-1)

    def sparse(student: Any, batch: dict[str, Any], tgt: dict[str, Any], **kw: Any) -> Any:
        return topk_distill_loss(
            _body(student, batch),
            student.lm_head.weight,
            tgt["topk_ids"],
            tgt["topk_logprobs"],
            tgt.get("tail_mass"),
            mask=batch["loss_mask"],
            impl=settings.loss_impl,
            chunk_size=settings.chunk_size,
            **kw,
        )

    def ce(student: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = student.lm_head(_body(student, batch))
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)

    def online_kd(student: Any, batch: dict[str, torch.Tensor], f16: bool = False) -> Any:
        t_lp = teacher_lp(batch)
        if f16:  # the cache's storage rounding (not renormalised, as stored rows)
            t_lp = t_lp.to(torch.float16).float()
        s_lp = F.log_softmax(student.lm_head(_body(student, batch)), dim=-1)
        kl = (t_lp.exp() * (t_lp - s_lp)).sum(-1)
        return _masked_mean(kl, batch["loss_mask"].to(kl.dtype))

    def online_topk(with_tail: bool) -> Callable[..., torch.Tensor]:
        def f(student: Any, batch: dict[str, Any]) -> torch.Tensor:
            tgt = live_topk(teacher_lp(batch), int(n))
            if not with_tail:
                tgt.pop("tail_mass")
            return sparse(student, batch, tgt)

        return f

    def online_sampled(student: Any, batch: dict[str, Any]) -> torch.Tensor:
        head, draws = parse_head(method) if base == "online_sampled_head" else (0, int(n))
        tgt = live_sampled(teacher_lp(batch), draws, settings.seed, steps[0], head)
        steps[0] += 1
        return sparse(student, batch, tgt, targets="sampled")

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
                impl=settings.loss_impl,
                chunk_size=settings.chunk_size,
                **({"targets": "sampled"} if sampled else {}),
            )

        return f

    def exact(student: Any, batch: dict[str, Any]) -> torch.Tensor:
        if head is None or "hidden" not in batch:
            raise ValueError("offline_exact needs a targets='hidden' cache and its head")
        return exact_distill_loss(
            _body(student, batch),
            student.lm_head.weight,
            batch["hidden"].to(head["teacher_weight"].dtype),
            mask=batch["loss_mask"],
            chunk_size=settings.chunk_size,
            **head,
        )

    table = {
        "ce": ce,
        "online_kd": online_kd,
        "offline_topk": offline(False),
        "offline_topk_tail": offline(True),
        "offline_sampled": offline(False, sampled=True),
        "offline_sampled_head": offline(False, sampled=True),
        "offline_exact": exact,
        "online_kd_f16": lambda student, batch: online_kd(student, batch, f16=True),
        "online_topk": online_topk(False),
        "online_topk_tail": online_topk(True),
        "online_sampled": online_sampled,
        "online_sampled_head": online_sampled,
    }
    if base not in table:
        raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
    return table[base]


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
    head: dict[str, Any] | None = None,
) -> Run:
    """A fresh student (same initial weights for every method) on a fresh stream
    (``make_dataset(method)``: the method's cache, every cache holding the same sequences in the
    same order, so every method sees the same items in the same order); ``head``: the teacher
    head of ``offline_exact``'s hidden cache."""
    parse_method(method)
    student = load_student()
    student.train()
    opt = torch.optim.AdamW(
        student.parameters(), lr=settings.lr, betas=(0.9, 0.95), weight_decay=settings.weight_decay
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, settings.lr_factor)
    stream = epochs(lambda: make_dataset(method))
    loss = loss_fn(method, teacher, settings, head)
    return Run(method, student, loss, opt, sched, stream, settings)


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

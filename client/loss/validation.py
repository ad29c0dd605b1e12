"""Argument checks and canonical flattening for the distillation loss.

Every implementation receives a :class:`Prepared` bundle: rows flattened to ``[N, ...]``, ids as
int64, and rows that do not count (``mask`` false, or ``labels == ignore_index``) sanitised so
that garbage in padded rows (repeated ids, NaN logprobs) can neither fail nor poison the result.
All value checks run on the counted rows only and cost one host synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .row_math import logsumexp_ftz
from .spec import LossInputError

_LOGPROB_TOL = 1e-3  # cached logprobs may exceed 0 by rounding; more than this is an error
_TAIL_TOL = 1e-3
#: Sampled rows: ``|sum_i w_i - 1|`` above this is an error (float16 storage of ``log w`` can
#: move the sum by a few 1e-3); rows within it are renormalised exactly.
SAMPLED_SUM_TOL = 1e-2
DUPLICATE_IDS = "topk_ids has duplicate ids within a row"


@dataclass
class Prepared:
    """Canonical inputs: ``N`` rows, ``k`` targets per row, ``V`` vocabulary entries."""

    hidden: torch.Tensor  # [N, d], the caller's dtype
    weight: torch.Tensor  # [V, d]
    bias: torch.Tensor | None  # [V]
    ids: torch.Tensor  # [N, k] int64, distinct and in range on counted rows
    logprobs: torch.Tensor  # [N, k] working dtype (float32, or float64 for float64 inputs)
    tail: torch.Tensor | None  # [N] working dtype, in [0, 1]
    labels: torch.Tensor | None  # [N] int64, ignored rows clamped to 0
    has_label: torch.Tensor | None  # [N] bool: the CE term applies to this row
    valid: torch.Tensor  # [N] bool: the row counts
    n_valid: int
    lead_shape: tuple[int, ...]

    @property
    def work_dtype(self) -> torch.dtype:
        return self.logprobs.dtype

    @property
    def all_valid(self) -> bool:
        return self.n_valid == self.valid.numel()


def _lead(name: str, t: torch.Tensor, lead: tuple[int, ...], extra: tuple[int, ...] = ()) -> None:
    if tuple(t.shape) != lead + extra:
        raise LossInputError(f"{name} must have shape {lead + extra}, got {tuple(t.shape)}")


def _same_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise LossInputError(f"{name} is on {t.device}, hidden is on {device}")


def check_head(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    names: tuple[str, str, str] = ("hidden", "weight", "bias"),
) -> None:
    """Check ``hidden [..., d]``, ``weight [V, d]`` and ``bias [V]`` (same dtype and device);
    ``names`` name the three arguments in the errors."""
    nh, nw, nb = names
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2:
        raise LossInputError(f"{nh} must be a tensor of shape [..., d] with at least 2 dims")
    if not hidden.is_floating_point():
        raise LossInputError(f"{nh} must be floating point, got {hidden.dtype}")
    d = hidden.shape[-1]
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != d:
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight)
        raise LossInputError(f"{nw} must be [V, {d}], got {shape}")
    if weight.dtype != hidden.dtype:
        raise LossInputError(f"{nw} dtype {weight.dtype} != {nh} dtype {hidden.dtype}")
    _same_device(nw, weight, hidden.device)
    if bias is not None:
        _lead(nb, bias, (weight.shape[0],))
        if bias.dtype != hidden.dtype:
            raise LossInputError(f"{nb} dtype {bias.dtype} != {nh} dtype {hidden.dtype}")
        _same_device(nb, bias, hidden.device)


def counted_rows(
    lead: tuple[int, ...],
    labels: torch.Tensor | None,
    mask: torch.Tensor | None,
    ignore_index: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``valid [N]`` (the row counts: ``mask`` true and ``labels != ignore_index``) and the
    flattened int64 labels, after checking the shapes and devices of ``labels`` and ``mask``."""
    n = 1
    for s in lead:
        n *= s
    valid = torch.ones(n, dtype=torch.bool, device=device)
    flat_labels = None
    if labels is not None:
        _lead("labels", labels, lead)
        if labels.is_floating_point():
            raise LossInputError("labels must be an integer tensor")
        _same_device("labels", labels, device)
        flat_labels = labels.reshape(n).long()
        valid &= flat_labels != ignore_index
    if mask is not None:
        _lead("mask", mask, lead)
        _same_device("mask", mask, device)
        valid &= mask.reshape(n).bool()
    return valid, flat_labels


def prepare(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    tail_mass: torch.Tensor | None,
    bias: torch.Tensor | None,
    labels: torch.Tensor | None,
    mask: torch.Tensor | None,
    ignore_index: int,
    ce_weight: float,
    check_ids: bool = True,
    targets: str = "topk",
    vocab_global: int | None = None,
    sort_dups: bool = True,
) -> Prepared:
    """Check every argument and flatten it; raise :class:`LossInputError` on any problem.

    ``vocab_global``: the full vocabulary when ``weight`` (and ``bias``) hold one vocab-parallel
    shard; ids and labels are checked against it. With ``targets="sampled"`` each counted row's
    ``exp(topk_logprobs)`` must sum to 1 within :data:`SAMPLED_SUM_TOL` (``-inf`` padding is
    weight 0) and the log-weights are then renormalised to sum to exactly 1. ``sort_dups=False``
    leaves the duplicate-id part of ``check_ids`` to the caller (the small-vocabulary impl
    counts its ``[N, V]`` support mask instead of sorting the ids).
    """
    check_head(hidden, weight, bias)
    device = hidden.device
    lead = tuple(hidden.shape[:-1])
    d = hidden.shape[-1]
    vocab_local = weight.shape[0]
    vocab = vocab_local if vocab_global is None else vocab_global
    if topk_ids.dim() != len(lead) + 1 or topk_ids.is_floating_point() or topk_ids.is_complex():
        raise LossInputError(f"topk_ids must be an integer tensor [{lead}, k]")
    k = topk_ids.shape[-1]
    _lead("topk_ids", topk_ids, lead, (k,))
    if not 1 <= k <= vocab:
        raise LossInputError(f"k must be in [1, V={vocab}], got {k}")
    _lead("topk_logprobs", topk_logprobs, lead, (k,))
    if not topk_logprobs.is_floating_point():
        raise LossInputError("topk_logprobs must be floating point")
    for name, t in (("topk_ids", topk_ids), ("topk_logprobs", topk_logprobs)):
        _same_device(name, t, device)
    if tail_mass is not None:
        _lead("tail_mass", tail_mass, lead)
        _same_device("tail_mass", tail_mass, device)
    if ce_weight > 0.0 and labels is None:
        raise LossInputError("ce_weight > 0 needs labels")

    work = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    n = hidden.numel() // d
    ids = topk_ids.reshape(n, k).long()
    logprobs = topk_logprobs.reshape(n, k).to(work)
    valid, flat_labels = counted_rows(lead, labels, mask, ignore_index, device)
    has_label = None
    tail = None if tail_mass is None else tail_mass.reshape(n).to(work)

    problems = _find_problems(
        ids, logprobs, tail, flat_labels, valid, vocab, check_ids, check_ids and sort_dups
    )
    if targets == "sampled":
        wsum = logsumexp_ftz(logprobs).exp()
        off = valid & ~((wsum - 1.0).abs() <= SAMPLED_SUM_TOL)
        problems.append(
            (
                f'targets="sampled": exp(topk_logprobs) (importance weights) must sum to 1 per '
                f"row within {SAMPLED_SUM_TOL}",
                off.any(),
            )
        )
    counts = torch.stack([valid.sum()] + [p for _, p in problems]).tolist()
    n_valid = int(counts[0])
    bad = [msg for (msg, _), flag in zip(problems, counts[1:], strict=True) if flag]
    if bad:
        raise LossInputError("; ".join(bad))

    vcol = valid[:, None]
    if n_valid < n:  # neutral, legal content in rows that do not count
        ids = torch.where(vcol, ids, torch.arange(k, device=device))
        logprobs = torch.where(vcol, logprobs, torch.zeros((), dtype=work, device=device))
        if tail is not None:
            tail = torch.where(valid, tail, torch.zeros((), dtype=work, device=device))
    if tail is not None:
        tail = tail.clamp(0.0, 1.0)
    if targets == "sampled":  # exact normalisation (rows that do not count hold zeros)
        logprobs = logprobs - logsumexp_ftz(logprobs, keepdim=True)
    if flat_labels is not None:
        has_label = valid.clone()
        flat_labels = torch.where(valid, flat_labels, torch.zeros_like(flat_labels))
    return Prepared(
        hidden=hidden.reshape(n, d),
        weight=weight,
        bias=bias,
        ids=ids,
        logprobs=logprobs,
        tail=tail,
        labels=flat_labels,
        has_label=has_label,
        valid=valid,
        n_valid=n_valid,
        lead_shape=lead,
    )


def _find_problems(
    ids: torch.Tensor,
    logprobs: torch.Tensor,
    tail: torch.Tensor | None,
    labels: torch.Tensor | None,
    valid: torch.Tensor,
    vocab: int,
    check_ids: bool,
    sort_dups: bool,
) -> list[tuple[str, torch.Tensor]]:
    """(message, 0-d bool tensor) pairs, evaluated on counted rows, without synchronising."""
    vcol = valid[:, None]
    out: list[tuple[str, torch.Tensor]] = []
    if check_ids:
        out.append(
            (f"topk_ids out of range [0, {vocab})", (vcol & ((ids < 0) | (ids >= vocab))).any())
        )
    if sort_dups and ids.shape[1] > 1:
        srt = ids.sort(dim=1).values
        dup = (srt[:, 1:] == srt[:, :-1]) & vcol
        out.append((DUPLICATE_IDS, dup.any()))
    lp_bad = vcol & (torch.isnan(logprobs) | (logprobs > _LOGPROB_TOL))
    out.append(("topk_logprobs must be log-probabilities (<= 0, not NaN)", lp_bad.any()))
    if tail is not None:
        t_bad = valid & ~((tail >= -_TAIL_TOL) & (tail <= 1.0 + _TAIL_TOL))
        out.append(("tail_mass must be in [0, 1]", t_bad.any()))
    if labels is not None:
        out.append(
            (
                f"labels out of range [0, {vocab})",
                (valid & ((labels < 0) | (labels >= vocab))).any(),
            )
        )
    return out

r"""Per-row loss and gradient coefficients from sparse statistics (shared by the chunked paths).

For one position let ``x`` be the student logits (bias included), ``z = x / T`` the tempered
logits, ``S`` the teacher's top-k ids, ``q = softmax(z)`` over the full vocabulary and
``p_v = exp(topk_logprobs_v)`` the cached (not renormalised) teacher probabilities, ``M = sum p``.
Each divergence is a function ``F`` of the *bucket* probabilities ``Q_b`` of the student, with
buckets ``b`` = each ``v in S`` and (for losses with a tail bucket) ``o`` = everything outside
``S``, ``Q_o = 1 - sum_{v in S} q_v``. For any such ``F``

    dF/dz_u = q_u * (phi_{b(u)} - sum_b Q_b phi_b),   phi_b = dF/dQ_b,

so the full-vocabulary gradient is ``a * q_u`` off the support (one scalar ``a`` per row) plus
``k`` explicit values on it. Only ``z_S`` (k gathered logits) and ``lse_out`` (the log-sum-exp of
``z`` over the ids *outside* ``S``) are needed; the full ``lse = logaddexp(lse_out, lse(z_S))``
and ``log Q_o = lse_out - lse`` follow without cancellation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .spec import LOG_FLOOR, LossInputError, LossSpec


@dataclass
class KDTerms:
    """Distillation term per row (on tempered logits, before the ``T**2`` factor)."""

    loss: torch.Tensor  # [C]
    dense: torch.Tensor  # [C]   dF/dz_u = dense * q_u for u outside S
    sparse: torch.Tensor  # [C,k] dF/dz_v for v in S
    lse: torch.Tensor  # [C]   full log-sum-exp of z


@dataclass
class RowCoefs:
    """Gradient of the row loss w.r.t. the raw logits ``x``, for a unit row weight.

    ``grad_x_u = c1 * exp(x_u / T - lse) + c2 * exp(x_u - lse1)`` for ``u`` outside ``S``;
    ``grad_x_v = sparse_v`` for ``v`` in ``S``; then ``label_add`` is added at the label column.
    Everything is linear in the row weight, so callers scale all fields by one ``[C]`` vector.
    """

    loss: torch.Tensor  # [C]  T**2 * KD + ce_weight * CE
    lse: torch.Tensor  # [C]
    c1: torch.Tensor  # [C]
    lse1: torch.Tensor | None  # [C]  un-tempered log-sum-exp (only with a separate CE softmax)
    c2: torch.Tensor | None  # [C]
    sparse: torch.Tensor  # [C, k]
    label_add: torch.Tensor | None  # [C]

    def scaled_(self, w: float) -> RowCoefs:
        """:meth:`scaled` by one scalar for every row, in place (no new ``[C, k]`` buffer);
        returns ``self``. Only for coefficients nothing else reads afterwards."""
        for t in (self.c1, self.c2, self.sparse, self.label_add):
            if t is not None:
                t.mul_(w)
        return self

    def scaled(self, w: torch.Tensor) -> RowCoefs:
        """All gradient fields multiplied by the row weights ``w`` ([C]); the loss is kept."""
        return RowCoefs(
            loss=self.loss,
            lse=self.lse,
            c1=self.c1 * w,
            lse1=self.lse1,
            c2=None if self.c2 is None else self.c2 * w,
            sparse=self.sparse * w[:, None],
            label_add=None if self.label_add is None else self.label_add * w,
        )


def exp_ftz(t: torch.Tensor) -> torch.Tensor:
    """``exp(t)``, except that results below ``e * tiny`` of the dtype (float32: 3.2e-38, the
    denormal range and a sliver above it) are exactly 0.

    Bit-equal to ``t.exp()`` elsewhere. On x86 CPUs torch's
    vectorised ``exp`` is 30-100x slower on inputs whose result is denormal or underflows, such
    as the ``-65504`` / ``-inf`` padding of sampled rows (about half the columns of a trimmed
    384-draw batch); clamping first keeps every lane on the fast path.
    """
    lo = math.log(torch.finfo(t.dtype).tiny) + 1.0
    return t.clamp_min(lo).exp_().mul_(t >= lo)


def logsumexp_ftz(t: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """``torch.logsumexp(t, dim)`` with the terms through :func:`exp_ftz` (terms below about
    ``3e-38`` of the row's largest count as 0); rows of ``-inf`` give ``-inf``."""
    m = t.amax(dim, keepdim=True)
    m = torch.where(m.isfinite(), m, torch.zeros((), dtype=t.dtype, device=t.device))
    out = m + exp_ftz(t - m).sum(dim, keepdim=True).log()
    return out if keepdim else out.squeeze(dim)


def _required(t: torch.Tensor | None, name: str) -> torch.Tensor:
    if t is None:
        raise LossInputError(f"this loss configuration needs {name}")
    return t


def _pos_mul(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``p * v`` with ``0 * anything = 0`` (the 0 log 0 = 0 convention)."""
    return torch.where(p > 0, p * v, torch.zeros((), dtype=v.dtype, device=v.device))


def _forward_kl_lean(z_s: torch.Tensor, lse: torch.Tensor, logprobs: torch.Tensor) -> KDTerms:
    """The ``forward_kl`` terms without a tail bucket (the common case), with the same
    arithmetic as :func:`kd_terms`'s general branch but at most three ``[C, k]`` temporaries
    alive at once (they coexist with a chunk's ``[C, V]`` logits, so they add to the peak)."""
    logq = z_s - lse[:, None]
    p = exp_ftz(logprobs)
    mass = p.sum(-1)
    v = (logprobs - logq).mul_(p)  # p * (log p - log q); 0 where p == 0 (0 log 0 = 0)
    loss = v.masked_fill_((p > 0).logical_not_(), 0.0).sum(-1)
    del v
    sparse = logq.exp_().mul_(mass[:, None]).sub_(p)  # M q - p, in logq's buffer
    return KDTerms(loss, mass, sparse, lse)


def kd_terms(
    spec: LossSpec,
    z_s: torch.Tensor,
    lse_out: torch.Tensor,
    logprobs: torch.Tensor,
    tail: torch.Tensor | None,
) -> KDTerms:
    """Loss and ``dF/dz`` of the distillation term for each row (see the module docstring)."""
    lse = torch.logaddexp(lse_out, torch.logsumexp(z_s, dim=-1))
    if spec.loss == "forward_kl" and not spec.uses_tail_bucket:
        return _forward_kl_lean(z_s, lse, logprobs)
    logq = z_s - lse[:, None]
    q = logq.exp()
    if spec.loss == "renormalized_kl":
        log_pt = torch.log_softmax(logprobs, dim=-1)
        pt = log_pt.exp()
        loss = _pos_mul(pt, log_pt - torch.log_softmax(z_s, dim=-1)).sum(-1)
        return KDTerms(loss, torch.zeros_like(lse), torch.softmax(z_s, dim=-1) - pt, lse)

    log_qo_raw = lse_out - lse
    qo = log_qo_raw.exp()
    log_qo = log_qo_raw.clamp_min(LOG_FLOOR)
    p = exp_ftz(logprobs)
    mass = p.sum(-1)
    if spec.loss == "forward_kl":
        loss = _pos_mul(p, logprobs - logq).sum(-1)
        tail = _required(tail, "tail_mass")
        loss = loss + _pos_mul(tail, tail.clamp_min(1e-30).log() - log_qo)
        total = mass + tail
        return KDTerms(loss, total - tail * (-log_qo).exp(), total[:, None] * q - p, lse)

    p_o = tail if tail is not None else (1.0 - mass).clamp(0.0, 1.0)
    log_po = p_o.clamp_min(1e-30).log()
    lp = logprobs.clamp_min(LOG_FLOOR)
    if spec.loss == "reverse_kl":
        g_s = logq - lp
        g_o = log_qo - log_po
        r = (q * g_s).sum(-1) + qo * g_o
        return KDTerms(r, g_o - r, q * (g_s - r[:, None]), lse)

    # generalised JSD(beta): m = beta * P + (1 - beta) * Q on every bucket
    b = spec.beta
    lb, l1b = math.log(b), math.log1p(-b)
    logm_s = torch.logaddexp(lb + lp, l1b + logq)
    logm_o = torch.logaddexp(lb + log_po, l1b + log_qo)
    loss = b * (_pos_mul(p, lp - logm_s).sum(-1) + _pos_mul(p_o, log_po - logm_o)) + (1 - b) * (
        (q * (logq - logm_s)).sum(-1) + qo * (log_qo - logm_o)
    )
    phi_s = (1 - b) * (logq - logm_s)
    phi_o = (1 - b) * (log_qo - logm_o)
    c = (q * phi_s).sum(-1) + qo * phi_o
    return KDTerms(loss, phi_o - c, q * (phi_s - c[:, None]), lse)


def row_coefs(
    spec: LossSpec,
    x_s: torch.Tensor,
    lse_out: torch.Tensor,
    logprobs: torch.Tensor,
    tail: torch.Tensor | None,
    x_label: torch.Tensor | None = None,
    lse1_out: torch.Tensor | None = None,
    has_label: torch.Tensor | None = None,
) -> RowCoefs:
    """Row loss and unit-weight gradient coefficients w.r.t. the raw logits.

    ``x_s`` are the raw logits at the top-k ids, ``lse_out`` the log-sum-exp of ``x / T`` outside
    them; with the CE term, ``x_label`` is the label logit, ``has_label`` marks rows where CE
    applies, and ``lse1_out`` the log-sum-exp of ``x`` outside the ids (only when ``T != 1``).
    """
    t = spec.temperature
    kd = kd_terms(spec, x_s * spec.inv_temperature, lse_out, logprobs, tail)
    loss = kd.loss * (t * t)
    c1 = kd.dense * t
    sparse = kd.sparse if t == 1.0 else kd.sparse * t
    lse1 = c2 = label_add = None
    if spec.ce_weight > 0.0:
        x_label = _required(x_label, "labels")
        w = spec.ce_weight * _required(has_label, "labels").to(loss.dtype)
        if spec.separate_ce_softmax:
            lse1 = torch.logaddexp(_required(lse1_out, "lse1_out"), torch.logsumexp(x_s, dim=-1))
            c2 = w
        else:
            lse1 = kd.lse
            c1 = c1 + w
        loss = loss + w * (lse1 - x_label)
        sparse = sparse + w[:, None] * (x_s - lse1[:, None]).exp()
        label_add = -w
        if not spec.separate_ce_softmax:
            lse1 = None
    return RowCoefs(loss, kd.lse, c1, lse1, c2, sparse, label_add)

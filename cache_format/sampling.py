"""Sampled targets (random-sampling KD, Anshumann et al. 2025, "Sparse Logit Sampling").

The estimator (FORMAT.md section "Sampled targets" is the normative text): for one row with teacher
distribution ``p`` (already at the cache's ``temperature``) and proposal temperature ``tau``,

* the proposal is ``q = softmax(log p / tau)`` (``q ∝ p^(1/tau)``; ``tau = 1``: ``q = p``);
* ``N`` ids are drawn from ``q`` with replacement by inverse-CDF sampling: draw ``j`` is the
  smallest id ``v`` with ``cumsum(q)[v] > u_j`` for the row's uniforms ``u_j`` (:func:`uniforms`);
* the ``m <= N`` distinct ids get importance weights ``w_i ∝ c_i p_i / q_i`` (``c_i`` = times id
  ``i`` was drawn), normalised to sum to 1;
* the row is stored like a top-k row: ``ids [k]`` sorted by descending weight (ties: ascending
  id), ``logprobs [k] = log w_i``; a row with ``m < k`` is padded with the smallest ids not in it
  and log-weight :data:`PAD_LOGPROB` (weight 0; the format keeps logprobs finite).

With ``tau = 1`` every weight is ``c_i / N`` and ``E[w_i] = p_i``: the forward KL
``sum_i w_i (log w_i - log q_student_i)`` then has gradient ``q_student - w`` w.r.t. the student
logits, an unbiased estimate of full KD's ``q_student - p``.

Reproducibility: the uniforms of a sequence come from a ``torch.Generator`` seeded with
``sha256(seed, key)`` (:func:`uniforms`), drawn for the whole sequence up front, so the targets
depend only on (seed, key, teacher row) and not on batching, chunking or resume.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

#: Log-weight of a padding slot (weight ``exp(-65504) = 0``; the float16 minimum, exact in every
#: logprob encoding of the format).
PAD_LOGPROB = -65504.0

#: The only sampling method so far: i.i.d. draws from ``q ∝ p^(1/tau)``, importance weighted.
METHOD = "rs-kd"


def sequence_seed(seed: int, key: str) -> int:
    """63-bit generator seed of one sequence: ``sha256(f"{seed}:{key}")``'s first 8 bytes."""
    digest = hashlib.sha256(f"{int(seed)}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def uniforms(seed: int, key: str, rows: int, draws: int) -> Any:
    """``[rows, draws]`` float64 uniforms in ``[0, 1)`` of one sequence (torch CPU generator)."""
    return seeded_uniforms(sequence_seed(seed, key), rows, draws)


def seeded_uniforms(seq_seed: int, rows: int, draws: int) -> Any:
    """The uniforms of a sequence whose generator seed is ``seq_seed`` (:func:`sequence_seed`):
    ``torch.rand(rows, draws, float64)`` from a CPU ``torch.Generator``. The stream is row-major,
    so the first ``r`` rows are the same whatever ``rows >= r`` is asked for (a producer that
    sees a sequence in chunks draws ``[:end]`` and keeps ``[start:end]``)."""
    import torch

    gen = torch.Generator().manual_seed(int(seq_seed))
    return torch.rand(rows, draws, generator=gen, dtype=torch.float64)


def sample_rows(
    logprobs: Any, u: Any, proposal_temperature: float = 1.0, k: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Sampled targets of a block of rows (see the module docstring).

    ``logprobs``: ``[r, V]`` teacher log-probabilities (torch, any float dtype/device);
    ``u``: ``[r, N]`` uniforms from :func:`uniforms`; ``k``: stored slots per row (default
    ``N``; rows with more than ``k`` distinct ids raise ``ValueError``). Returns numpy
    ``(ids [r, k] int32, log_w [r, k] float32)``.
    """
    import torch

    if not proposal_temperature > 0:
        raise ValueError(f"proposal_temperature must be > 0, got {proposal_temperature}")
    r, v = logprobs.shape
    n = int(u.shape[1])
    k = n if k is None else int(k)
    if k > v:
        raise ValueError(f"k={k} slots exceed the vocabulary ({v})")
    lp = logprobs.detach().to(torch.float64)
    lq = lp if proposal_temperature == 1.0 else torch.log_softmax(lp / proposal_temperature, -1)
    cdf = lq.exp().cumsum(-1)
    cdf = cdf / cdf[:, -1:]  # exact 1 at the end: every u < 1 finds an id
    draws = torch.searchsorted(cdf, u.to(cdf.device), right=True).clamp_max(v - 1)
    # distinct ids and counts per row, on [r, N] only (never a sort over the vocabulary)
    d = draws.sort(-1).values
    new = torch.ones_like(d, dtype=torch.bool)
    new[:, 1:] = d[:, 1:] != d[:, :-1]
    group = new.long().cumsum(-1) - 1
    counts = torch.zeros(r, n, dtype=torch.float64, device=lp.device)
    counts.scatter_add_(1, group, torch.ones_like(d, dtype=torch.float64))
    uniq = torch.zeros_like(d).scatter_(1, group, d)  # ascending distinct ids, then zeros
    m = new.sum(-1, keepdim=True)
    if r and int(m.max()) > k:
        raise ValueError(f"a row has {int(m.max())} distinct draws, more than k={k} slots")
    slot = torch.arange(n, device=lp.device)[None, :]
    valid = slot < m
    # log w ∝ log c + log p - log q over the drawn ids
    # (log p - log q first: exactly 0 at tau = 1, so equal counts give bit-equal weights)
    logw = counts.clamp_min(1).log() + (lp.gather(1, uniq) - lq.gather(1, uniq))
    logw = torch.where(valid, logw, torch.full_like(logw, -torch.inf))
    logw = logw - torch.logsumexp(logw, -1, keepdim=True)
    # descending weight; the stable sort keeps ascending id among equal weights
    order = torch.sort(logw, dim=-1, descending=True, stable=True).indices
    ids = uniq.gather(1, order)
    lw = logw.gather(1, order)
    if k > n:
        ids = torch.cat([ids, torch.zeros(r, k - n, dtype=ids.dtype, device=ids.device)], 1)
        lw = torch.cat([lw, torch.full((r, k - n), -torch.inf, dtype=lw.dtype)], 1)
    else:
        ids, lw = ids[:, :k], lw[:, :k]
    # padding slots j >= m: the smallest ids not drawn, ascending (all lie below k + m <= 2k)
    width = min(v, 2 * k)
    drawn = torch.zeros(r, width, dtype=torch.long, device=lp.device)
    drawn.scatter_add_(1, uniq.clamp_max(width - 1), (valid & (uniq < width)).long())
    drawn = drawn.clamp_max(1)
    free = (drawn * width + torch.arange(width, device=lp.device)[None, :]).argsort(-1)
    kslot = torch.arange(k, device=lp.device)[None, :]
    pad_ids = free.gather(1, (kslot - m).clamp(0, width - 1))
    is_pad = kslot >= m
    ids = torch.where(is_pad, pad_ids, ids)
    lw = torch.where(is_pad, torch.full_like(lw, PAD_LOGPROB), lw)
    return ids.cpu().numpy().astype(np.int32), lw.cpu().numpy().astype(np.float32)


def sample_from_hidden(
    hidden: Any,
    weight: Any,
    u: Any,
    *,
    bias: Any = None,
    temperature: float = 1.0,
    proposal_temperature: float = 1.0,
    chunk_rows: int = 256,
    k: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Sampled targets straight from a teacher's final hidden states, chunk by chunk: for
    ``chunk_rows`` positions at a time ``lp = log_softmax((h W^T + b) / temperature)`` and
    :func:`sample_rows` on it, so at most ``chunk_rows x V`` logits exist at once (never the
    ``[L, V]`` block of the whole sequence). ``hidden [n, d]``, ``weight [V, d]``, ``u [n, N]``
    (:func:`uniforms` of the sequence). Equal to :func:`sample_rows` on the full block, whatever
    ``chunk_rows`` is (the uniforms are per row)."""
    import torch

    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    ids, lws = [], []
    with torch.no_grad():
        for s in range(0, int(hidden.shape[0]), chunk_rows):
            z = hidden[s : s + chunk_rows].float() @ weight.float().T
            if bias is not None:
                z = z + bias.float()
            lp = torch.log_softmax(z / temperature, -1)
            i, w = sample_rows(lp, u[s : s + chunk_rows], proposal_temperature, k)
            ids.append(i)
            lws.append(w)
    n = int(u.shape[1]) if k is None else int(k)
    if not ids:
        return np.zeros((0, n), np.int32), np.zeros((0, n), np.float32)
    return np.concatenate(ids), np.concatenate(lws)


def sampling_manifest(draws: int, proposal_temperature: float, seed: int) -> dict[str, Any]:
    """The manifest's ``sampling`` object of a sampled cache."""
    return {
        "method": METHOD,
        "draws": int(draws),
        "proposal_temperature": float(proposal_temperature),
        "seed": int(seed),
    }

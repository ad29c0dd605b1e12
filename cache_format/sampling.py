"""Sampled targets (random-sampling KD, Anshumann et al. 2025, "Sparse Logit Sampling").

FORMAT.md 4.4 is the normative estimator: per row, ``N`` ids drawn with replacement from the
proposal ``q ∝ p^(1/tau)`` by inverse CDF (:func:`uniforms`), the distinct ones weighted
``w_i ∝ c_i p_i / q_i`` (normalised), stored like a top-k row (``log w`` by descending weight,
padded with :data:`PAD_LOGPROB`). ``head = m > 0`` keeps the teacher's top ``m`` ids exactly and
draws from the residual. The uniforms of a sequence come from ``sha256(seed, key)``, so the
targets depend only on (seed, key, teacher row), not on batching, chunking or resume."""

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
    """``torch.rand(rows, draws, float64)`` from a CPU ``torch.Generator`` seeded with
    ``seq_seed`` (:func:`sequence_seed`); row-major, so the first rows are the same whatever
    ``rows`` is asked for."""
    import torch

    gen = torch.Generator().manual_seed(int(seq_seed))
    return torch.rand(rows, draws, generator=gen, dtype=torch.float64)


def check_head(head: int, draws: int, vocab_size: int) -> int:
    """``head`` as an int if ``0 <= head`` and, for ``head > 0``, ``head + draws <= vocab_size``
    (the row's slots fit the vocabulary); ``ValueError`` otherwise."""
    if isinstance(head, bool) or not isinstance(head, int | np.integer) or head < 0:
        raise ValueError(f"head must be an integer >= 0, got {head!r}")
    if head and int(head) + int(draws) > vocab_size:
        raise ValueError(f"head={head} + draws={draws} slots exceed the vocabulary ({vocab_size})")
    return int(head)


def sample_rows(
    logprobs: Any,
    u: Any,
    proposal_temperature: float = 1.0,
    k: int | None = None,
    head: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Sampled targets of a block of rows (FORMAT.md 4.4): ``logprobs`` ``[r, V]`` teacher
    log-probabilities (torch), ``u`` ``[r, N]`` uniforms (:func:`uniforms`), ``head`` the top ids
    kept exactly (0: plain RS-KD), ``k`` stored slots per row (default ``head + N``; more distinct
    ids raise ``ValueError``). Returns numpy ``(ids [r, k] int32, log_w [r, k] float32)``."""
    import torch

    if not proposal_temperature > 0:
        raise ValueError(f"proposal_temperature must be > 0, got {proposal_temperature}")
    r, v = logprobs.shape
    n = int(u.shape[1])
    head = check_head(head, n, v)
    if head:
        return _sample_head_rows(logprobs, u, proposal_temperature, k, head)
    k = n if k is None else int(k)
    if k > v:
        raise ValueError(f"k={k} slots exceed the vocabulary ({v})")
    lp = logprobs.detach().to(torch.float64)
    lq = lp if proposal_temperature == 1.0 else torch.log_softmax(lp / proposal_temperature, -1)
    cdf = lq.exp().cumsum(-1)
    cdf = cdf / cdf[:, -1:]  # exact 1 at the end: every u < 1 finds an id
    draws = torch.searchsorted(cdf, u.to(cdf.device), right=True).clamp_max(v - 1)
    uniq, counts, m = _distinct(draws)
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
    ids, lw = _pad(ids, lw, uniq, valid, m, k, v)
    return ids.cpu().numpy().astype(np.int32), lw.cpu().numpy().astype(np.float32)


def _distinct(draws: Any) -> tuple[Any, Any, Any]:
    """Distinct ids and counts per row of ``draws [r, N]``, on ``[r, N]`` only (never a sort
    over the vocabulary): ``(uniq [r, N]`` ascending distinct ids then zeros, ``counts [r, N]``
    float64 (0 past the distinct ids), ``m [r, 1]`` distinct ids per row)."""
    import torch

    d = draws.sort(-1).values
    new = torch.ones_like(d, dtype=torch.bool)
    new[:, 1:] = d[:, 1:] != d[:, :-1]
    group = new.long().cumsum(-1) - 1
    counts = torch.zeros(d.shape, dtype=torch.float64, device=d.device)
    counts.scatter_add_(1, group, torch.ones_like(d, dtype=torch.float64))
    uniq = torch.zeros_like(d).scatter_(1, group, d)
    return uniq, counts, new.sum(-1, keepdim=True)


def _pad(ids: Any, lw: Any, present: Any, valid: Any, m: Any, k: int, v: int) -> tuple[Any, Any]:
    """Slots ``j >= m`` (``m [r, 1]`` real entries per row) take the smallest ids not among the
    ``valid`` entries of ``present``, ascending (all lie below ``k + m <= 2k``), at log-weight
    :data:`PAD_LOGPROB`."""
    import torch

    r = ids.shape[0]
    width = min(v, 2 * k)
    drawn = torch.zeros(r, width, dtype=torch.long, device=ids.device)
    drawn.scatter_add_(1, present.clamp_max(width - 1), (valid & (present < width)).long())
    drawn = drawn.clamp_max(1)
    free = (drawn * width + torch.arange(width, device=ids.device)[None, :]).argsort(-1)
    kslot = torch.arange(k, device=ids.device)[None, :]
    pad_ids = free.gather(1, (kslot - m).clamp(0, width - 1))
    is_pad = kslot >= m
    ids = torch.where(is_pad, pad_ids, ids)
    lw = torch.where(is_pad, torch.full_like(lw, PAD_LOGPROB), lw)
    return ids, lw


def _sample_head_rows(
    logprobs: Any, u: Any, proposal_temperature: float, k: int | None, head: int
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`sample_rows` with ``head > 0`` (the head + residual estimator of the module
    docstring): a top-``head`` per row (``torch.topk``, no sort over the vocabulary), the draws
    from the residual proposal by inverse CDF over ids ``0..V-1`` with the head's ``q`` set to
    0, weights in log space."""
    import torch

    r, v = logprobs.shape
    n = int(u.shape[1])
    k = head + n if k is None else int(k)
    if k > v:
        raise ValueError(f"k={k} slots exceed the vocabulary ({v})")
    if k < head:
        raise ValueError(f"k={k} slots cannot hold the head ({head})")
    lp = logprobs.detach().to(torch.float64)
    dev = lp.device
    lq = lp if proposal_temperature == 1.0 else torch.log_softmax(lp / proposal_temperature, -1)
    head_lp, head_ids = torch.topk(lp, head, dim=-1)
    head_lp = head_lp.clamp_min(PAD_LOGPROB)  # finite even for an id of probability 0
    in_head = torch.zeros(r, v, dtype=torch.bool, device=dev)
    in_head.scatter_(1, head_ids, True)
    lq_rest = lq.masked_fill(in_head, -torch.inf)
    lse_q_rest = torch.logsumexp(lq_rest, -1, keepdim=True)
    # log(1 - P_head) as the log-mass of the ids outside the head (no cancellation)
    if lq is lp:
        log_rest = lse_q_rest
    else:
        log_rest = torch.logsumexp(lp.masked_fill(in_head, -torch.inf), -1, keepdim=True)
    # residual proposal q_R = q / sum_{v not in head} q (its largest term is >= 1/V: no 0/0)
    cdf = (lq_rest - lse_q_rest).exp().cumsum(-1)
    cdf = cdf / cdf[:, -1:]
    draws = torch.searchsorted(cdf, u.to(dev), right=True).clamp_max(v - 1)
    uniq, counts, m_rest = _distinct(draws)
    real = head + m_rest
    if r and int(real.max()) > k:
        raise ValueError(f"a row has {int(real.max())} distinct ids, more than k={k} slots")
    slot = torch.arange(n, device=dev)[None, :]
    # a row whose residual has no mass (every other logprob -inf) keeps its head only
    valid = (slot < m_rest) & torch.isfinite(log_rest)
    real = head + valid.sum(-1, keepdim=True)
    # log w = log(1 - P_head) + normalised (log c + log p - log q) over the drawn ids; q_R / q
    # is a per-row constant, so it cancels in the normalisation
    logw = counts.clamp_min(1).log() + (lp.gather(1, uniq) - lq.gather(1, uniq))
    logw = torch.where(valid, logw, torch.full_like(logw, -torch.inf))
    norm = torch.logsumexp(logw, -1, keepdim=True)
    logw = torch.where(valid, logw - norm + log_rest, logw)
    ids = torch.cat([head_ids, uniq], 1)
    lw = torch.cat([head_lp, logw], 1)
    # descending weight, ties by ascending id: sort by id, then a stable sort by weight
    by_id = ids.masked_fill(~torch.cat([torch.ones_like(head_ids, dtype=torch.bool), valid], 1), v)
    by_id = torch.sort(by_id, dim=-1, stable=True).indices
    ids, lw = ids.gather(1, by_id), lw.gather(1, by_id)
    order = torch.sort(lw, dim=-1, descending=True, stable=True).indices
    ids, lw = ids.gather(1, order), lw.gather(1, order)
    width = head + n
    if k > width:
        ids = torch.cat([ids, torch.zeros(r, k - width, dtype=ids.dtype, device=dev)], 1)
        lw = torch.cat([lw, torch.full((r, k - width), -torch.inf, dtype=lw.dtype)], 1)
    else:
        ids, lw = ids[:, :k], lw[:, :k]
    present = torch.cat([head_ids, uniq], 1)
    ok = torch.cat([torch.ones_like(head_ids, dtype=torch.bool), valid], 1)
    ids, lw = _pad(ids, lw, present, ok, real, k, v)
    return ids.cpu().numpy().astype(np.int32), lw.cpu().numpy().astype(np.float32)


def row_entropy(lp: Any) -> Any:
    """The entropy in nats, ``-sum_v p_v log p_v``, of each row of log-probabilities ``lp [n, V]``
    (float32 torch): float32 ``[n]``, ``>= 0`` (FORMAT.md 4.9)."""
    import torch

    return torch.special.entr(lp.exp()).sum(-1).clamp_min_(0.0)


def sampling_manifest(
    draws: int, proposal_temperature: float, seed: int, head: int = 0
) -> dict[str, Any]:
    """The manifest's ``sampling`` object of a sampled cache; ``head`` only when > 0 (a store
    without it keeps the exact manifest it always had; absent means 0)."""
    doc: dict[str, Any] = {
        "method": METHOD,
        "draws": int(draws),
        "proposal_temperature": float(proposal_temperature),
        "seed": int(seed),
    }
    if int(head) > 0:
        doc["head"] = int(head)
    return doc

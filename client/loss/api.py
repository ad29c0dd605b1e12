r"""``topk_distill_loss``: distillation against cached sparse top-k teacher targets."""

from __future__ import annotations

import dataclasses

import torch

from .chunk_ops import use_triton
from .dispatch import check_options, plan_chunks, resolve_impl
from .forward_chunked import forward_chunked_rows
from .fused_chunked import TopKChunks, chunked_loss
from .reference import dense_row_losses
from .small_vocab import small_vocab_rows
from .spec import LossInputError, LossSpec
from .validation import Prepared, prepare
from .vocab_parallel import (
    VocabParallel,
    VocabShard,
    check_same_rows,
    from_dtensor,
    resolve_shard,
)


def topk_distill_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    tail_mass: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    ignore_index: int = -100,
    loss: str = "forward_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    ce_weight: float = 0.0,
    reduction: str = "mean",
    impl: str = "auto",
    chunk_size: int | None = None,
    check_ids: bool = True,
    targets: str = "topk",
    grad_weight_dtype: str = "auto",
    vocab_parallel: VocabParallel | None = None,
    kernels: str = "auto",
) -> torch.Tensor:
    r"""Distillation loss of a student lm-head against cached teacher top-k logprobs.

    Shapes: ``hidden [..., d]`` (any leading shape, flattened to ``N`` rows), ``weight [V, d]``,
    ``bias [V]``, ``topk_ids [..., k]`` (distinct per row, in ``[0, V)``), ``topk_logprobs
    [..., k]``, ``tail_mass``, ``labels``, ``mask`` ``[...]``. A row *counts* when ``mask`` is
    true (default all) and ``labels != ignore_index`` (when labels are given); other rows give
    0 and no gradient, and their ids/logprobs are not checked. Gradients flow to ``hidden``,
    ``weight`` and ``bias``.

    Notation per row: logits ``x = W h + b``, tempered ``z = x / T``, student ``q = softmax(z)``
    over all ``V`` ids, teacher top-k set ``S``, ``p_v = exp(topk_logprobs_v)`` (as cached, not
    renormalised), ``M = sum_S p_v``, student mass outside ``S``: ``Q_o = 1 - sum_S q_v``
    (computed as ``exp(lse_{u not in S} z_u - lse z)``, exactly), teacher tail ``P_o`` =
    ``tail_mass`` if given, else ``clip(1 - M, 0, 1)``. Conventions ``0 log 0 = 0``; the logs
    of ``Q_o``, ``P_o`` (and of ``p_v`` for reverse KL / JSD) are floored at ``log 1e-30``.

    ``loss=``

    * ``"forward_kl"``, no ``tail_mass``: ``KD = sum_S p_v (log p_v - log q_v)``, the
      un-renormalised top-k objective of the Multiverse fused chunked KL (can be negative; its
      minimum is ``M log M``); ``dKD/dz_u = M q_u - p_u [u in S]``.
    * ``"forward_kl"`` with ``tail_mass``: the tail is one more bucket, i.e. the true KL of the
      coarsened distributions ``(p_S, P_o)`` and ``(q_S, Q_o)``:
      ``KD = sum_S p_v log(p_v / q_v) + P_o log(P_o / Q_o)``.
    * ``"renormalized_kl"``: ``KD = sum_S pt_v log(pt_v / qt_v)`` with ``pt = p / M`` and
      ``qt = q_S / sum_S q`` (depends on the k gathered logits only; ``tail_mass`` unused).
    * ``"reverse_kl"``: ``KD = sum_S q_v log(q_v / p_v) + Q_o log(Q_o / P_o)`` (coarsened).
    * ``"jsd"``: generalised Jensen-Shannon on the coarsened buckets ``b``, with
      ``m_b = beta P_b + (1 - beta) Q_b``:
      ``KD = beta sum_b P_b log(P_b / m_b) + (1 - beta) sum_b Q_b log(Q_b / m_b)``,
      ``0 < beta < 1`` (TRL/Liger convention; beta -> 0 and 1 tend to 0, use the KLs instead).

    Row loss: ``L = T**2 * KD + ce_weight * CE`` with ``CE = -log softmax(x)_label`` (un-tempered
    logits; rows with ``ignore_index`` labels do not count at all). ``temperature`` divides the
    student logits only: the teacher is used as cached (its temperature is the cache's).
    ``reduction``: ``"mean"`` = sum over counted rows / number of counted rows (0 if none),
    ``"sum"``, or ``"none"`` (shape ``[...]``, 0 on rows that do not count).

    ``impl`` (all give the same numbers up to rounding):

    * ``"dense"``: full ``[N, V]`` logits and a dense rebuilt teacher, plain autograd (the
      reference; memory ``O(N V)``).
    * ``"forward_chunked"``: full logits, the loss and its logits-gradient chunked over rows.
    * ``"fused_chunked"`` (``"auto"``, except as below): projection fused and chunked over
      rows, logits never materialised; gradients computed in the forward pass (3 GEMMs). With
      ``reduction="none"`` it becomes ``"fused_chunked_recompute"`` (projection recomputed in
      backward, 4 GEMMs).
      The two full-vocabulary passes run in Triton or torch as ``kernels`` says.
    * ``"small_vocab"``: full logits of the counted rows, one exponential pass shared by
      forward and backward (:mod:`.small_vocab`; memory ``O(N V)``). ``"auto"`` takes it on the
      CPU for a small ``N x V`` (``dispatch.picks_small_vocab``), never on CUDA.

    ``targets``: ``"topk"`` (cached top-k logprobs, as above) or ``"sampled"``: random-sampling
    KD rows (Anshumann et al. 2025), distinct sampled ids with ``topk_logprobs = log w``,
    importance weights summing to 1 per row within 1e-2 (renormalised exactly; ``-inf`` on
    padding); the loss is ``sum_i w_i (log w_i - log q_i)`` (``forward_kl`` with ``p = w``,
    which it needs, without ``tail_mass``).

    ``grad_weight_dtype`` (fused impls, bf16/fp16 ``weight``): where ``grad_W`` is
    accumulated chunk by chunk. ``"float32"``: an fp32 buffer (``4 V d`` bytes), cast to the
    weight dtype at the end. ``"weight"``: straight into a buffer of the weight's dtype that
    becomes ``weight.grad`` (``2 V d`` bytes: the memory floor; each chunk's fp32 GEMM result
    is rounded once into it, so the error grows with the number of chunks). ``"auto"``: the
    weight dtype when there are at most ``dispatch.AUTO_LOWP_MAX_CHUNKS`` chunks, else float32.

    ``kernels`` (chunked impls): ``"auto"`` runs the two full-vocabulary passes as Triton
    kernels on CUDA when Triton is installed (``chunk_ops.TRITON_AVAILABLE``, decided at import
    and shown by ``logitcache info --versions``), else in torch; ``"torch"`` never uses Triton;
    ``"triton"`` always does (an error without Triton; on the CPU under ``TRITON_INTERPRET=1``).

    ``vocab_parallel``: a :class:`VocabParallel` when ``weight``/``bias`` are this rank's rows of
    a lm-head split along the vocabulary over a process group (Megatron / ``ColwiseParallel``
    layout; ids stay global). A ``DTensor`` weight with ``Shard(0)`` placement is detected
    without it. Every rank passes the same hidden rows and targets and gets the same loss; see
    :mod:`.vocab_parallel`. Fused impls only.

    ``chunk_size``: rows per chunk (default: about 1 GiB of logits per chunk on CUDA, 4096
    rows at V=128256 bf16; 64 MiB of float32 on CPU; under ``vocab_parallel`` counted on
    ``ceil(V / world)`` columns so that every rank cuts the same chunks). ``check_ids``: verify
    that the top-k ids are distinct and in range (one sort of ``[N, k]``); out-of-range ids are
    never silently accepted by the gathers, but duplicates would be.

    Under ``torch.autocast`` with float32 ``hidden``, ``hidden``/``weight``/``bias`` are cast to
    the autocast dtype first (differentiably), as the matmul would be; the rest of the loss
    runs with autocast off. Raises :class:`LossInputError` (a ``ValueError``) for any bad
    argument.
    """
    spec = LossSpec(
        loss=loss,
        beta=beta,
        temperature=temperature,
        ce_weight=ce_weight,
        has_tail=tail_mass is not None,
        targets=targets,
    )
    check_options(reduction, chunk_size, grad_weight_dtype, kernels, impl)
    triton = use_triton(kernels, hidden.device)
    if vocab_parallel is not None and not isinstance(vocab_parallel, VocabParallel):
        raise LossInputError(f"vocab_parallel must be a VocabParallel, got {vocab_parallel!r}")
    weight, bias, hidden, shard = from_dtensor(weight, bias, hidden)
    if vocab_parallel is not None:
        if shard is None:
            shard = resolve_shard(vocab_parallel, weight.shape[0], weight.device)
        elif not vocab_parallel.reduce_grad_hidden:
            shard = dataclasses.replace(shard, reduce_grad_hidden=False)
    impl = resolve_impl(
        impl,
        reduction,
        n_rows=_n_rows(hidden),
        vocab=weight.shape[0],
        device=hidden.device,
        chunk_size=chunk_size,
        sharded=shard is not None,
    )
    if shard is not None and impl not in ("fused_chunked", "fused_chunked_recompute"):
        raise LossInputError(f"a vocab-parallel lm-head needs a fused impl, got impl={impl!r}")
    hidden, weight, bias = autocast_inputs(hidden, weight, bias)
    prep = prepare(
        hidden,
        weight,
        topk_ids,
        topk_logprobs,
        tail_mass,
        bias,
        labels,
        mask,
        ignore_index,
        ce_weight,
        check_ids,
        targets=targets,
        vocab_global=None if shard is None else shard.vocab,
        sort_dups=impl != "small_vocab",
    )
    if shard is not None:
        check_same_rows(prep.ids, prep.valid, shard)
    n_rows = prep.valid.numel()
    chunk, acc = plan_chunks(chunk_size, n_rows, weight, shard, grad_weight_dtype, prep.n_valid)
    if impl == "fused_chunked":
        scale = 1.0 if reduction == "sum" else 1.0 / max(prep.n_valid, 1)
        return chunked_loss(TopKChunks(spec, prep, shard, triton), chunk, acc, scale)
    if impl == "small_vocab":
        rows = small_vocab_rows(spec, prep, check_ids)
    else:
        rows = _rows(impl, spec, prep, chunk, acc, shard, triton)
    if reduction == "none":
        return rows.reshape(prep.lead_shape)
    total = rows.sum()
    return total if reduction == "sum" else total / max(prep.n_valid, 1)


def _n_rows(hidden: torch.Tensor) -> int | None:
    """Rows of ``hidden [..., d]`` (``None`` for a shape that ``prepare`` will reject)."""
    if hidden.dim() < 2 or hidden.shape[-1] == 0:
        return None
    return hidden.numel() // hidden.shape[-1]


def autocast_inputs(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Under autocast, run the projection in the autocast dtype, as ``torch.mm`` would.

    The casts are differentiable, so the gradients reach fp32 parameters in fp32.
    """
    dev = hidden.device.type
    if not (torch.is_autocast_enabled(dev) and hidden.dtype == torch.float32):
        return hidden, weight, bias
    dt = torch.get_autocast_dtype(dev)
    return hidden.to(dt), weight.to(dt), None if bias is None else bias.to(dt)


def _rows(
    impl: str,
    spec: LossSpec,
    prep: Prepared,
    chunk: int,
    acc: torch.dtype | None,
    shard: VocabShard | None,
    triton: bool,
) -> torch.Tensor:
    if impl == "dense":
        return dense_row_losses(spec, prep)
    if impl == "forward_chunked":
        return forward_chunked_rows(spec, prep, chunk, triton)
    return chunked_loss(TopKChunks(spec, prep, shard, triton), chunk, acc, None)
